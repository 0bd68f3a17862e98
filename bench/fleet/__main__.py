"""`python -m bench.fleet`: the fleet benchmark, start to end (see bench/fleet/__init__.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
import uuid

from temporalio.client import Client

from bench.fleet import __doc__ as description
from bench.fleet.control import hard_terminate, start_fleet, terminate_fleet, wait_all_ready
from bench.fleet.parameters import SETTLE_SECONDS
from bench.fleet.report import Run, analyse, print_report
from bench.fleet.sampling import cpu_snapshot, memory_at_end, rss_kib
from bench.fleet.squids import SquidGround, create_squids, squid_capacity, squid_ground
from bench.fleet.worker_process import WorkerProcess, worker_spec
from tests.helpers.temporal import start_dev_server


async def main(args: argparse.Namespace) -> None:
    env = await start_dev_server()
    try:
        async with squid_ground("fleet") as ground:
            await run_fleet(args, env.client, ground)
    finally:
        await env.shutdown()


async def run_fleet(
    args: argparse.Namespace,
    client: Client,
    ground: SquidGround,
) -> None:
    origin = ground.origin
    endpoints = await create_squids(ground.squids, ground.config, args.squids)
    capacity = await squid_capacity(endpoints, origin)
    spec = worker_spec(client, origin, endpoints, ground.workdir, "fleet")
    task_queue = spec["task_queue"]
    worker = WorkerProcess(ground.workdir, spec)
    run_id = uuid.uuid4().hex[:6]
    ids = [f"fleet-{run_id}-{i}" for i in range(args.proxies)]
    terminated = False
    try:
        await worker.wait_ready()
        started = time.monotonic()
        await start_fleet(client, task_queue, origin, ids, args.concurrency)
        await wait_all_ready(client, task_queue, args.proxies, within=600 + args.proxies)
        ready_seconds = time.monotonic() - started
        print(f"all {args.proxies} proxies Ready after {ready_seconds:.0f} s", flush=True)
        await asyncio.sleep(SETTLE_SECONDS)

        before = cpu_snapshot(worker.pid)
        rss: list[int] = []
        end = before.at + args.minutes * 60
        while (now := time.monotonic()) < end:
            rss.append(rss_kib(worker.pid))
            await asyncio.sleep(min(1.0, end - now))
        after = cpu_snapshot(worker.pid)
        memory = memory_at_end(worker.pid, rss)
        data = await worker.results_now()

        terminate_seconds = await terminate_fleet(client, task_queue, ids, args.concurrency)
        terminated = True
    finally:
        if not terminated:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(hard_terminate(client, task_queue), 120)
        await worker.stop()
    measured = analyse(data, before.at, after.at, args.proxies)
    print_report(
        Run(
            args,
            measured,
            before,
            after,
            memory,
            ready_seconds,
            terminate_seconds,
            capacity,
        )
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(description or "").split("\n")[0])
    parser.add_argument("--proxies", type=int, default=1000)
    parser.add_argument("--squids", type=int, default=10)
    parser.add_argument("--minutes", type=float, default=3)
    parser.add_argument(
        "--concurrency", type=int, default=50, help="workflow starts and signals at a time"
    )
    return parser.parse_args()


if __name__ == "__main__":
    try:
        asyncio.run(main(parse_args()))
    except KeyboardInterrupt:
        print("interrupted: workflows, worker, Squids and dev server stopped", file=sys.stderr)
        sys.exit(130)
