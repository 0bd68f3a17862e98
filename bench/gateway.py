"""The gateway at fleet scale (issue 45): N members at the speed of 10, while the pool rotates.

    python -m bench.gateway --members N [--seconds 20] [--clients 4] [--squids 3]
                            [--rotate-every 1.0] [--session-keys 2000] [--shared-cores]
                            [--default-health-interval]

The real `proxy-operator-gateway` process, started from its command line and
read only through its proxy port, its control API and /proc, in front of
real ProxyPools on a Temporal dev server (`--metrics-port`) with their
workers in processes of their own (bench/fleet/worker_process.py). Members
are on the memory provider, each instance at an address of its own
(127.a.b.c) served by one of `--squids` real Squids listening on every
address, so every member is a distinct host:port; the gateway is told
`--member-networks 127.0.0.0/8`. A pool holds at most 1,000 members: beyond,
ceil(N / 1,000) pools, each given to the gateway with its own `--pool`.

The request path (the clients, the gateway, the member Squids and the
origin) runs on the machine's first core and the control plane (the dev
server, the pools' workers and this benchmark's own rotating, polling and
probing) on the others, as a gateway host that runs no workers and no
Temporal would: at 1,000 members the workers' own work (monitor shards,
reports, rotations) would otherwise take its CPU from the request path, and
the ratios would measure the workers. `--shared-cores` runs everything on
every core. The clients and the origin run in a process of their own
(bench/request_side.py), so this benchmark's work never holds their GIL.
The members' monitors probe an origin of their own, on the control plane,
at one probe a second per pool whatever its size (POOL_PROBES_PER_SECOND
says why; `--default-health-interval` probes every member every 10 s).

In one run, first a 10-member pool with its own gateway, then N members,
each with `--clients` threads making closed-loop HTTPS requests (CONNECT,
TLS, GET, close) through the gateway to a local TLS origin:

1. still: `--seconds` with the pool unchanged;
2. (N only) sessions moved: `/v1/sessions/<key>` for `--session-keys` keys,
   one member scaled away and, once the gateway lists one fewer, the same
   keys again; the share whose member changed. Then the pool is scaled back.
3. rotating: `--seconds` while one member after another is rotated
   (`rotate {"member": ...}` every `--rotate-every` s, 3,600 an hour at the
   default, beyond the issue's 1,000 an hour); meanwhile one change at a time is
   timed from the pool's change (the workflow task that put the member's new
   endpoint in `endpoints`, as the server stamped its upsert of their digest
   in the pool's history) until a request pinned to it (`USER-proxy-<member>`)
   reaches its new instance (told by which Squid logged it: a member's next
   instance is always on another Squid), timed to that probe's start. Which
   upsert was the member's: the first between the `endpoints` poll (every
   0.25 s) before the new endpoint was listed and the poll that listed it, so
   a change is timed from no later than the pool made it.
4. (N only, one pool) rotating all: `--seconds` right after the pool was
   sent `rotate {"all": true}` (its `max_surge` is 10%). Not beyond 1,000
   members: the issue sets it for one pool of 1,000, and every pool rotating
   all of its members at once keeps the control plane's one core busy for
   many minutes after the phase.
5. (N only) Temporal actions per rotation: the dev server's `action` counter
   over a `--seconds` window of the same rotations with the gateway running,
   and again with it stopped; the difference divided by the rotations done
   (each window's pool generations before and after).

Prints each phase's requests/s, p50, p99, failures, longest stall (the
longest any client went between two completed requests), the gateway's
memory (RSS of its process tree) and CPU, and ends with one line:

    gateway-scale members=N throughput_ratio=R p50_ratio=R p99_ratio=R failed=K
    longest_stall_ms=M change_applied_p50_ms=M sessions_moved=F actions_per_rotation=A

ratios of the N run's rotating phase to the 10-member run's rotating phase;
failed and longest stall over all of the N run's phases.

An old instance's address keeps answering after its instance is deleted
(the Squids behind are shared), so a gateway that is late to apply a change
loses no request here that it would lose against real members; the change's
time shows the lateness. Asserts nothing: the figures feed docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import math
import os
import secrets
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.service import RPCError

from bench.cost import Actions
from bench.fleet.parameters import FLEET_PROVIDER, INSTALLATION, PASSWORD
from bench.fleet.squids import SquidGround, create_squids, squid_ground
from bench.fleet.worker_process import WorkerProcess, worker_spec
from bench.gateway_load import (
    Phase,
    ProbeLogs,
    gateway_cpu,
    gateway_members,
    gateway_rss_kib,
    pinned_probe,
    session_members,
)
from bench.pool import generations
from bench.request_side import LoadOrder, RequestSide, request_side
from bench.stats import percentile
from contract import ENDPOINTS_DIGEST_MEMO, POOL_QUEUE_SUFFIX
from gateway.main import DEFAULT_DEBOUNCE_SECONDS, DEFAULT_POLL_SECONDS
from providers.base import split_endpoint
from tests.helpers.config import PASSWORD_ENV, USERNAME, local_entry, raw_config
from tests.helpers.gateway import GatewayProcess
from tests.helpers.network import free_port
from tests.helpers.procfs import load_average
from tests.helpers.run_chain import run_histories
from tests.helpers.state_dir import local_state_dir
from tests.helpers.temporal import start_dev_server
from tests.helpers.tls_origin import TlsOrigin, serve_tls_origin
from worker import SERVE_POOLS
from workflows.pool_input import MAX_REPLICAS

BASELINE = 10
CREDENTIALS = (USERNAME, PASSWORD)
MEMBER_NETWORKS = "127.0.0.0/8"
ENDPOINTS_POLL = 0.25
# A query answers from the worker's state, which takes in a change a moment
# before the server stamps the task's upsert.
STAMP_SLACK = 0.5
CHANGE_DEADLINE = 30.0
READY_POLL = 2.0
# Actions the workers cause by calling the server, not the gateway.
WORKER_CALLS = ("grpc_RecordActivityTaskHeartbeat", "grpc_Respond")
# The dev server's action counter lags its calls by about a second.
COUNTER_LAG = 3.0
PROBE_GAP = 0.05
SETTLE_SECONDS = 5.0
# A rotation of every member at `max_surge` 10%: about 150 s at 1,000 (bench.pool).
ROTATE_ALL_DEADLINE = 900.0
ROTATE_ALL_POLL = 5.0
# The members' monitors probe through the member Squids, which serve the
# clients too, on the request path's core; on a real fleet those probes go
# from the workers to N member machines and never reach the gateway's host.
# So here they go to an origin of their own on the control plane's cores
# (the member Squids still relay them), and each pool's members are probed
# this often in all, whatever its size: at the default 10 s a member, 1,000
# members are 100 probes a second, a shard's 200 started over 5 s each round
# (`--default-health-interval` keeps the 10 s; a round spreads its probes over
# half the interval, activities/provider.py's ROUND_SPREAD).
POOL_PROBES_PER_SECOND = 1.0


@dataclass
class Size:
    """One pool size's figures."""

    members: int
    still: Phase
    rotating: Phase
    rotations: int
    # Seconds from the pool's change to a pinned request reaching the new endpoint.
    changes: list[float]
    changes_missed: int
    rss_kib: int
    load: tuple[str, str]
    probes: Counter[str] = field(default_factory=Counter)
    sessions_moved: float | None = None
    # The clients while every pool rotates all its members (`max_surge` 10%).
    rotating_all: Phase | None = None
    actions: dict[str, Counter[str]] = field(default_factory=dict)
    window_rotations: dict[str, int] = field(default_factory=dict)
    # Changes served that no upsert in the pool's history could be told for.
    changes_untimed: int = 0
    # The gateway's own time per change, to the router's answer: (changes, seconds).
    router_changes: tuple[float, float] = (0.0, 0.0)

    @property
    def phases(self) -> list[Phase]:
        return [self.still, self.rotating, *([self.rotating_all] if self.rotating_all else [])]

    @property
    def failed(self) -> int:
        return sum(phase.failures for phase in self.phases)

    @property
    def longest_stall(self) -> float:
        return max(phase.longest_gap for phase in self.phases)

    def actions_per_rotation(self) -> float:
        """Client calls (`grpc_` actions but the workers' heartbeats) in the window with
        the gateway less those in the same window without it, per rotation queued."""
        if not self.actions:
            return math.nan
        calls = {window: _client_calls(counts) for window, counts in self.actions.items()}
        rotations = max(self.window_rotations["gateway"], 1)
        return (calls["gateway"] - calls["no gateway"]) / rotations


