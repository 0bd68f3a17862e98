"""What the fleet costs in Temporal Cloud actions (docs/cost.md), counted as the server counts them.

    python -m bench.cost [--proxies 10] [--minutes 7] [--large 0] [--gateway-minutes 6]

(`--proxies 0 --large 1000`: only the large pool.)

The dev server runs with `--metrics-port`; its `/metrics` `action` counter
(labelled `action_type`) is what Temporal documents for estimating Cloud
usage from a self-hosted server. Every figure is a difference of that counter
over a window, for this benchmark's namespace only:

1. `--proxies` standalone ProxyLifecycles, steady state (`--minutes`);
2. a ProxyPool of `--proxies` members: its start, its steady state (the
   members' and the pool's own actions together), a full rotation
   (`rotate {"all": true}`), and a gateway following it (`--gateway-minutes`);
3. with `--large N`, a pool of N members, steady state;
4. a worker SIGKILLed: seconds until every monitor it ran runs on the other
   worker (which is started at the kill: two workers of the memory provider
   would not share instances).

One worker process (`bench.fleet.worker_process`: the memory provider, every
instance a real local Squid, so probes are real), health interval 10 s.
Prints tables, asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import Client, WorkflowHandle

from bench.fleet.control import bounded, start_fleet
from bench.fleet.parameters import FLEET_PROVIDER, INTERVAL
from bench.fleet.squids import SquidGround, create_squids, squid_ground
from bench.fleet.worker_process import WorkerProcess, worker_spec
from gateway import membership
from tests.helpers.network import free_port
from tests.helpers.temporal import start_dev_server
from tests.helpers.tls_origin import TlsOrigin

SQUIDS = 4
POLL = 1.0
# After the last proxy is Ready, before a window opens: first heartbeats,
# the last reports to the pool and its first reconcile are start-up, not steady state.
SETTLE_SECONDS = 60.0
# The activities that keep a Ready proxy monitored.
MONITOR_TYPES = frozenset({"monitor", "monitor_members"})
# What a gateway costs: its queries (a describe is not an action).
GATEWAY_ACTION = "grpc_QueryWorkflow"
GATEWAY_POLL_SECONDS = 2.0
GATEWAY_DEBOUNCE_SECONDS = 1.0
LIST_PRICE_PER_MILLION = 50.0
HOURS_PER_MONTH = 730


class Actions:
    """The dev server's billable `action` counter, by type, for one namespace."""

    def __init__(self, url: str, namespace: str) -> None:
        self._url = url
        self._namespace = namespace

    def now(self) -> Counter[str]:
        text = urllib.request.urlopen(self._url, timeout=10).read().decode()
        counts: Counter[str] = Counter()
        for family in text_string_to_metric_families(text):
            if family.name != "action":
                continue
            for sample in family.samples:
                if sample.labels.get("namespace") == self._namespace:
                    counts[sample.labels.get("action_type", "?")] += sample.value
        return counts

    async def over(self, seconds: float) -> tuple[Counter[str], float]:
        """The actions counted during the next `seconds`, and the window's real length."""
        before, started = self.now(), time.monotonic()
        await asyncio.sleep(seconds)
        return self.now() - before, time.monotonic() - started

    async def during(self, work: Awaitable[Any]) -> tuple[Counter[str], float]:
        before, started = self.now(), time.monotonic()
        await work
        return self.now() - before, time.monotonic() - started


def table(title: str, counts: Counter[str], per: float, unit: str) -> None:
    """`counts` by type, and each divided by `per` (proxy-hours, members...)."""
    print(f"\n{title}")
    print(f"| action type | count | per {unit} |")
    print("| --- | ---: | ---: |")
    for action_type, count in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"| {action_type} | {count:.0f} | {count / per:.2f} |")
    total = sum(counts.values())
    print(f"| **all** | {total:.0f} | **{total / per:.2f}** |", flush=True)


async def until(check: Callable[[], Awaitable[bool]], within: float) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(POLL)


