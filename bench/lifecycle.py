"""ProxyLifecycle against its targets (docs/benchmarks.md), with the local provider.

    python -m bench.lifecycle [--runs 20] [--proxies 10] [--minutes 5]

1. Time to Ready: the same provider calls made directly (create, poll until
   running, probe until ok) against `workflow start` -> status Ready, median
   of `--runs` each; the difference is the orchestration overhead.
2. Steady state: `--proxies` proxies probing every 10 s for `--minutes`:
   history events and worker-to-server requests (from the SDK's own
   `temporal_request` metric), scaled to one proxy-hour. The monitor reports
   back once an hour; that cycle's events are measured separately with a
   short monitor period and added.
3. Detection: a proxy's Squid is killed; time until the replacement's create
   is scheduled, in probe intervals.

Real dev server, real Squid, a local TLS origin. Prints tables, asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import time
import urllib.request
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig
from temporalio.testing import WorkflowEnvironment

from activities.models import MonitorInput, MonitorOutcome
from activities.probe import probe_connect
from activities.provider import ProviderActivities
from providers.base import CreateRequest, InstanceState
from providers.config import Config
from providers.local import LocalConfig, LocalProvider
from providers.naming import instance_name, owner_tags
from tests.helpers.config import build_config, local_entry
from tests.helpers.network import free_port
from tests.helpers.state_dir import local_state_dir
from tests.helpers.temporal import start_dev_server
from tests.helpers.tls_origin import TlsOrigin, serve_tls_origin
from worker import build_worker
from workflows.lifecycle import ProxyLifecycle, ProxyStatus

PASSWORD = "bench-password-4b9e1c07"  # at least 16 characters, as the config requires
POLL = 0.005
INTERVAL = 10


def config_for(origin: TlsOrigin, state_dir: Path) -> Config:
    return build_config(
        local_entry(state_dir),
        connect_ports=[origin.port],
        installation="bench",
        password=PASSWORD,
    )


async def direct_time_to_ready(provider: LocalProvider, config: Config, origin: TlsOrigin) -> float:
    """The provider calls the workflow makes, made in a plain loop."""
    owner = f"direct-{uuid.uuid4().hex[:8]}"
    start = time.perf_counter()
    instance = await asyncio.to_thread(
        provider.create,
        CreateRequest(
            name=instance_name(owner, 0),
            proxy=config.proxy_settings(),
            tags=owner_tags(config.installation, owner, 0),
        ),
    )
    while instance.state is not InstanceState.RUNNING:
        await asyncio.sleep(POLL)
        instance = await asyncio.to_thread(provider.get, instance.provider_id)
    while not (
        await probe_connect(
            instance.ip, instance.port, "proxy", PASSWORD, origin.url,
            ssl_context=origin.client_ssl_context,
        )
    ).ok:  # fmt: skip
        await asyncio.sleep(POLL)
    elapsed = time.perf_counter() - start
    await asyncio.to_thread(provider.delete, instance.provider_id)
    return elapsed


async def workflow_time_to_ready(client: Client, task_queue: str, origin: TlsOrigin) -> float:
    start = time.perf_counter()
    handle = await client.start_workflow(
        ProxyLifecycle.run,
        {"provider": "local", "health": {"target": origin.url, "interval_seconds": INTERVAL}},
        id=f"bench-{uuid.uuid4().hex[:8]}",
        task_queue=task_queue,
    )
    while (await handle.query(ProxyLifecycle.status)).state != "Ready":
        await asyncio.sleep(POLL)
    elapsed = time.perf_counter() - start
    await handle.signal(ProxyLifecycle.terminate)
    await handle.result()
    return elapsed


async def history_length(handle: WorkflowHandle[Any, Any]) -> int:
    return len([e async for e in handle.fetch_history_events()])


def sdk_requests(metrics_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("temporal_request", "temporal_long_request"):
            for sample in family.samples:
                operation = sample.labels.get("operation", "?")
                counts[operation] = counts.get(operation, 0) + sample.value
    return counts


async def wait_ready(handles: list[WorkflowHandle[Any, Any]]) -> list[ProxyStatus]:
    statuses = []
    for handle in handles:
        while (status := await handle.query(ProxyLifecycle.status)).state != "Ready":
            await asyncio.sleep(0.1)
        statuses.append(status)
    return statuses


async def start_proxies(
    client: Client, task_queue: str, origin: TlsOrigin, count: int
) -> list[WorkflowHandle[Any, Any]]:
    return [
        await client.start_workflow(
            ProxyLifecycle.run,
            {"provider": "local", "health": {"target": origin.url, "interval_seconds": INTERVAL}},
            id=f"bench-{uuid.uuid4().hex[:8]}",
            task_queue=task_queue,
        )
        for _ in range(count)
    ]


async def terminate_all(handles: list[WorkflowHandle[Any, Any]]) -> None:
    for handle in handles:
        await handle.signal(ProxyLifecycle.terminate)
    for handle in handles:
        await handle.result()


async def main(args: argparse.Namespace) -> None:
    metrics_port = free_port()
    runtime = Runtime(
        telemetry=TelemetryConfig(
            metrics=PrometheusConfig(bind_address=f"127.0.0.1:{metrics_port}")
        )
    )
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    env: WorkflowEnvironment = await start_dev_server()
    client = await Client.connect(
        env.client.service_client.config.target_host,
        namespace=env.client.namespace,
        runtime=runtime,
    )
    with serve_tls_origin() as origin, local_state_dir("proxy-operator-bench-") as state_dir:
        config = config_for(origin, state_dir)
        provider = LocalProvider(LocalConfig(state_dir=str(state_dir)), config.installation)
        activities = activities_for(config, provider, origin)
        task_queue = f"bench-{uuid.uuid4().hex[:8]}"
        worker = build_worker(client, activities, task_queue=task_queue)
        async with worker:
            await workflow_time_to_ready(client, task_queue, origin)  # warm up caches
            await direct_time_to_ready(provider, config, origin)
            direct = [
                await direct_time_to_ready(provider, config, origin) for _ in range(args.runs)
            ]
            orchestrated = [
                await workflow_time_to_ready(client, task_queue, origin) for _ in range(args.runs)
            ]
            print_time_to_ready(direct, orchestrated)

            handles = await start_proxies(client, task_queue, origin, args.proxies)
            await wait_ready(handles)
            events_before = [await history_length(h) for h in handles]
            requests_before = sdk_requests(metrics_url)
            await asyncio.sleep(args.minutes * 60)
            events_after = [await history_length(h) for h in handles]
            requests_after = sdk_requests(metrics_url)
            print_steady_state(args, events_before, events_after, requests_before, requests_after)
            await detection(handles[0], state_dir)
            await terminate_all(handles)
        activities.close()

        # One monitor cycle's cost, measured with a monitor that reports back
        # every 30 s instead of every hour.
        task_queue = f"bench-{uuid.uuid4().hex[:8]}"
        activities = ShortMonitor(
            {"local": provider}, config, ssl_context=origin.client_ssl_context
        )
        async with build_worker(client, activities, task_queue=task_queue):
            handles = await start_proxies(client, task_queue, origin, 1)
            await wait_ready(handles)
            before = await history_length(handles[0])
            await asyncio.sleep(95)
            cycle = (await history_length(handles[0]) - before) / 3
            await terminate_all(handles)
        activities.close()
        print(f"\nhistory events per hourly monitor cycle: {cycle:.1f}")
    await env.shutdown()


class ShortMonitor(ProviderActivities):
    @activity.defn(name="monitor")
    async def monitor(self, inp: MonitorInput) -> MonitorOutcome:
        return await super().monitor(replace(inp, max_duration_seconds=30))


def activities_for(
    config: Config, provider: LocalProvider, origin: TlsOrigin
) -> ProviderActivities:
    return ProviderActivities({"local": provider}, config, ssl_context=origin.client_ssl_context)


async def detection(handle: WorkflowHandle[Any, Any], state_dir: Path) -> None:
    status = await handle.query(ProxyLifecycle.status)
    pid = int(json.loads((state_dir / status.instance / "instance.json").read_text())["pid"])
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    while True:
        events = [e async for e in handle.fetch_history_events()]
        creates = [
            e
            for e in events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
            and e.activity_task_scheduled_event_attributes.activity_type.name == "create_instance"
        ]
        if len(creates) >= 2:
            scheduled = creates[-1].event_time.ToDatetime().timestamp()
            break
        await asyncio.sleep(0.2)
    seconds = scheduled - killed
    print(
        f"\ndead proxy -> replacement create scheduled: {seconds:.1f} s "
        f"= {seconds / INTERVAL:.2f} probe intervals (target: within 3)"
    )


def print_time_to_ready(direct: list[float], orchestrated: list[float]) -> None:
    d, o = statistics.median(direct), statistics.median(orchestrated)
    print(f"time to Ready, local provider (median of {len(direct)})")
    print("| path | p50 ms | min ms | max ms |")
    print("| --- | ---: | ---: | ---: |")
    for name, values in (
        ("provider calls made directly", direct),
        ("ProxyLifecycle", orchestrated),
    ):
        ms = [v * 1000 for v in values]
        print(f"| {name} | {statistics.median(ms):.0f} | {min(ms):.0f} | {max(ms):.0f} |")
    print(f"| orchestration overhead | {(o - d) * 1000:.0f} | | |")


def print_steady_state(
    args: argparse.Namespace,
    events_before: list[int],
    events_after: list[int],
    requests_before: dict[str, float],
    requests_after: dict[str, float],
) -> None:
    hours = args.minutes / 60
    proxy_hours = hours * args.proxies
    events = sum(events_after) - sum(events_before)
    print(f"\nsteady state: {args.proxies} proxies, {args.minutes} min, probes every {INTERVAL} s")
    print(f"history events in the window: {events} -> {events / proxy_hours:.1f} per proxy-hour")
    print("| request | count | per proxy-hour |")
    print("| --- | ---: | ---: |")
    total = 0.0
    for operation in sorted(requests_after):
        count = requests_after[operation] - requests_before.get(operation, 0)
        if count:
            total += count
            print(f"| {operation} | {count:.0f} | {count / proxy_hours:.1f} |")
    print(f"| all | {total:.0f} | {total / proxy_hours:.1f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--proxies", type=int, default=10)
    parser.add_argument("--minutes", type=float, default=5)
    asyncio.run(main(parser.parse_args()))