@dataclass(frozen=True)
class Bench:
    args: argparse.Namespace
    client: Client
    actions: Actions
    ground: SquidGround
    pool_queue: str
    probe_logs: ProbeLogs
    cores: Cores
    request_side: RequestSide
    # What the members' monitors probe (POOL_PROBES_PER_SECOND says why not the load's).
    health_origin: TlsOrigin


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--squids", type=int, default=3)
    parser.add_argument("--rotate-every", type=float, default=1.0)
    parser.add_argument("--session-keys", type=int, default=2000)
    parser.add_argument("--shared-cores", action="store_true")
    parser.add_argument("--default-health-interval", action="store_true")
    args = parser.parse_args()
    if not 1 <= args.members <= 100_000:
        parser.error(f"--members: {args.members} is not from 1 to 100000")
    if args.squids < 2:
        parser.error("--squids: at least 2 (a member's next instance is on another Squid)")
    if args.seconds <= 0 or args.rotate_every <= 0:
        parser.error("--seconds and --rotate-every: more than 0")
    cores = Cores.split(shared=args.shared_cores)
    print(cores, flush=True)
    metrics_port = free_port()
    env = await start_dev_server("--metrics-port", str(metrics_port))
    actions = Actions(f"http://127.0.0.1:{metrics_port}/metrics", env.client.namespace)
    try:
        with (
            request_side(cores.request_path) as side,
            serve_tls_origin(ca=side.origin.ca) as health,
        ):
            baseline, scaled = await _run(args, cores, env.client, actions, side, health)
    finally:
        await env.shutdown()
    summary(baseline, scaled)