class Bench:
    def __init__(
        self, args: argparse.Namespace, client: Client, actions: Actions, origin: TlsOrigin
    ) -> None:
        self.args = args
        self.client = client
        self.actions = actions
        self.origin = origin

    async def start_standalone(self, task_queue: str, count: int) -> list[str]:
        run = uuid.uuid4().hex[:6]
        ids = [f"cost-{run}-{i}" for i in range(count)]
        await start_fleet(self.client, task_queue, self.origin, ids, 20)
        already = await ready_count(self.client, task_queue)

        async def all_ready() -> bool:
            return await ready_count(self.client, task_queue) >= already + count

        await until(all_ready, 600 + count)
        return ids

    async def standalone(self, task_queue: str, count: int) -> list[str]:
        ids = await self.start_standalone(task_queue, count)
        await asyncio.sleep(SETTLE_SECONDS)
        await self.steady(f"standalone ProxyLifecycle x{count}", count, "proxy-hour")
        return ids

    async def steady(self, what: str, proxies: int, unit: str) -> None:
        """Count a window of `--minutes` and print it per proxy-hour."""
        counts, seconds = await self.actions.over(self.args.minutes * 60)
        table(
            f"{what}, steady state, {seconds / 60:.1f} min", counts, proxies * seconds / 3600, unit
        )

    async def pool(
        self, task_queue: str, members: int, *, rotate: bool
    ) -> WorkflowHandle[Any, Any]:
        handle = await self.client.start_workflow(
            "ProxyPool",
            {
                "replicas": members,
                "template": {
                    "provider": FLEET_PROVIDER,
                    "health": {"target": self.origin.url, "interval_seconds": INTERVAL},
                },
            },
            id=f"cost-pool-{uuid.uuid4().hex[:6]}",
            task_queue=task_queue,
        )

        async def ready() -> bool:
            return bool((await handle.query("status"))["ready"] == members)

        async def started() -> None:
            await until(ready, 600 + members)
            await asyncio.sleep(SETTLE_SECONDS)  # the last reports, checks and first heartbeats

        counts, seconds = await self.actions.during(started())
        table(
            f"pool of {members}: start, to all Ready and {SETTLE_SECONDS:.0f} s more "
            f"({seconds:.0f} s)",
            counts,
            members,
            "member",
        )
        await self.steady(f"pool of {members} (members and pool)", members, "member-hour")
        if rotate:
            await self.rotation(handle, members)
        return handle

    async def rotation(self, handle: WorkflowHandle[Any, Any], members: int) -> None:
        async def rotated() -> bool:
            status = await handle.query("status")
            return status["ready"] == members and all(
                m["generation"] >= 1 and not m["rotating"] for m in status["members"]
            )

        async def rotate_all() -> None:
            await handle.execute_update("rotate", {"all": True})
            await until(rotated, 600 + 60 * members)

        counts, seconds = await self.actions.during(rotate_all())
        table(f"pool of {members}: rotate all ({seconds:.0f} s)", counts, members, "member")

    async def gateway(self, pool: str) -> None:
        """The gateway's membership follow loop, as `proxy-operator-gateway` runs it."""

        async def fetch() -> list[Any]:
            return await membership.query_members(self.client, pool)

        async def apply(_: Sequence[Any]) -> bool:
            return True

        following = asyncio.create_task(
            membership.follow(
                fetch,
                apply,
                await fetch(),
                poll_seconds=GATEWAY_POLL_SECONDS,
                debounce_seconds=GATEWAY_DEBOUNCE_SECONDS,
                on_error=lambda err: print(f"gateway poll failed: {err}"),
                gate=membership.HistoryGate(lambda: membership.pool_position(self.client, pool)),
            )
        )
        try:
            # Past its start-up: the first poll queries, as it must (nothing seen yet).
            await asyncio.sleep(3 * GATEWAY_POLL_SECONDS)
            counts, seconds = await self.actions.over(self.args.gateway_minutes * 60)
        finally:
            following.cancel()
        table(
            f"a gateway following the pool, membership unchanged, {seconds / 60:.1f} min "
            "(its queries: the members' actions meanwhile are theirs)",
            Counter({GATEWAY_ACTION: counts[GATEWAY_ACTION]}),
            seconds / 3600,
            "gateway-hour",
        )

    async def end(self, workflow_ids: Sequence[str]) -> None:
        async def one(workflow_id: str) -> None:
            handle = self.client.get_workflow_handle(workflow_id)
            await handle.signal("terminate")
            await handle.result()

        await bounded((one(i) for i in workflow_ids), 20)


async def ready_count(client: Client, task_queue: str) -> int:
    """How many workflows on `task_queue` are Ready (pools included)."""
    query = f"TaskQueue = '{task_queue}' AND ProxyState = 'Ready'"
    return (await client.count_workflows(query)).count


