"""ProxyPool against its targets (docs/benchmarks.md).

    python -m bench.pool [--members 200] [--squids 4] [--steady-minutes 3] [--real 20]

1. A pool of `--members` on the in-memory provider, every instance served by
   one of `--squids` real local Squids (probes are real): time from start to
   all Ready, and the pool's workflow tasks on the way (the longest, how many
   took over a second, how many the server timed out, the largest event and
   history before a continue-as-new, read from its histories); then, with
   nothing to scale or rotate, the pool's history events over
   `--steady-minutes`, scaled to a pool-hour, and the CPU the process (worker
   and this script) used meanwhile.
2. A pool of `--real` real local Squids: time to all Ready, then `rotate
   {"all": true}` to every member on a new instance, one surge at a time.

Real dev server, in-process worker, a local TLS origin. Prints tables,
asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError

from activities.metrics import POOL_MONITOR_LATE_SECONDS
from activities.provider import ProviderActivities
from bench.fleet.parameters import INSTALLATION
from bench.fleet.squids import create_squids, delete_squids
from bench.fleet.worker_process import PoolProvider
from providers.config import Config
from providers.local import LocalConfig, LocalProvider
from tests.helpers.config import build_config, local_entry
from tests.helpers.state_dir import local_state_dir
from tests.helpers.temporal import start_dev_server
from tests.helpers.tls_origin import TlsOrigin, serve_tls_origin
from worker import build_worker
from workflows.pool_input import MAX_REPLICAS

PASSWORD = "bench-pool-password-2f9c1e"
POLL = 5.0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", type=int, default=200)
    parser.add_argument("--squids", type=int, default=4)
    parser.add_argument("--steady-minutes", type=float, default=3.0)
    parser.add_argument("--real", type=int, default=20)
    args = parser.parse_args()
    if args.members > MAX_REPLICAS:
        parser.error(f"--members: a pool holds at most {MAX_REPLICAS} (workflows/pool_input.py)")
    env = await start_dev_server()
    try:
        with serve_tls_origin() as origin, local_state_dir() as state_dir:
            local = LocalProvider(LocalConfig(state_dir=str(state_dir)), INSTALLATION)
            config = _config(origin, local_entry(state_dir))
            try:
                await _memory_pool(env.client, origin, local, config, args)
                if args.real:
                    await _real_pool(env.client, origin, local, config, args.real)
            finally:
                await delete_squids(local)
    finally:
        await env.shutdown()


def _config(origin: TlsOrigin, entry: dict[str, Any]) -> Config:
    return build_config(
        entry, connect_ports=[443, origin.port], installation=INSTALLATION, password=PASSWORD
    )


async def _memory_pool(
    client: Client, origin: TlsOrigin, local: LocalProvider, local_config: Config, args: Any
) -> None:
    squids = await create_squids(local, local_config, args.squids)
    config = _config(origin, {"name": "memory", "type": "memory"})
    provider = PoolProvider(squids)
    async with _worker(client, {"memory": provider}, config, origin) as task_queue:
        template = {"provider": "memory", "health": {"target": origin.url}}
        handle, ready_s = await _start_until_ready(client, task_queue, args.members, template)
        tasks = await _task_figures(client, handle)
        # Let the last reports and the first reconcile settle, then watch.
        await asyncio.sleep(15)
        events_before = await _events(handle)
        late_before = _late_rounds()
        cpu_before, wall_before = time.process_time(), time.monotonic()
        await asyncio.sleep(args.steady_minutes * 60)
        cpu = time.process_time() - cpu_before
        wall = time.monotonic() - wall_before
        events = await _events(handle) - events_before
        late = _late_rounds() - late_before
        await handle.signal("terminate")
        await handle.result()
    per_hour = events * 3600 / wall
    print(f"\nPool of {args.members} on the memory provider ({args.squids} real Squids behind)")
    print("| what | figure |\n| --- | --- |")
    print(f"| start to all {args.members} Ready | {ready_s:.1f} s |")
    print(f"| pool runs (continue-as-new) until all Ready | {tasks.runs} |")
    print(f"| longest pool workflow task | {tasks.longest_s:.2f} s |")
    print(f"| pool workflow tasks over 1 s | {tasks.over_1s} of {tasks.tasks} |")
    causes = ", ".join(f"{n} {c}" for c, n in tasks.failed_causes.most_common()) or "none"
    print(f"| pool workflow tasks timed out / failed | {tasks.timed_out} / {tasks.failed} |")
    print(f"| why they failed (server's cause) | {causes} |")
    print(f"| largest pool history event (a payload) | {tasks.largest_event / 1024:.0f} KiB |")
    print(f"| largest pool history (one run) | {tasks.largest_history / 1024:.0f} KiB |")
    print(f"| pool history events in {wall / 60:.1f} min of steady state | {events} |")
    print(f"| pool history events per pool-hour (scaled) | {per_hour:.0f} |")
    print(
        f"| pool monitor rounds in steady state (each probes its shard) | {late[None]:.0f}: "
        f"{late[None] - late[1.0]:.0f} started over 1 s late, "
        f"{late[None] - late[10.0]:.0f} over 10 s (an interval) |"
    )
    print(
        f"| process CPU (worker + this script), steady state | {100 * cpu / wall:.1f} % of a core |"
    )


async def _real_pool(
    client: Client, origin: TlsOrigin, local: LocalProvider, config: Config, members: int
) -> None:
    async with _worker(client, {"local": local}, config, origin) as task_queue:
        template = {"provider": "local", "health": {"target": origin.url}}
        handle, ready_s = await _start_until_ready(client, task_queue, members, template)
        started = time.monotonic()
        await handle.execute_update("rotate", {"all": True})
        least_ready = members

        async def rotated() -> bool:
            nonlocal least_ready
            status = await handle.query("status")
            least_ready = min(least_ready, status["ready"])
            return status["ready"] == members and all(
                m["generation"] >= 1 for m in status["members"]
            )

        await _until(rotated)
        rotate_s = time.monotonic() - started
        await handle.signal("terminate")
        await handle.result()
    print(f"\nPool of {members} real local Squids (max_surge 1)")
    print("| what | figure |\n| --- | --- |")
    print(f"| start to all {members} Ready | {ready_s:.1f} s |")
    print(f"| rotate all, to every member on a new instance | {rotate_s:.1f} s |")
    print(f"| fewest Ready members seen while rotating | {least_ready} of {members} |")


class _worker:
    """An in-process worker on a task queue of its own."""

    def __init__(
        self, client: Client, providers: dict[str, Any], config: Config, origin: TlsOrigin
    ) -> None:
        self._acts = ProviderActivities(providers, config, ssl_context=origin.client_ssl_context)
        self._task_queue = f"bench-pool-{uuid.uuid4().hex[:8]}"
        self._worker = build_worker(client, self._acts, task_queue=self._task_queue)
        self._run: asyncio.Task[None] | None = None

    async def __aenter__(self) -> str:
        self._run = asyncio.create_task(self._worker.run())
        return self._task_queue

    async def __aexit__(self, *_: object) -> None:
        await self._worker.shutdown()
        self._acts.close()


async def _start_until_ready(
    client: Client, task_queue: str, members: int, template: dict[str, Any]
) -> tuple[WorkflowHandle[Any, Any], float]:
    started = time.monotonic()
    handle = await client.start_workflow(
        "ProxyPool",
        {"replicas": members, "template": template},
        id=f"bench-pool-{uuid.uuid4().hex[:8]}",
        task_queue=task_queue,
    )

    async def ready() -> bool:
        return bool((await handle.query("status"))["ready"] == members)

    await _until(ready)
    return handle, time.monotonic() - started


async def _until(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll `check` until true; a query the busy worker did not answer in time is asked again."""
    while True:
        try:
            if await check():
                return
        except RPCError as err:
            print(f"(query not answered, asked again: {err})")
        await asyncio.sleep(POLL)