async def _run(
    args: argparse.Namespace,
    cores: Cores,
    client: Client,
    actions: Actions,
    side: RequestSide,
    health: TlsOrigin,
) -> tuple[Size, Size]:
    """The member Squids and the workers, then the baseline and the N run over them."""
    async with squid_ground(
        "gateway", bind_address="0.0.0.0", origin=side.origin, more_ports=[health.port]
    ) as ground:
        with cores.on_request_path():
            squids = await create_squids(ground.squids, ground.config, args.squids)
        spec = worker_spec(
            client, ground.origin, squids, ground.workdir, "gateway", more_ports=[health.port]
        )
        spec["distinct_addresses"] = True
        pools_spec = {
            **spec,
            "task_queue": spec["task_queue"] + POOL_QUEUE_SUFFIX,
            "serve": SERVE_POOLS,
        }
        workers = [
            WorkerProcess(_subdirectory(ground.workdir, name), worker)
            for name, worker in (("members", spec), ("pools", pools_spec))
        ]
        try:
            for worker in workers:
                await worker.wait_ready()
            squid_dirs = await asyncio.to_thread(_squid_dirs, ground)
            bench = Bench(
                args,
                client,
                actions,
                ground,
                pools_spec["task_queue"],
                ProbeLogs(squid_dirs),
                cores,
                side,
                health,
            )
            baseline = await measure(bench, BASELINE, full=False)
            report(baseline)
            scaled = await measure(bench, args.members, full=True)
            report(scaled)
            return baseline, scaled
        finally:
            for worker in workers:
                await worker.stop()


@dataclass(frozen=True)
class Cores:
    """Which cores the request path runs on, and which the control plane."""

    request_path: frozenset[int]
    control: frozenset[int]

    @classmethod
    def split(cls, *, shared: bool) -> Cores:
        """The first core for the request path, the rest for the control plane (this
        process from here on); every core for both when `shared` or with one core."""
        every = frozenset(os.sched_getaffinity(0))
        if shared or len(every) < 2:
            return cls(every, every)
        first = min(every)
        cores = cls(frozenset({first}), every - {first})
        _pin_this_process(cores.control)
        return cores

    @contextlib.contextmanager
    def on_request_path(self) -> Iterator[None]:
        """Processes started inside run on the request path's cores (they inherit them)."""
        _pin_this_process(self.request_path)
        try:
            yield
        finally:
            _pin_this_process(self.control)

    def __str__(self) -> str:
        if self.request_path == self.control:
            return f"cores: everything on {sorted(self.control)}"
        return (
            f"cores: request path (clients, gateway, member Squids, origin) on "
            f"{sorted(self.request_path)}, control plane (dev server, workers) on "
            f"{sorted(self.control)}"
        )


