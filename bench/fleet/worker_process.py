"""The one worker under test, as a child process so its CPU figure is its own.

`python -m bench.fleet.worker_process SPEC` runs `serve_worker`: a real
build_worker whose provider is a stand-in over the Squid pool and whose probe
records every probe it makes. `WorkerProcess` is the benchmark's side: it
starts that process, asks it for its records (SIGUSR1) and stops it.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
import uuid
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.client import Client

from activities.metrics import POOL_MONITOR_LATE_SECONDS, PROBES
from activities.models import MonitorInput, MonitorOutcome
from activities.probe import ProbeResult
from activities.provider import InstanceProbe, ProbeRequest, ProviderActivities, probe_instance
from bench.fleet.parameters import (
    FLEET_PROVIDER,
    GC_REPORT_MS,
    LAG_SLEEP,
    SLOW_PROBE_MS,
    config_for,
)
from providers.base import CreateRequest
from providers.memory import MemoryProvider
from providers.naming import GENERATION_KEY, OWNER_KEY
from tests.helpers.tls_origin import TlsOrigin
from worker import DEFAULT_MAX_WORKFLOW_TASKS, SERVE_POOLS, build_pool_worker, build_worker


class PoolProvider(MemoryProvider):
    """The provider contract in memory, every instance pointing at a real Squid.

    Instance i (the number ending its owner's workflow id) is endpoint
    i % len(endpoints): creating and deleting are instant, probing is real.
    """

    def __init__(self, endpoints: Sequence[tuple[str, int]]) -> None:
        super().__init__()
        self._endpoints = list(endpoints)

    def address(self, req: CreateRequest) -> tuple[str, int]:
        return self._endpoints[_owner_index(req) % len(self._endpoints)]


class DistinctAddressProvider(PoolProvider):
    """PoolProvider with every instance at an address of its own, as a real fleet's are.

    Instance k created gets 127.a.b.c (k spread over the three octets, none 0
    or 255) at the port of Squid (owner index + generation) % len(endpoints),
    whose Squids listen on every address: so each member is a distinct
    host:port, and a member's next instance is served by another Squid
    than its last, which tells a benchmark which instance a request reached.
    """

    def __init__(self, endpoints: Sequence[tuple[str, int]]) -> None:
        super().__init__(endpoints)
        self._created = itertools.count()

    def address(self, req: CreateRequest) -> tuple[str, int]:
        generation = int(req.tags.get(GENERATION_KEY, "0"))
        _, port = self._endpoints[(_owner_index(req) + generation) % len(self._endpoints)]
        return loopback_address(next(self._created)), port


def loopback_address(k: int) -> str:
    """The k-th of 254**3 loopback addresses, from 127.1.1.1."""
    high, rest = divmod(k % 254**3, 254 * 254)
    middle, low = divmod(rest, 254)
    return f"127.{high + 1}.{middle + 1}.{low + 1}"


def _owner_index(req: CreateRequest) -> int:
    """The number ending the instance's owner's workflow id (`pool/3`, `fleet-7`)."""
    owner = req.tags.get(OWNER_KEY, req.name)
    number = re.search(r"\d+$", owner)
    return int(number[0]) if number else hash(owner)


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
            "pool_monitor_late": _pool_monitor_late(),
            "slow": self.slow,
            "collections": self.collections,
        }


def recording_probe(recorder: Recorder) -> InstanceProbe:
    """The real probe, each one recorded with its start time under its instance."""

    async def probe(req: ProbeRequest) -> ProbeResult:
        start = time.monotonic()
        result = await probe_instance(req)
        recorder.probe(req.instance.provider_id, start, result)
        return result

    return probe


class RecordingActivities(ProviderActivities):
    """ProviderActivities that record every monitor start and end."""

    def __init__(self, *args: Any, recorder: Recorder, **kwargs: Any) -> None:
        super().__init__(*args, probe=recording_probe(recorder), **kwargs)
        self.recorder = recorder

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


def _pool_monitor_late() -> list[tuple[float, float]]:
    """The pool monitors' rounds so far, as (bucket bound `le`, rounds at most that late)."""
    return [
        (float(sample.labels["le"]), sample.value)
        for family in POOL_MONITOR_LATE_SECONDS.collect()
        for sample in family.samples
        if sample.name.endswith("_bucket")
    ]


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
    """The worker process: one build_worker over the pool provider (or, for `serve:
    "pools"`, one build_pool_worker), until SIGTERM."""
    config = config_for(spec["origin_ports"], spec["state_dir"], FLEET_PROVIDER)
    squids = [(ip, port) for ip, port in spec["endpoints"]]
    provider = (
        DistinctAddressProvider(squids) if spec.get("distinct_addresses") else PoolProvider(squids)
    )
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
    slots = spec.get("workflow_task_slots", DEFAULT_MAX_WORKFLOW_TASKS)
    async with (
        build_pool_worker(
            client, activities, task_queue=spec["task_queue"], max_concurrent_workflow_tasks=slots
        )
        if spec.get("serve") == SERVE_POOLS
        else build_worker(
            client, activities, task_queue=spec["task_queue"], max_concurrent_workflow_tasks=slots
        )
    ):
        await asyncio.to_thread(Path(spec["ready"]).write_text, str(os.getpid()))
        await stop.wait()
    lag.cancel()
    watch.cancel()
    activities.close()


def worker_spec(
    client: Client,
    origin: TlsOrigin,
    endpoints: Sequence[tuple[str, int]],
    workdir: Path,
    name: str,
    more_ports: Sequence[int] = (),
) -> dict[str, Any]:
    """What `serve_worker` needs: the dev server, a fresh task queue, the Squids and the origin.

    The origin's CA is written under `workdir` for the worker's probes to trust;
    its proxies tunnel to the origin's port and `more_ports` (origins with
    certificates from the same CA).
    """
    ca_file = workdir / "ca.pem"
    origin.ca.cert_pem.write_to_path(str(ca_file))
    return {
        "target_host": client.service_client.config.target_host,
        "namespace": client.namespace,
        "task_queue": f"bench-{name}-{uuid.uuid4().hex[:8]}",
        "endpoints": endpoints,
        "origin_ports": [origin.port, *more_ports],
        "ca_file": str(ca_file),
        "state_dir": str(workdir / "unused"),
        "parent_pid": os.getpid(),
    }


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
    # No interpreter teardown with the SDK's native threads alive (see cli.run).
    os._exit(code)


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
                [sys.executable, "-m", "bench.fleet.worker_process", str(spec_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=Path(__file__).resolve().parents[2],
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


if __name__ == "__main__":
    worker_main(sys.argv[1])