@dataclass
class _TaskFigures:
    runs: int = 0
    tasks: int = 0
    longest_s: float = 0.0
    over_1s: int = 0
    timed_out: int = 0
    failed: int = 0
    # Why the failed ones failed, by the server's cause (WorkflowTaskFailedCause).
    failed_causes: Counter[str] = field(default_factory=Counter)
    largest_event: int = 0
    largest_history: int = 0


async def _task_figures(client: Client, handle: WorkflowHandle[Any, Any]) -> _TaskFigures:
    """The pool's workflow tasks in every run so far, from its histories.

    A task lasts from its WorkflowTaskStarted to its Completed (server time,
    which includes the worker's wait for activations, as the server's task
    timeout does).
    """
    figures = _TaskFigures()
    run_id: str | None = handle.first_execution_run_id or handle.result_run_id
    while run_id:
        figures.runs += 1
        run = client.get_workflow_handle(handle.id, run_id=run_id)
        started: dict[int, datetime] = {}
        run_id = None
        async for event in run.fetch_history_events():
            figures.largest_event = max(figures.largest_event, event.ByteSize())
            when = event.event_time.ToDatetime()
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
                started[event.event_id] = when
                size = event.workflow_task_started_event_attributes.history_size_bytes
                figures.largest_history = max(figures.largest_history, size)
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
                attributes = event.workflow_task_completed_event_attributes
                took = (when - started[attributes.started_event_id]).total_seconds()
                figures.tasks += 1
                figures.longest_s = max(figures.longest_s, took)
                figures.over_1s += took > 1
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT:
                figures.timed_out += 1
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
                figures.failed += 1
                cause = event.workflow_task_failed_event_attributes.cause
                figures.failed_causes[WorkflowTaskFailedCause.Name(cause)] += 1
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
                attributes_can = event.workflow_execution_continued_as_new_event_attributes
                run_id = attributes_can.new_execution_run_id
    return figures


def _late_rounds() -> Counter[float | None]:
    """The pool monitors' rounds so far: how many started at most `le` seconds late (None: all).

    Read from the in-process worker's own histogram (activities/metrics.py).
    """
    counts: Counter[float | None] = Counter()
    for family in POOL_MONITOR_LATE_SECONDS.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                counts[None if le == float("inf") else le] = int(sample.value)
    return counts


async def _events(handle: WorkflowHandle[Any, Any]) -> int:
    return len((await handle.fetch_history()).events)


if __name__ == "__main__":
    asyncio.run(main())