def _pin_this_process(cpus: frozenset[int]) -> None:
    """Every thread of this process onto `cpus`: an affinity is per thread on Linux."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task), cpus)


async def measure(bench: Bench, members: int, *, full: bool) -> Size:
    """A pool (or pools) of `members`, a gateway in front, and the phases over them."""
    sizes = _pool_sizes(members)
    pools = await asyncio.gather(*(_start_pool(bench, n) for n in sizes))
    print(f"\n{members} members in {len(pools)} pool(s): starting", flush=True)
    started = time.monotonic()
    await asyncio.gather(*(_until_ready(pool, n) for pool, n in zip(pools, sizes, strict=True)))
    print(f"all {members} Ready after {time.monotonic() - started:.0f} s", flush=True)
    with local_state_dir("proxy-operator-bench-gateway-") as directory:
        return await _measure(bench, members, full, pools, directory)


async def _measure(
    bench: Bench,
    members: int,
    full: bool,
    pools: Sequence[WorkflowHandle[Any, Any]],
    directory: Path,
) -> Size:
    gateway = _gateway(bench, [pool.id for pool in pools], directory)
    try:
        with bench.cores.on_request_path():
            await asyncio.to_thread(gateway.start)
        await _until_gateway_lists(gateway, members)
        await asyncio.sleep(SETTLE_SECONDS)
        load_before = load_average()
        still = await _phase(bench, gateway, "still", None)
        sessions = await _sessions_moved(bench, gateway, pools[0], members) if full else None
        rotator = Rotator(bench, pools, gateway)
        await rotator.prepare()
        rotating = await _phase(bench, gateway, "rotating", rotator)
        rotations = await rotator.done()  # before rotate-all adds its own
        rotating_all = (
            await _rotating_all(bench, gateway, pools, members)
            if full and len(pools) == 1
            else None
        )
        rss = await asyncio.to_thread(gateway_rss_kib, gateway)
        result = Size(
            members,
            still,
            rotating,
            rotations,
            rotator.changes,
            rotator.missed,
            rss,
            (load_before, load_average()),
            rotator.probes,
            sessions,
            rotating_all,
        )
        result.changes_untimed = rotator.untimed
        samples = await asyncio.to_thread(gateway.metrics)
        result.router_changes = (
            samples.get(("proxy_operator_gateway_change_seconds_count", ()), 0.0),
            samples.get(("proxy_operator_gateway_change_seconds_sum", ()), 0.0),
        )
        if full:
            await _actions_windows(bench, pools, gateway, result)
    finally:
        await asyncio.to_thread(gateway.stop)
        await asyncio.gather(*(pool.signal("terminate") for pool in pools))
        await asyncio.gather(*(pool.result() for pool in pools), return_exceptions=True)
    return result


def _pool_sizes(members: int) -> list[int]:
    """`members` split over as few pools as hold them, as evenly as can be."""
    count = math.ceil(members / MAX_REPLICAS)
    return [members // count + (k < members % count) for k in range(count)]


async def _start_pool(bench: Bench, replicas: int) -> WorkflowHandle[Any, Any]:
    health: dict[str, Any] = {"target": bench.health_origin.url}
    if not bench.args.default_health_interval:
        health["interval_seconds"] = _health_interval(replicas)
    template = {"provider": FLEET_PROVIDER, "health": health}
    return await bench.client.start_workflow(
        "ProxyPool",
        {"replicas": replicas, "template": template, "max_surge": "10%"},
        id=f"bench-gateway-{uuid.uuid4().hex[:8]}",
        task_queue=bench.pool_queue,
    )


def _health_interval(replicas: int) -> int:
    """A member's probe interval that has the pool probe POOL_PROBES_PER_SECOND in all,
    within what `health.interval_seconds` takes (10 s, the default, at least)."""
    return min(max(round(replicas / POOL_PROBES_PER_SECOND), 10), 3600)


async def _until_ready(pool: WorkflowHandle[Any, Any], replicas: int) -> None:
    while len(await _endpoints(pool)) < replicas:
        await asyncio.sleep(READY_POLL)


async def _endpoints(pool: WorkflowHandle[Any, Any]) -> dict[str, str]:
    """The pool's `endpoints` query: member -> host:port."""
    while True:
        try:
            return {e["member"]: e["endpoint"] for e in await pool.query("endpoints")}
        except RPCError as err:  # a busy worker did not answer in time: ask again
            print(f"(endpoints query not answered, asked again: {err})")


