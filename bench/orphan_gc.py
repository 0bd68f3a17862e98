"""Orphan GC over a large fleet: how long a sweep takes, and how many Temporal calls.

    python -m bench.orphan_gc [--instances 10000] [--orphans 300]

A real dev server and a real worker (build_worker, OrphanGC and its
activities) sweep the in-memory provider (type `memory`, providers/memory.py).
Owners are real ProxyLifecycle executions without a worker, whose search
attributes say what they own; orphans are split among closed owners, owners
that never existed and old generations of running owners, and a few recent
instances stand for the grace period.

Three sweeps: a dry run, a sweep that deletes the orphans, and a steady-state
sweep with nothing left to delete. Every request the worker's client makes is
counted from the SDK's own metrics (a MetricBuffer), by operation. Prints a table and asserts
nothing: the figures feed docs/benchmarks.md and depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from temporalio.client import Client
from temporalio.runtime import MetricBuffer, Runtime, TelemetryConfig

from activities.gc import GcActivities
from activities.provider import ProviderActivities
from providers.memory import MemoryProvider
from providers.naming import instance_name
from tests.fakes.owners import start_owner
from tests.helpers.config import build_config
from tests.helpers.temporal import start_dev_server
from worker import build_worker
from workflows.orphan_gc import GcResult

PROVIDER = "memory"
INSTALLATION = "bench"
# Owners started at once while building the fleet.
SETUP_CONCURRENCY = 200
VISIBILITY = {"ListWorkflowExecutions", "CountWorkflowExecutions"}
DESCRIBE = {"DescribeWorkflowExecution"}
# Every gRPC call the SDK makes: short ones, and long polls.
REQUEST_METRICS = {"temporal_request", "temporal_long_request"}
METRIC_BUFFER_SIZE = 1_000_000


@dataclass
class Sweep:
    label: str
    seconds: float
    result: GcResult
    requests: Counter[str]


async def build_fleet(
    client: Client, provider: MemoryProvider, instances: int, orphans: int
) -> int:
    """`instances` tagged instances, `orphans` of them orphans; returns the owners started."""
    young = max(1, orphans // 10)
    per_kind = orphans // 3
    closed, missing = per_kind, per_kind
    old_generations = orphans - closed - missing
    live = instances - orphans - young - old_generations  # each replaced owner also owns one
    owners_queue = f"owners-{uuid.uuid4().hex[:8]}"
    started = 0

    async def owner(generation: int) -> str:
        nonlocal started
        owner_id = f"bench-{uuid.uuid4().hex[:16]}"
        await start_owner(
            client,
            owner_id,
            provider=PROVIDER,
            instances=[instance_name(owner_id, generation)],
            task_queue=owners_queue,
        )
        started += 1
        return owner_id

    async def live_owner() -> None:
        provider.add(INSTALLATION, await owner(0), 0)

    async def replaced_owner() -> None:
        owner_id = await owner(1)
        provider.add(INSTALLATION, owner_id, 1)
        provider.add(INSTALLATION, owner_id, 0)

    async def closed_owner() -> None:
        owner_id = await owner(0)
        provider.add(INSTALLATION, owner_id, 0)
        await client.get_workflow_handle(owner_id).terminate()

    await _bounded(
        [live_owner() for _ in range(live)]
        + [replaced_owner() for _ in range(old_generations)]
        + [closed_owner() for _ in range(closed)]
    )
    for _ in range(missing):
        provider.add(INSTALLATION, f"gone-{uuid.uuid4().hex}", 0)
    for _ in range(young):
        provider.add(INSTALLATION, f"new-{uuid.uuid4().hex}", 0, age=timedelta(0))
    return started


async def sweep(
    client: Client, task_queue: str, metrics: MetricBuffer, label: str, **inp: Any
) -> Sweep:
    _requests(metrics)  # what came before is not this sweep's
    start = time.monotonic()
    result = await client.execute_workflow(
        "OrphanGC",
        inp,
        id=f"orphan-gc-{uuid.uuid4().hex[:8]}",
        task_queue=task_queue,
        result_type=GcResult,
    )
    seconds = time.monotonic() - start
    return Sweep(label, seconds, result, _requests(metrics))


async def run(instances: int, orphans: int) -> None:
    env = await start_dev_server()
    metrics = MetricBuffer(METRIC_BUFFER_SIZE)
    runtime = Runtime(telemetry=TelemetryConfig(metrics=metrics))
    try:
        client = await Client.connect(
            env.client.service_client.config.target_host,
            namespace=env.client.namespace,
            runtime=runtime,
        )
        provider = MemoryProvider()
        start = time.monotonic()
        owners = await build_fleet(env.client, provider, instances, orphans)
        print(
            f"fleet: {len(provider.ids())} instances, {owners} owner workflows "
            f"(built in {time.monotonic() - start:.1f} s)"
        )
        config = build_config(
            {"name": PROVIDER, "type": "memory"},
            connect_ports=[443],
            installation=INSTALLATION,
        )
        activities = ProviderActivities({PROVIDER: provider}, config)
        gc = GcActivities({PROVIDER: provider}, INSTALLATION, client)
        task_queue = f"bench-gc-{uuid.uuid4().hex[:8]}"
        async with build_worker(client, activities, gc=gc, task_queue=task_queue):
            # Let the worker's pollers settle, so their start is not counted.
            await asyncio.sleep(1)
            sweeps = [
                await sweep(client, task_queue, metrics, "dry run", dry_run=True),
                await sweep(client, task_queue, metrics, "sweep, deleting"),
                await sweep(client, task_queue, metrics, "steady state"),
            ]
        activities.close()
    finally:
        await env.shutdown()
    _print(instances, sweeps)


def _print(instances: int, sweeps: list[Sweep]) -> None:
    rows = [
        "seconds",
        "seen / owned / orphaned / deleted / skipped / failed",
        "GC look-ups (visibility pages + describes)",
        "Temporal requests, all",
        "  visibility (List)",
        "  describe",
        "  worker polls and responses",
        "  other",
    ]
    table: list[list[str]] = [[row] for row in rows]
    for s in sweeps:
        [p] = s.result.providers
        total = sum(s.requests.values())
        visibility = sum(s.requests[op] for op in VISIBILITY)
        describe = sum(s.requests[op] for op in DESCRIBE)
        worker = sum(n for op, n in s.requests.items() if op.startswith(("Poll", "Respond")))
        values = [
            f"{s.seconds:.2f}",
            f"{p.seen} / {p.owned} / {p.orphaned} / {p.deleted} / {p.skipped} / {p.failed}",
            str(p.lookups),
            str(total),
            str(visibility),
            str(describe),
            str(worker),
            str(total - visibility - describe - worker),
        ]
        for row, value in zip(table, values, strict=True):
            row.append(value)
    headers = [f"orphan GC, {instances} instances", *(s.label for s in sweeps)]
    widths = [max(len(r[i]) for r in [headers, *table]) for i in range(len(headers))]
    for row in [headers, ["-" * w for w in widths], *table]:
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


def _requests(metrics: MetricBuffer) -> Counter[str]:
    """Requests the worker's client made since the last call, by operation (polls included)."""
    counts: Counter[str] = Counter()
    for update in metrics.retrieve_updates():
        if update.metric.name in REQUEST_METRICS:
            counts[str(update.attributes.get("operation", "?"))] += int(update.value)
    return counts


async def _bounded(jobs: Iterable[Awaitable[None]]) -> None:
    limit = asyncio.Semaphore(SETUP_CONCURRENCY)

    async def one(job: Awaitable[None]) -> None:
        async with limit:
            await job

    await asyncio.gather(*(one(job) for job in jobs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=10_000)
    parser.add_argument("--orphans", type=int, default=300)
    args = parser.parse_args()
    asyncio.run(run(args.instances, args.orphans))


if __name__ == "__main__":
    main()
