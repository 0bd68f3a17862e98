"""Starting the fleet's workflows, waiting until all are Ready, and ending them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

from temporalio.client import Client, WorkflowHandle

from bench.fleet.parameters import FLEET_PROVIDER, INTERVAL
from tests.helpers.tls_origin import TlsOrigin
from workflows.lifecycle import ProxyLifecycle

T = TypeVar("T")


async def bounded(aws: Iterable[Awaitable[T]], limit: int) -> list[T]:
    gate = asyncio.Semaphore(limit)

    async def one(aw: Awaitable[T]) -> T:
        async with gate:
            return await aw

    return await asyncio.gather(*(one(aw) for aw in aws))


async def count(client: Client, query: str) -> int:
    return (await client.count_workflows(query)).count


async def start_fleet(
    client: Client, task_queue: str, origin: TlsOrigin, ids: list[str], concurrency: int
) -> None:
    async def start(workflow_id: str) -> WorkflowHandle[Any, Any]:
        return await client.start_workflow(
            ProxyLifecycle.run,
            {
                "provider": FLEET_PROVIDER,
                "health": {"target": origin.url, "interval_seconds": INTERVAL},
            },
            id=workflow_id,
            task_queue=task_queue,
        )

    await bounded((start(i) for i in ids), concurrency)


async def wait_all_ready(client: Client, task_queue: str, proxies: int, within: float) -> None:
    deadline = time.monotonic() + within
    ready = 0
    while time.monotonic() < deadline:
        ready = await count(client, f"TaskQueue = '{task_queue}' AND ProxyState = 'Ready'")
        ended = await count(client, f"TaskQueue = '{task_queue}' AND ExecutionStatus != 'Running'")
        if ended:
            raise RuntimeError(f"{ended} workflows ended before all were Ready")
        if ready >= proxies:
            return
        await asyncio.sleep(2)
    raise RuntimeError(f"only {ready} of {proxies} proxies Ready after {within:.0f} s")


async def terminate_fleet(
    client: Client, task_queue: str, ids: list[str], concurrency: int, within: float = 600
) -> float:
    """The `terminate` signal to every proxy; seconds until none is running."""
    start = time.monotonic()
    await bounded(
        (client.get_workflow_handle(i).signal(ProxyLifecycle.terminate, "bench done") for i in ids),
        concurrency,
    )
    query = f"TaskQueue = '{task_queue}' AND ExecutionStatus = 'Running'"
    while await count(client, query):
        if time.monotonic() - start > within:
            raise RuntimeError("proxies still running after the terminate signal")
        await asyncio.sleep(1)
    return time.monotonic() - start


async def hard_terminate(client: Client, task_queue: str) -> None:
    """Failure path: end whatever is still running, without a worker."""
    query = f"TaskQueue = '{task_queue}' AND ExecutionStatus = 'Running'"
    handles = [
        client.get_workflow_handle(execution.id) async for execution in client.list_workflows(query)
    ]
    await bounded((h.terminate("bench.fleet cleanup") for h in handles), 50)