def _gateway(bench: Bench, pools: Sequence[str], directory: Path) -> GatewayProcess:
    """`proxy-operator-gateway` over `pools`, one `--pool` each, its control API on loopback."""
    token, api_port = secrets.token_urlsafe(24), free_port()
    tokens = directory / "api-tokens"
    tokens.write_text(f"{token}\n")
    gateway = GatewayProcess(
        pool=pools[0],
        raw_config=raw_config(
            local_entry(directory / "unused", FLEET_PROVIDER),
            connect_ports=[bench.ground.origin.port],
            installation=INSTALLATION,
        ),
        temporal_address=bench.client.service_client.config.target_host,
        namespace=bench.client.namespace,
        directory=directory,
        # The gateway's own defaults (docs/operations.md), as an operator runs it.
        poll_seconds=DEFAULT_POLL_SECONDS,
        debounce_seconds=DEFAULT_DEBOUNCE_SECONDS,
        extra_args=[
            *itertools.chain.from_iterable(("--pool", pool) for pool in pools[1:]),
            *("--member-networks", MEMBER_NETWORKS),
            *("--api-listen", f"127.0.0.1:{api_port}", "--api-tokens-file", str(tokens)),
            *("--api-rate", "10000", "--api-burst", "10000"),
        ],
        extra_env={PASSWORD_ENV: PASSWORD},
    )
    gateway.api = (api_port, token)
    return gateway


async def _until_gateway_lists(gateway: GatewayProcess, members: int, within: float = 600) -> None:
    """Until the gateway's control API lists `members` members."""
    deadline = time.monotonic() + within
    while len(await asyncio.to_thread(gateway_members, gateway)) != members:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway does not list {members} members:\n{gateway.log()}")
        await asyncio.sleep(0.5)


async def _instances(pools: Sequence[WorkflowHandle[Any, Any]]) -> int:
    """The sum of every member's generation over `pools`: instances created so far."""
    found = await asyncio.gather(*(generations(pool) for pool in pools))
    return sum(sum(each.values()) for each in found)


async def _rotating_all(
    bench: Bench, gateway: GatewayProcess, pools: Sequence[WorkflowHandle[Any, Any]], members: int
) -> Phase:
    """The clients while `rotate {"all": true}` (the pools' `max_surge` 10%) is under way;
    returns once every member has a new instance, so what follows is measured apart."""
    before = await _instances(pools)
    await asyncio.gather(*(pool.execute_update("rotate", {"all": True}) for pool in pools))
    phase = await _phase(bench, gateway, "rotating all", None)
    deadline = time.monotonic() + ROTATE_ALL_DEADLINE
    while time.monotonic() < deadline:
        if await _instances(pools) >= before + members:
            break
        await asyncio.sleep(ROTATE_ALL_POLL)
    else:
        print(f"rotate all: not done within {ROTATE_ALL_DEADLINE:.0f} s", flush=True)
    return phase


async def _phase(
    bench: Bench, gateway: GatewayProcess, name: str, rotator: Rotator | None
) -> Phase:
    """The clients through the gateway for `--seconds`, the rotator running if given."""
    cpu_before = await asyncio.to_thread(gateway_cpu, gateway)
    order = LoadOrder(
        name, ("127.0.0.1", gateway.port), bench.args.clients, CREDENTIALS, bench.args.seconds
    )
    print(f"{name}: {bench.args.seconds:.0f} s of load", flush=True)
    loading = asyncio.create_task(asyncio.to_thread(bench.request_side.load, order))
    if rotator is not None:
        rotator.start(track=True)
    phase = await loading
    if rotator is not None:
        rotator.halt()
    cpu = await asyncio.to_thread(gateway_cpu, gateway) - cpu_before
    if rotator is not None:
        await rotator.stop()  # the changes still under way timed, without the load
        await rotator.time_changes()
    return dataclasses.replace(phase, gateway_cpu=cpu)


