"""How many proxies one worker process monitors at 10 s: DESIGN.md section 10.

    python -m bench.fleet [--proxies 1000] [--squids 10] [--minutes 3]

Target: "1,000 with probes on time" on 2 cores. A real dev server, a local
TLS origin and `--squids` real Squid proxies (the local provider), created up
front. ONE worker (build_worker, ProviderActivities), run as a separate
process so its CPU figure is its own, serves `--proxies` ProxyLifecycle
workflows probing every 10 s. Its provider is a stand-in whose instance i is
squid i % squids, so every probe is a real CONNECT, through a real Squid, and
a real TLS handshake with the origin; only creating and deleting are fake.

Once every proxy is Ready (and two intervals more, so every monitor is in its
loop), the benchmark measures over `--minutes`:

- probes: every probe the worker makes is recorded (a ProviderActivities
  subclass overriding `_probe`) with its start time, per instance; expected
  = proxies * seconds / interval. The `proxy_operator_probes_total` counter
  is read as a cross-check.
- on time: a probe is on time when it starts at most 10% of an interval after
  the instance's previous probe (the monitor's schedule); the fleet's probes
  are on time when at least 99% of the expected probes happened, at least
  99% of them were on time, and no instance went more than two intervals
  without a probe (none missed a window by more than one interval).
- the worker process's CPU (utime + stime from /proc, every thread, the SDK's
  Rust core included) over wall time, as % of all cores; its RSS; and its
  event-loop lag (how late a 100 ms asyncio.sleep wakes, sampled all along).
- context: the CPU of the dev server, the Squids (with their helpers), this
  process (the TLS origin lives here) and the whole machine, since the
  worker shares 2 cores with all of them and with whatever else is running.

Then every workflow is terminated with the `terminate` signal, and the worker,
the Squids and the dev server are stopped, on Ctrl-C or failure too. Prints
markdown tables and asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import uuid
from array import array
from collections import Counter
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from temporalio import activity
from temporalio.client import Client, WorkflowHandle

from activities.metrics import PROBES
from activities.models import InstanceRef, MonitorInput, MonitorOutcome
from activities.probe import ProbeResult, probe_connect
from activities.provider import ProviderActivities
from providers.base import CreateRequest, Instance, InstanceState
from providers.config import Config, parse_config
from providers.local import LocalConfig, LocalProvider
from providers.memory import MemoryProvider
from providers.naming import OWNER_KEY, instance_name, owner_tags
from tests.fixtures.state_dir import local_state_dir
from tests.fixtures.temporal import start_dev_server
from tests.fixtures.tls_origin import TlsOrigin, serve_tls_origin
from worker import build_worker
from workflows.lifecycle import ProxyLifecycle

T = TypeVar("T")

INSTALLATION = "bench-fleet"
PASSWORD = "bench-password"
PASSWORD_ENV = "PROXY_PASSWORD"
FLEET_PROVIDER = "fleet"
SQUID_PROVIDER = "local"
INTERVAL = 10.0
# A probe is on time when it starts within this share of an interval late.
ON_TIME_TOLERANCE = 0.10
# The fleet is "on time" when all three hold.
MIN_RATE = 0.99
MIN_ON_TIME = 0.99
MAX_GAP_INTERVALS = 2.0
# Every monitor is in its probe loop this long after the last proxy is Ready.
SETTLE_SECONDS = 2 * INTERVAL
LAG_SLEEP = 0.1
SLOW_PROBE_MS = 500.0
GC_REPORT_MS = 20.0
CAPACITY_SECONDS = 3.0
CAPACITY_CONCURRENCY = 20
CLK_TCK = os.sysconf("SC_CLK_TCK")
CPUS = os.cpu_count() or 1
MIB = 1024 * 1024


# ---- the worker process ---------------------------------------------------------------


class PoolProvider(MemoryProvider):
    """The provider contract in memory, every instance pointing at a real Squid.

    Instance i (the number ending its owner's workflow id) is endpoint
    i % len(endpoints): creating and deleting are instant, probing is real.
    """

    def __init__(self, endpoints: Sequence[tuple[str, int]]) -> None:
        super().__init__()
        self._endpoints = list(endpoints)

    def address(self, req: CreateRequest) -> tuple[str, int]:
        owner = req.tags.get(OWNER_KEY, req.name)
        suffix = owner.rsplit("-", 1)[-1]
        index = int(suffix) if suffix.isdigit() else hash(owner)
        return self._endpoints[index % len(self._endpoints)]


@dataclass
class Recorder:
    """Everything the worker process reports back, kept small: floats in arrays."""

    starts: dict[str, array[float]] = field(default_factory=dict)
    millis: dict[str, array[float]] = field(default_factory=dict)
    failures: list[tuple[float, str, str, str]] = field(default_factory=list)
    lag: array[float] = field(default_factory=lambda: array("d"))
    lag_at: array[float] = field(default_factory=lambda: array("d"))
    monitor_starts: list[tuple[float, int]] = field(default_factory=list)
    monitor_ends: list[tuple[float, str]] = field(default_factory=list)
    # Probes slower than SLOW_PROBE_MS: start, then each stage's milliseconds.
    slow: list[tuple[float, float, float, float, float]] = field(default_factory=list)
    # Garbage collections of the oldest generation, or any slower than GC_REPORT_MS:
    # (end, generation, seconds).
    collections: list[tuple[float, int, float]] = field(default_factory=list)
    _gc_started: float = 0.0

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        now = time.monotonic()
        if phase == "start":
            self._gc_started = now
            return
        took = now - self._gc_started
        if info["generation"] == 2 or took * 1000 >= GC_REPORT_MS:
            self.collections.append((now, info["generation"], took))

    def probe(self, provider_id: str, start: float, result: ProbeResult) -> None:
        if provider_id not in self.starts:
            self.starts[provider_id] = array("d")
            self.millis[provider_id] = array("d")
        self.starts[provider_id].append(start)
        self.millis[provider_id].append(-1.0 if result.total_ms is None else result.total_ms)
        if not result.ok:
            self.failures.append((start, provider_id, str(result.failure), str(result.error)))
        if (result.total_ms or 0.0) >= SLOW_PROBE_MS:
            self.slow.append(
                (
                    start,
                    result.connect_ms or 0.0,
                    result.connect_reply_ms or 0.0,
                    result.tls_ms or 0.0,
                    result.total_ms or 0.0,
                )
            )

    def dump(self) -> dict[str, Any]:
        return {
            "probes": {
                pid: [list(self.starts[pid]), list(self.millis[pid])] for pid in self.starts
            },
            "failures": self.failures,
            "lag": [list(self.lag_at), list(self.lag)],
            "monitor_starts": self.monitor_starts,
            "monitor_ends": self.monitor_ends,
            "counter_total": _probes_counter_total(),
            "slow": self.slow,
            "collections": self.collections,
        }


class RecordingActivities(ProviderActivities):
    """ProviderActivities that record every probe and every monitor start and end."""

    def __init__(self, *args: Any, recorder: Recorder, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recorder = recorder

    async def _probe(self, ref: InstanceRef, target: str, timeout_seconds: float) -> ProbeResult:
        start = time.monotonic()
        result = await super()._probe(ref, target, timeout_seconds)
        self.recorder.probe(ref.provider_id, start, result)
        return result

    @activity.defn(name="monitor")
    async def monitor(self, inp: MonitorInput) -> MonitorOutcome:
        self.recorder.monitor_starts.append((time.monotonic(), activity.info().attempt))
        outcome = await super().monitor(inp)
        self.recorder.monitor_ends.append((time.monotonic(), outcome.reason))
        return outcome


def _probes_counter_total() -> float:
    return sum(
        sample.value
        for metric in PROBES.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    )


async def _measure_lag(recorder: Recorder) -> None:
    """How late the worker's event loop wakes from a short sleep, all along."""
    while True:
        before = time.monotonic()
        await asyncio.sleep(LAG_SLEEP)
        after = time.monotonic()
        recorder.lag_at.append(after)
        recorder.lag.append(after - before - LAG_SLEEP)


async def _watch_parent(parent: int, stop: asyncio.Event) -> None:
    """The benchmark died without stopping us: stop anyway."""
    while os.getppid() == parent:
        await asyncio.sleep(1)
    stop.set()


def _write_json(path: Path, data: Any) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data))
    os.replace(partial, path)