async def monitored_on(client: Client, workflow_ids: Sequence[str], identity: str) -> set[str]:
    """Those of `workflow_ids` with a monitor activity running on the worker `identity`."""

    async def one(workflow_id: str) -> str | None:
        description = await client.get_workflow_handle(workflow_id).describe()
        for pending in description.raw_description.pending_activities:
            if (
                pending.activity_type.name in MONITOR_TYPES
                and pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
                and pending.last_worker_identity == identity
            ):
                return workflow_id
        return None

    found = await bounded((one(i) for i in workflow_ids), 20)
    return {i for i in found if i is not None}


def identity(worker: WorkerProcess) -> str:
    """The SDK's default worker identity: `<pid>@<host name>`."""
    return f"{worker.pid}@{os.uname().nodename}"


async def kill_and_remonitor(
    client: Client,
    spec: dict[str, Any],
    workdir: Path,
    victim: WorkerProcess,
    groups: dict[str, Sequence[str]],
) -> WorkerProcess:
    """SIGKILL `victim`; seconds until each group's monitors it ran run on a new worker."""
    ids = [i for group in groups.values() for i in group]
    watched = await monitored_on(client, ids, identity(victim))
    victim.process.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    victim.process.wait()
    (workdir / "b").mkdir(exist_ok=True)
    survivor = WorkerProcess(workdir / "b", spec)
    await survivor.wait_ready()
    started = time.monotonic() - killed
    back_after: dict[str, float] = {}

    async def back() -> bool:
        waiting = sorted(watched - set(back_after))
        for workflow_id in await monitored_on(client, waiting, identity(survivor)):
            back_after[workflow_id] = time.monotonic() - killed
        return watched <= set(back_after)

    await until(back, 900)
    print(f"\nworker SIGKILLed (the new worker polled after {started:.0f} s):", flush=True)
    for name, group in groups.items():
        times = [back_after[i] for i in group if i in back_after]
        if times:
            print(f"  {name}: {len(times)} monitored again, the last after {max(times):.0f} s")
    return survivor


async def small(
    bench: Bench,
    client: Client,
    spec: dict[str, Any],
    workdir: Path,
    worker: WorkerProcess,
    proxies: int,
) -> WorkerProcess:
    """Standalone proxies, a pool with a rotation and a gateway, then a worker killed."""
    task_queue = spec["task_queue"]
    await bench.end(await bench.standalone(task_queue, proxies))
    pool = await bench.pool(task_queue, proxies, rotate=True)
    await bench.gateway(pool.id)
    standalone = await bench.start_standalone(task_queue, proxies)
    members = [m["member"] for m in (await pool.query("status"))["members"]]
    groups = {
        "standalone proxies (their own monitors)": standalone,
        "pool members (the pool's monitor; a member of an older pool, its own)": [
            pool.id,
            *members,
        ],
    }
    worker = await kill_and_remonitor(client, spec, workdir, worker, groups)
    await bench.end([*standalone, pool.id])
    return worker


async def main(args: argparse.Namespace) -> None:
    metrics_port = free_port()
    env = await start_dev_server("--metrics-port", str(metrics_port))
    actions = Actions(f"http://127.0.0.1:{metrics_port}/metrics", env.client.namespace)
    try:
        async with squid_ground("cost") as ground:
            await run(args, env.client, actions, ground)
    finally:
        await env.shutdown()


async def run(
    args: argparse.Namespace,
    client: Client,
    actions: Actions,
    ground: SquidGround,
) -> None:
    endpoints = await create_squids(ground.squids, ground.config, SQUIDS)
    workdir = ground.workdir
    spec = worker_spec(client, ground.origin, endpoints, workdir, "cost")
    (workdir / "a").mkdir()
    worker = WorkerProcess(workdir / "a", spec)
    bench = Bench(args, client, actions, ground.origin)
    try:
        await worker.wait_ready()
        task_queue = spec["task_queue"]
        # One kind at a time: the counter cannot tell whose an action was.
        if args.proxies:
            worker = await small(bench, client, spec, workdir, worker, args.proxies)
        if args.large:
            large = await bench.pool(task_queue, args.large, rotate=False)
            await bench.end([large.id])
    finally:
        await worker.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--proxies", type=int, default=10, help="0: only --large")
    # Two heartbeat periods at least (210 s each), or the window sees some
    # monitors beat once and others twice.
    parser.add_argument("--minutes", type=float, default=7.0)
    # Longer than the gateway's refresh (5 minutes), to count one.
    parser.add_argument("--gateway-minutes", type=float, default=6.0)
    parser.add_argument("--large", type=int, default=0, help="also a pool of this many members")
    asyncio.run(main(parser.parse_args()))