class Rotator:
    """Rotates one member every `--rotate-every` seconds, round-robin over every pool,
    and times each change in the first pool until traffic reaches it."""

    def __init__(
        self,
        bench: Bench,
        pools: Sequence[WorkflowHandle[Any, Any]],
        gateway: GatewayProcess,
    ) -> None:
        self._bench, self._pools, self._gateway = bench, pools, gateway
        # Seconds from the pool's change to traffic, once `time_changes` has them.
        self.changes: list[float] = []
        self.missed = 0
        # Changes served whose pool change the history does not show in their window.
        self.untimed = 0
        # Each change served, in wall-clock time (the server's stamps are too): when the
        # poll before its listing was sent, when the listing poll answered, when the
        # first probe to reach the new instance was sent (a probe takes a while to be
        # told apart: its Squid's log line).
        self._served: list[tuple[float, float, float]] = []
        self.rejected: Counter[str] = Counter()
        # Pinned probes by where they went: the new instance, the old, nowhere.
        self.probes: Counter[str] = Counter()
        self.queued = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._first = 0
        self._order: list[tuple[WorkflowHandle[Any, Any], str]] = []
        # The first pool's endpoints as last polled, and the members whose change is
        # awaited: member -> (its endpoint before the rotation, when it was rotated).
        self._listed: dict[str, str] = {}
        self._awaited: dict[str, tuple[str, float]] = {}
        self._trackers: set[asyncio.Task[None]] = set()
        # One probe at a time: a probe's Squid is told by its access log line.
        self._probing = asyncio.Lock()

    async def prepare(self) -> None:
        """Read the pools' generations and members, before anything is measured."""
        self._first = await self.generations()
        members = [
            (pool, member) for pool in self._pools for member in sorted(await _endpoints(pool))
        ]
        # Interleaved over the pools, so each pool rotates at its share of the rate.
        self._order = sorted(members, key=lambda pm: (_index(pm[1]), self._pools.index(pm[0])))

    def start(self, *, track: bool) -> None:
        self._stop.clear()
        self._task = asyncio.create_task(self._run(track))

    def halt(self) -> None:
        """Rotate no more (`stop` waits for the changes under way)."""
        self._stop.set()

    async def stop(self) -> None:
        """Stop rotating; the changes under way are timed to their end (or deadline)."""
        self._stop.set()
        if self._task is not None:
            await self._task

    async def run_for(self, seconds: float) -> None:
        """Rotate for `seconds`, timing nothing."""
        self.start(track=False)
        await asyncio.sleep(seconds)
        await self.stop()

    async def generations(self) -> int:
        """The sum of every member's generation over the pools: instances created so far."""
        return await _instances(self._pools)

    async def done(self) -> int:
        """Rotations completed since `prepare`."""
        return await self.generations() - self._first

    async def _run(self, track: bool) -> None:
        watching = asyncio.create_task(self._watch()) if track else None
        if track:
            self._listed = await _endpoints(self._pools[0])
        for pool, member in itertools.cycle(self._order):
            if self._stop.is_set():
                break
            tick = time.monotonic()
            old = self._listed.get(member)
            tracked = track and pool is self._pools[0] and member not in self._awaited
            if await self._rotate(pool, member) and tracked and old is not None:
                self._awaited[member] = (old, time.monotonic())
            with contextlib.suppress(TimeoutError):
                wait = self._bench.args.rotate_every - (time.monotonic() - tick)
                await asyncio.wait_for(self._stop.wait(), max(wait, 0))
        while self._awaited:  # every change rotated in time is timed to its end
            await asyncio.sleep(ENDPOINTS_POLL)
        if watching is not None:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
        await asyncio.gather(*self._trackers)

    async def _rotate(self, pool: WorkflowHandle[Any, Any], member: str) -> bool:
        try:
            result = await pool.execute_update("rotate", {"member": member})
            self.queued += len(result["queued"])
            return True
        except (RPCError, WorkflowUpdateFailedError) as err:
            self.rejected[type(err).__name__] += 1
            return False

    async def _watch(self) -> None:
        """Poll the first pool's endpoints; a member's new endpoint starts its probes."""
        polled = time.time()
        while True:
            asked = time.time()
            self._listed = await _endpoints(self._pools[0])
            window = (polled, time.time())
            polled = asked
            now = time.monotonic()
            for member, (old, rotated) in list(self._awaited.items()):
                new = self._listed.get(member, old)
                if new != old:
                    tracker = asyncio.create_task(self._until_served(member, new, window))
                    self._trackers.add(tracker)
                    del self._awaited[member]
                elif now - rotated > CHANGE_DEADLINE:
                    self.missed += 1
                    del self._awaited[member]
            await asyncio.sleep(ENDPOINTS_POLL)

    async def _until_served(self, member: str, new: str, window: tuple[float, float]) -> None:
        """Pinned probes to `member` until one reaches its instance at `new`, listed
        between the two wall-clock times of `window`."""
        address = split_endpoint(new)
        assert address is not None, new
        bench = self._bench
        while time.time() - window[1] < CHANGE_DEADLINE:
            async with self._probing:
                sent = time.time()
                served = await asyncio.to_thread(
                    pinned_probe,
                    self._gateway,
                    bench.ground.origin,
                    bench.probe_logs,
                    CREDENTIALS,
                    member,
                )
            if served == address[1]:
                self.probes["new"] += 1
                self._served.append((*window, sent))
                return
            self.probes["failed" if served is None else "old"] += 1
            await asyncio.sleep(PROBE_GAP)
        self.missed += 1

    async def time_changes(self) -> None:
        """Each change served, timed from the pool's change: the first upsert of its
        endpoints' digest in the window its listing was seen in."""
        pool = self._pools[0]
        run = pool.first_execution_run_id or pool.result_run_id
        assert run is not None, pool.id
        upserts = sorted(
            [
                event.event_time.ToDatetime(UTC).timestamp()
                async for events in run_histories(self._bench.client, pool.id, run)
                for event in events
                if event.event_type == EventType.EVENT_TYPE_WORKFLOW_PROPERTIES_MODIFIED
                and ENDPOINTS_DIGEST_MEMO
                in event.workflow_properties_modified_event_attributes.upserted_memo.fields
            ]
        )
        for after, listed, served in self._served:
            changed = next((t for t in upserts if after < t <= listed + STAMP_SLACK), None)
            if changed is None:
                self.untimed += 1
            else:
                self.changes.append(served - changed)
        self._served.clear()