async def serve_worker(spec: dict[str, Any]) -> None:
    """The worker process: one build_worker over the pool provider, until SIGTERM."""
    config = config_for(spec["origin_port"], spec["state_dir"], FLEET_PROVIDER)
    provider = PoolProvider([(ip, port) for ip, port in spec["endpoints"]])
    recorder = Recorder()
    activities = RecordingActivities(
        {FLEET_PROVIDER: provider},
        config,
        ssl_context=ssl.create_default_context(cafile=spec["ca_file"]),
        recorder=recorder,
    )
    client = await Client.connect(spec["target_host"], namespace=spec["namespace"])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    results = Path(spec["results"])
    loop.add_signal_handler(signal.SIGUSR1, lambda: _write_json(results, recorder.dump()))
    gc.callbacks.append(recorder.on_gc)
    lag = asyncio.create_task(_measure_lag(recorder))
    watch = asyncio.create_task(_watch_parent(spec["parent_pid"], stop))
    async with build_worker(client, activities, task_queue=spec["task_queue"]):
        await asyncio.to_thread(Path(spec["ready"]).write_text, str(os.getpid()))
        await stop.wait()
    lag.cancel()
    watch.cancel()
    activities.close()


def worker_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    code = 0
    try:
        asyncio.run(serve_worker(spec))
    except BaseException as err:
        print(f"fleet worker: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown with the SDK's native threads alive (see worker.run).
    os._exit(code)


# ---- /proc ----------------------------------------------------------------------------


def _stat(pid: int) -> list[str]:
    """Fields 3.. of /proc/<pid>/stat (after the command name)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()


def _cpu_seconds(pid: int) -> float:
    try:
        fields = _stat(pid)
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                tree.setdefault(int(_stat(int(entry.name))[1]), []).append(int(entry.name))
    return tree


def _tree(pid: int, tree: dict[int, list[int]]) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(tree.get(current, []))
    return found


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _system_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    total = sum(values[:8])
    return total - idle, total


def _listen_overflows() -> int:
    """SYNs dropped because a listen queue was full (each costs its client a 1 s retry)."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], values.split()[1:], strict=True))
            return int(table.get("ListenOverflows", 0))
    return 0


@dataclass
class CpuSnapshot:
    at: float
    worker: float
    dev_server: float
    squids: float
    bench: float
    system: tuple[float, float]
    load: str
    overflows: int


def cpu_snapshot(worker_pid: int) -> CpuSnapshot:
    """CPU seconds so far of each party; the squids and the dev server are our children."""
    tree = _children()
    ours = tree.get(os.getpid(), [])
    dev = [p for p in ours if _comm(p) == "temporal"]
    squids = [p for p in ours if _comm(p) == "squid"]
    return CpuSnapshot(
        at=time.monotonic(),
        worker=_cpu_seconds(worker_pid),
        dev_server=sum(_cpu_seconds(p) for root in dev for p in _tree(root, tree)),
        squids=sum(_cpu_seconds(p) for root in squids for p in _tree(root, tree)),
        bench=time.process_time(),
        system=_system_busy(),
        load=" ".join(Path("/proc/loadavg").read_text().split()[:3]),
        overflows=_listen_overflows(),
    )


# ---- the benchmark --------------------------------------------------------------------


def config_for(origin_port: int, state_dir: str, provider: str) -> Config:
    return parse_config(
        {
            "installation": INSTALLATION,
            "proxy": {
                "auth": {"username": "proxy", "password_env": PASSWORD_ENV},
                "allowed_cidrs": ["127.0.0.0/8"],
                "allowed_connect_ports": [origin_port],
            },
            "providers": [{"name": provider, "type": "local", "local": {"state_dir": state_dir}}],
        },
        environ={PASSWORD_ENV: PASSWORD},
    )


async def bounded(aws: Iterable[Awaitable[T]], limit: int) -> list[T]:
    gate = asyncio.Semaphore(limit)

    async def one(aw: Awaitable[T]) -> T:
        async with gate:
            return await aw

    return await asyncio.gather(*(one(aw) for aw in aws))


async def create_squids(
    provider: LocalProvider, config: Config, count: int
) -> list[tuple[str, int]]:
    def create(k: int) -> Instance:
        owner = f"fleet-squid-{k}"
        return provider.create(
            CreateRequest(
                name=instance_name(owner, 0),
                proxy=config.proxy_settings(),
                tags=owner_tags(INSTALLATION, owner, 0),
            )
        )

    instances = await asyncio.gather(*(asyncio.to_thread(create, k) for k in range(count)))
    endpoints = []
    for instance in instances:
        while instance.state is not InstanceState.RUNNING:
            await asyncio.sleep(0.05)
            instance = await asyncio.to_thread(provider.get, instance.provider_id)
        endpoints.append((instance.ip, instance.port))
    return endpoints


async def delete_squids(provider: LocalProvider) -> None:
    instances = await asyncio.to_thread(provider.list_by_tag, "managed-by", "proxy-operator")
    await asyncio.gather(
        *(asyncio.to_thread(provider.delete, i.provider_id) for i in instances),
        return_exceptions=True,
    )


@dataclass
class Capacity:
    probes: int
    failed: int
    seconds: float
    millis: list[float]


async def squid_capacity(endpoints: list[tuple[str, int]], origin: TlsOrigin) -> Capacity:
    """Probes as fast as CAPACITY_CONCURRENCY loops can go, round-robin over the pool.

    This process also serves the TLS origin, so the figure is a floor on what
    the Squids can do, not their limit.
    """
    deadline = time.monotonic() + CAPACITY_SECONDS
    millis: list[float] = []
    failed = 0

    async def loop(k: int) -> None:
        nonlocal failed
        while time.monotonic() < deadline:
            ip, port = endpoints[k % len(endpoints)]
            k += 1
            result = await probe_connect(
                ip, port, "proxy", PASSWORD, origin.url, ssl_context=origin.client_ssl_context
            )
            if result.ok and result.total_ms is not None:
                millis.append(result.total_ms)
            else:
                failed += 1

    start = time.monotonic()
    await asyncio.gather(*(loop(k) for k in range(CAPACITY_CONCURRENCY)))
    return Capacity(len(millis) + failed, failed, time.monotonic() - start, millis)


class WorkerProcess:
    """The one worker, a child process of its own session (Ctrl-C reaches only us)."""

    def __init__(self, workdir: Path, spec: dict[str, Any]) -> None:
        self.workdir = workdir
        self.results = workdir / "results.json"
        self.ready = workdir / "ready"
        self.log = workdir / "worker.log"
        spec = {**spec, "results": str(self.results), "ready": str(self.ready)}
        spec_path = workdir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "bench.fleet", "--worker-spec", str(spec_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=Path(__file__).resolve().parent.parent,
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    async def wait_ready(self, within: float = 60) -> None:
        deadline = time.monotonic() + within
        while not self.ready.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not start:\n{self.tail()}")
            await asyncio.sleep(0.1)

    async def results_now(self, within: float = 60) -> dict[str, Any]:
        self.results.unlink(missing_ok=True)
        self.process.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + within
        while not self.results.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker reported nothing:\n{self.tail()}")
            await asyncio.sleep(0.1)
        data: dict[str, Any] = json.loads(self.results.read_text())
        return data

    async def stop(self, grace: float = 30) -> None:
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no worker log)"


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


@dataclass
class Measured:
    window: float
    probes: int
    expected: float
    gaps: list[float]
    open_gaps: list[float]
    instances: int
    silent: int
    failures: Counter[str]
    millis: list[float]
    lag: list[float]
    monitor_starts: int
    monitor_ends: Counter[str]
    counter_total: float
    recorded_total: int
    slow_stages: Counter[str]
    collections: list[tuple[int, float]]


STAGES = ("TCP connect to the Squid", "CONNECT reply (Squid connects to the origin)", "TLS", "HEAD")


def _slowest_stage(connect: float, reply: float, tls: float, total: float) -> str:
    times = (connect, reply, tls, total - connect - reply - tls)
    return STAGES[times.index(max(times))]


def analyse(data: dict[str, Any], t0: float, t1: float, proxies: int) -> Measured:
    gaps: list[float] = []
    open_gaps: list[float] = []
    millis: list[float] = []
    probes = 0
    recorded = 0
    probed_instances = 0
    for starts_raw, ms_raw in data["probes"].values():
        records = sorted(zip(starts_raw, ms_raw, strict=True))
        recorded += len(records)
        previous: float | None = None
        last_before_end: float | None = None
        for start, ms in records:
            if start >= t1:
                break
            if start >= t0:
                probes += 1
                if ms >= 0:
                    millis.append(ms)
                if previous is not None:
                    gaps.append(start - previous)
            previous = last_before_end = start
        if last_before_end is not None and last_before_end >= t0:
            probed_instances += 1
        if last_before_end is not None:
            # Time since the last probe when the window closed: a gap still open.
            open_gaps.append(t1 - last_before_end)
    lag_at, lag = data["lag"]
    failures: Counter[str] = Counter(
        failure for start, _, failure, _ in data["failures"] if t0 <= start < t1
    )
    return Measured(
        window=t1 - t0,
        probes=probes,
        expected=proxies * (t1 - t0) / INTERVAL,
        gaps=gaps,
        open_gaps=open_gaps,
        instances=len(data["probes"]),
        silent=proxies - probed_instances,
        failures=failures,
        millis=millis,
        lag=[v for at, v in zip(lag_at, lag, strict=True) if t0 <= at < t1],
        monitor_starts=sum(1 for at, _ in data["monitor_starts"] if t0 <= at < t1),
        monitor_ends=Counter(reason for at, reason in data["monitor_ends"] if t0 <= at < t1),
        counter_total=data["counter_total"],
        recorded_total=recorded,
        slow_stages=Counter(
            _slowest_stage(*stages) for start, *stages in data["slow"] if t0 <= start < t1
        ),
        collections=[(gen, took) for end, gen, took in data["collections"] if t0 <= end < t1],
    )


def pct(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


@dataclass
class Run:
    args: argparse.Namespace
    measured: Measured
    before: CpuSnapshot
    after: CpuSnapshot
    rss_kib: list[int]
    hwm_kib: int
    threads: int
    ready_seconds: float
    terminate_seconds: float
    capacity: Capacity


def print_report(run: Run) -> None:
    m, b, a, args = run.measured, run.before, run.after, run.args
    wall = a.at - b.at
    limit = INTERVAL * (1 + ON_TIME_TOLERANCE)
    on_time = sum(1 for g in m.gaps if g <= limit)
    on_time_share = on_time / len(m.gaps) if m.gaps else 0.0
    worst = max([*m.gaps, *m.open_gaps], default=float("nan"))
    missed = sum(1 for g in [*m.gaps, *m.open_gaps] if g > MAX_GAP_INTERVALS * INTERVAL)
    rate = m.probes / m.expected if m.expected else 0.0
    verdict = (
        rate >= MIN_RATE
        and on_time_share >= MIN_ON_TIME
        and worst <= MAX_GAP_INTERVALS * INTERVAL
        and m.silent == 0
    )
    worker_cpu = a.worker - b.worker

    def share(seconds: float) -> str:
        return f"{seconds / wall / CPUS * 100:.1f}% of {CPUS} cores ({seconds:.1f} CPU-s)"

    failures = ", ".join(f"{k} {v}" for k, v in m.failures.most_common()) or "none"
    busy = (a.system[0] - b.system[0]) / max(1.0, a.system[1] - b.system[1]) * 100
    cap = run.capacity
    ends = ", ".join(f"{k} {v}" for k, v in m.monitor_ends.items()) or "none"
    print(
        f"\nfleet monitoring: {args.proxies} proxies on {args.squids} Squids, "
        f"probes every {INTERVAL:g} s, one worker process, {wall:.0f} s window"
    )
    rows = [
        ("probes completed / expected", f"{m.probes} / {m.expected:.0f} ({rate * 100:.2f}%)"),
        (
            f"probes on time (<= {limit:g} s after the previous one)",
            f"{on_time_share * 100:.2f}% ({on_time} of {len(m.gaps)})",
        ),
        (
            "gap between an instance's probes p50 / p99 / p99.9 / max",
            f"{pct(m.gaps, 50):.3f} / {pct(m.gaps, 99):.3f} / {pct(m.gaps, 99.9):.3f} / "
            f"{max(m.gaps, default=float('nan')):.3f} s",
        ),
        (
            f"windows missed (a gap over {MAX_GAP_INTERVALS * INTERVAL:g} s, open ones too)",
            f"{missed} (longest gap {worst:.2f} s; {m.silent} proxies with no probe)",
        ),
        ("probe failures", failures),
        (
            "probe latency p50 / p99 / max",
            f"{pct(m.millis, 50):.1f} / {pct(m.millis, 99):.1f} / "
            f"{max(m.millis, default=float('nan')):.1f} ms",
        ),
        (
            "worker CPU (process, all threads)",
            f"{share(worker_cpu)}; {worker_cpu / max(1, m.probes) * 1000:.2f} ms per probe",
        ),
        (
            "worker RSS end / max in window / peak",
            f"{run.rss_kib[-1] / 1024:.0f} / {max(run.rss_kib) / 1024:.0f} / "
            f"{run.hwm_kib / 1024:.0f} MiB ({run.threads} threads)",
        ),
        (
            f"worker event-loop lag ({LAG_SLEEP * 1000:g} ms sleep) p50 / p99 / max",
            f"{pct(m.lag, 50) * 1000:.1f} / {pct(m.lag, 99) * 1000:.1f} / "
            f"{max(m.lag, default=float('nan')) * 1000:.1f} ms ({len(m.lag)} samples)",
        ),
        (
            f"probes over {SLOW_PROBE_MS:g} ms, by their slowest stage",
            f"{sum(m.slow_stages.values())}: "
            + (", ".join(f"{k} {v}" for k, v in m.slow_stages.most_common()) or "none"),
        ),
        (
            "worker garbage collections: oldest generation / any over "
            f"{GC_REPORT_MS:g} ms, longest",
            f"{sum(1 for g, _ in m.collections if g == 2)} / "
            f"{sum(1 for _, t in m.collections if t * 1000 >= GC_REPORT_MS)}, "
            f"{max((t for _, t in m.collections), default=0) * 1000:.0f} ms",
        ),
        ("monitor activities started / ended in the window", f"{m.monitor_starts} / {ends}"),
        (
            "probes on time (all three: rate >= 99%, >= 99% on time, no window missed)",
            "**yes**" if verdict else "**no**",
        ),
    ]
    _table(("what", "measured"), rows)
    print("\ncontext (same window)")
    context = [
        ("machine CPU busy (everything)", f"{busy:.0f}% of {CPUS} cores"),
        ("load average (1/5/15 min) at start -> end", f"{b.load} -> {a.load}"),
        ("dev server CPU", share(a.dev_server - b.dev_server)),
        (f"{args.squids} Squids (with helpers) CPU", share(a.squids - b.squids)),
        ("this process (TLS origin, polling) CPU", share(a.bench - b.bench)),
        ("TCP listen-queue overflows (machine-wide)", str(a.overflows - b.overflows)),
        (
            "Squid pool, capacity check before the run",
            f"{cap.probes / cap.seconds:.0f} probes/s ({CAPACITY_CONCURRENCY} at a time, "
            f"{cap.failed} failed), p50 {pct(cap.millis, 50):.1f} ms, "
            f"p99 {pct(cap.millis, 99):.1f} ms",
        ),
        ("fleet start -> all Ready", f"{run.ready_seconds:.0f} s ({args.concurrency} at a time)"),
        ("terminate signal -> none running", f"{run.terminate_seconds:.0f} s"),
        (
            "probes counter (proxy_operator_probes_total) / recorded, whole run",
            f"{m.counter_total:.0f} / {m.recorded_total}",
        ),
    ]
    _table(("what", "measured"), context)


def _table(headers: tuple[str, str], rows: list[tuple[str, str]]) -> None:
    print(f"| {headers[0]} | {headers[1]} |")
    print("| --- | --- |")
    for what, value in rows:
        print(f"| {what} | {value} |")


async def main(args: argparse.Namespace) -> None:
    env = await start_dev_server()
    try:
        with (
            serve_tls_origin() as origin,
            local_state_dir("proxy-operator-fleet-") as state_dir,
            tempfile.TemporaryDirectory(prefix="bench-fleet-") as workdir,
        ):
            config = config_for(origin.port, str(state_dir), SQUID_PROVIDER)
            squids = LocalProvider(LocalConfig(state_dir=str(state_dir)))
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
            rss.append(_status_kib(worker.pid, "VmRSS"))
            await asyncio.sleep(min(1.0, end - now))
        after = cpu_snapshot(worker.pid)
        rss.append(_status_kib(worker.pid, "VmRSS"))
        hwm = _status_kib(worker.pid, "VmHWM")
        threads = _status_kib(worker.pid, "Threads")
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
            rss,
            hwm,
            threads,
            ready_seconds,
            terminate_seconds,
            capacity,
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--proxies", type=int, default=1000)
    parser.add_argument("--squids", type=int, default=10)
    parser.add_argument("--minutes", type=float, default=3)
    parser.add_argument(
        "--concurrency", type=int, default=50, help="workflow starts and signals at a time"
    )
    parser.add_argument("--worker-spec", help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.worker_spec:
        worker_main(parsed.worker_spec)
    else:
        try:
            asyncio.run(main(parsed))
        except KeyboardInterrupt:
            print("interrupted: workflows, worker, Squids and dev server stopped", file=sys.stderr)
            sys.exit(130)
