"""`python -m bench.fleet`: the fleet benchmark, start to end (see bench/fleet/__init__.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

from temporalio.client import Client

from bench.fleet import __doc__ as description
from bench.fleet.control import hard_terminate, start_fleet, terminate_fleet, wait_all_ready
from bench.fleet.parameters import SETTLE_SECONDS, SQUID_PROVIDER, config_for
from bench.fleet.report import Run, analyse, print_report
from bench.fleet.sampling import cpu_snapshot, memory_at_end, rss_kib
from bench.fleet.squids import create_squids, delete_squids, squid_capacity
from bench.fleet.worker_process import WorkerProcess
from providers.config import Config
from providers.local import LocalConfig, LocalProvider
from tests.helpers.state_dir import local_state_dir
from tests.helpers.temporal import start_dev_server
from tests.helpers.tls_origin import TlsOrigin, serve_tls_origin


async def main(args: argparse.Namespace) -> None:
    env = await start_dev_server()
    try:
        with (
            serve_tls_origin() as origin,
            local_state_dir("proxy-operator-fleet-") as state_dir,
            tempfile.TemporaryDirectory(prefix="bench-fleet-") as workdir,
        ):
            config = config_for(origin.port, str(state_dir), SQUID_PROVIDER)
            squids = LocalProvider(LocalConfig(state_dir=str(state_dir)), config.installation)
            try:
                await run_fleet(args, env.client, origin, squids, config, Path(workdir))
            finally:
                await delete_squids(squids)
    finally:
        await env.shutdown()


async def run_fleet(
    args: argparse.Namespace,
    client: Client,
    origin: TlsOrigin,
    squids: LocalProvider,
    config: Config,
    workdir: Path,
) -> None:
    endpoints = await create_squids(squids, config, args.squids)
    capacity = await squid_capacity(endpoints, origin)
    ca_file = workdir / "ca.pem"
    origin.ca.cert_pem.write_to_path(str(ca_file))
    task_queue = f"bench-fleet-{uuid.uuid4().hex[:8]}"
    worker = WorkerProcess(
        workdir,
        {
            "target_host": client.service_client.config.target_host,
            "namespace": client.namespace,
            "task_queue": task_queue,
            "endpoints": endpoints,
            "origin_port": origin.port,
            "ca_file": str(ca_file),
            "state_dir": str(workdir / "unused"),
            "parent_pid": os.getpid(),
        },
    )
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