def _index(member: str) -> int:
    """A pool member's index, the number after its `/`."""
    return int(member.rsplit("/", 1)[-1])


async def _sessions_moved(
    bench: Bench, gateway: GatewayProcess, pool: WorkflowHandle[Any, Any], members: int
) -> float:
    """The share of session keys whose member changes when one member of the pool leaves."""
    print("sessions: one member leaves", flush=True)
    keys = [f"bench{k}" for k in range(bench.args.session_keys)]
    before = await asyncio.to_thread(session_members, gateway, keys)
    listed = await _endpoints(pool)
    await pool.execute_update("scale", {"replicas": len(listed) - 1})
    while len(await _endpoints(pool)) != len(listed) - 1:
        await asyncio.sleep(ENDPOINTS_POLL)
    await _until_gateway_lists(gateway, members - 1)
    after = await asyncio.to_thread(session_members, gateway, keys)
    await pool.execute_update("scale", {"replicas": len(listed)})
    await _until_ready(pool, len(listed))
    await _until_gateway_lists(gateway, members)
    return sum(before[k] != after[k] for k in keys) / len(keys)


async def _actions_windows(
    bench: Bench, pools: Sequence[WorkflowHandle[Any, Any]], gateway: GatewayProcess, into: Size
) -> None:
    """The dev server's actions over the same rotations with the gateway and without it.

    The benchmark queries nothing inside a window: its own actions there are
    its `rotate` updates, the same in both.
    """
    for window in ("gateway", "no gateway"):
        print(f"actions: {bench.args.seconds:.0f} s of rotations, {window}", flush=True)
        if window == "no gateway":
            await asyncio.to_thread(gateway.stop)
        rotator = Rotator(bench, pools, gateway)
        await rotator.prepare()
        await asyncio.sleep(COUNTER_LAG)  # the preparing queries counted before the window
        counts, _ = await bench.actions.during(rotator.run_for(bench.args.seconds))
        into.actions[window] = counts
        into.window_rotations[window] = rotator.queued


def _client_calls(counts: Counter[str]) -> float:
    """The actions a client of Temporal causes by calling it, as the gateway is one.

    The rest are the workflows' commands and messages (the rotations' own
    work) and the workers' heartbeats; the benchmark's `rotate` updates are
    counted as messages, the same in both windows.
    """
    return sum(
        count
        for kind, count in counts.items()
        if kind.startswith("grpc_") and not kind.startswith(WORKER_CALLS)
    )


def report(size: Size) -> None:
    print(f"\n{size.members} members (load average before/after: {size.load[0]} / {size.load[1]})")
    print("| phase | requests/s | p50 | p99 | failed | longest stall | longest request |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for phase in size.phases:
        failed = f"{phase.failures} {phase.failed}" if phase.failures else "0"
        print(
            f"| {phase.name} | {phase.rate:.1f} | {phase.p(50) * 1000:.0f} ms "
            f"| {phase.p(99) * 1000:.0f} ms | {failed} | {phase.longest_gap * 1000:.0f} ms "
            f"| {phase.longest_request * 1000:.0f} ms |"
        )
    rotating = size.rotating
    print(
        f"rotations completed while rotating: {size.rotations} "
        f"({size.rotations * 3600 / rotating.seconds:.0f} an hour)"
    )
    if size.changes:
        print(
            f"change applied (the pool's change -> pinned request reaches it), "
            f"{len(size.changes)} timed: p50 {percentile(size.changes, 50) * 1000:.0f} ms, "
            f"max {max(size.changes) * 1000:.0f} ms"
        )
    count, seconds = size.router_changes
    if count:
        print(
            f"the gateway's own time per change (to the router's answer), "
            f"{count:.0f} changes: mean {seconds / count * 1000:.1f} ms"
        )
    print(
        f"changes not applied within {CHANGE_DEADLINE:.0f} s: {size.changes_missed}; "
        f"served but not told in the pool's history: {size.changes_untimed}; "
        f"pinned probes: {dict(size.probes)}"
    )
    print(
        f"gateway memory (RSS of its processes, summed): {size.rss_kib / 1024:.0f} MiB, "
        f"{size.rss_kib / size.members:.0f} KiB per member"
    )
    for phase in (size.still, size.rotating):
        print(
            f"gateway CPU, {phase.name}: {phase.gateway_cpu:.1f} s in {phase.seconds:.0f} s "
            f"({100 * phase.gateway_cpu / phase.seconds:.0f}% of a core), "
            f"{1000 * phase.gateway_cpu / phase.seconds / size.members:.2f} ms per member-second, "
            f"{1000 * phase.gateway_cpu / max(phase.ok, 1):.2f} ms per request"
        )
    if size.sessions_moved is not None:
        moved = size.sessions_moved
        print(f"session keys moved when one member of {size.members} left: {moved:.4f}")
    for window, counts in size.actions.items():
        kinds = ", ".join(f"{k} {v:.0f}" for k, v in counts.most_common())
        print(
            f"actions, {window}, {size.window_rotations[window]} rotations queued: "
            f"{sum(counts.values()):.0f} ({kinds})"
        )


def summary(baseline: Size, scaled: Size) -> None:
    base, measured = baseline.rotating, scaled.rotating
    change = percentile(scaled.changes, 50) * 1000 if scaled.changes else math.nan
    print(
        f"gateway-scale members={scaled.members} "
        f"throughput_ratio={measured.rate / base.rate:.2f} "
        f"p50_ratio={measured.p(50) / base.p(50):.2f} "
        f"p99_ratio={measured.p(99) / base.p(99):.2f} "
        f"failed={scaled.failed} "
        f"longest_stall_ms={scaled.longest_stall * 1000:.0f} "
        f"change_applied_p50_ms={change:.0f} "
        f"sessions_moved={scaled.sessions_moved:.4f} "
        f"actions_per_rotation={scaled.actions_per_rotation():.2f}"
    )


def _squid_dirs(ground: SquidGround) -> dict[int, Path]:
    """Each member Squid's port -> its directory (where its access.log is)."""
    instances = ground.squids.list_by_tag("managed-by", "proxy-operator")
    return {i.port: ground.state_dir / i.name for i in instances}


def _subdirectory(workdir: Path, name: str) -> Path:
    (workdir / name).mkdir()
    return workdir / name


if __name__ == "__main__":
    asyncio.run(main())
