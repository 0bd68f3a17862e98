"""What bench.gateway measures with: client load, pinned probes, the gateway's processes.

All from outside the gateway: its proxy port, its control API and /proc,
never its code, so the benchmark measures whatever engine the gateway runs.
"""

from __future__ import annotations

import collections
import ssl
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.stats import percentile
from squid import procfs
from tests.helpers.api import call
from tests.helpers.gateway import GatewayProcess
from tests.helpers.procfs import children_by_parent, cpu_seconds, descendants, status_value
from tests.helpers.tls_origin import TlsOrigin
from tests.helpers.tunnel import request

Target = tuple[str, int]
# Pinned probes name their target so, and only they do: a member Squid's
# access log line with it is a probe's (the origin's certificate names it too).
PROBE_HOST = "localhost"
# A member Squid writes a tunnel's line once it closed: how long to look for it.
PROBE_LOG_WAIT = 2.0


@dataclass(frozen=True)
class Phase:
    """One load phase's figures: successes, failures by kind, latencies, stalls, gateway CPU."""

    name: str
    seconds: float
    ok: int
    failed: dict[str, int]
    latencies: list[float]
    # The longest any client waited between two of its requests completing
    # (or between the phase's start or end and its nearest completion).
    longest_gap: float
    longest_request: float
    gateway_cpu: float

    @property
    def rate(self) -> float:
        return self.ok / self.seconds

    @property
    def failures(self) -> int:
        return sum(self.failed.values())

    def p(self, q: float) -> float:
        return percentile(self.latencies, q) if self.latencies else float("nan")


class Load:
    """`clients` threads, each sending one HTTPS request after another through `proxy` to
    the origin at `target`, trusted by `context`."""

    def __init__(
        self,
        proxy: Target,
        target: Target,
        context: ssl.SSLContext,
        clients: int,
        credentials: tuple[str, str],
    ) -> None:
        self.latencies: list[float] = []
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.longest_gap = 0.0
        self.longest_request = 0.0
        self._proxy, self._target, self._context = proxy, target, context
        self._credentials = credentials
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run) for _ in range(clients)]
        self._started = 0.0

    def _run(self) -> None:
        last = self._started
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                answer = request(self._proxy, *self._credentials, self._target, self._context)
                outcome = "ok" if answer.ok else f"status {answer.connect_status}"
            except OSError as err:
                outcome = type(err).__name__
            end = time.monotonic()
            with self._lock:
                self.outcomes[outcome] += 1
                if outcome == "ok":
                    self.latencies.append(end - start)
                self.longest_gap = max(self.longest_gap, end - last)
                self.longest_request = max(self.longest_request, end - start)
            last = end
        with self._lock:
            self.longest_gap = max(self.longest_gap, time.monotonic() - last)

    def __enter__(self) -> Load:
        self._started = time.monotonic()
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def phase(self, name: str, seconds: float, gateway_cpu: float) -> Phase:
        failed = {k: v for k, v in self.outcomes.items() if k != "ok"}
        return Phase(
            name,
            seconds,
            self.outcomes["ok"],
            failed,
            list(self.latencies),
            self.longest_gap,
            self.longest_request,
            gateway_cpu,
        )


class ProbeLogs:
    """The member Squids' access logs, read for the pinned probes' lines only."""

    def __init__(self, squid_dirs: dict[int, Path]) -> None:
        # Squid port -> its access log, and how far it has been read.
        self._logs = {port: directory / "access.log" for port, directory in squid_dirs.items()}
        self._read = {port: self._size(port) for port in self._logs}

    def _size(self, port: int) -> int:
        path = self._logs[port]
        return path.stat().st_size if path.exists() else 0

    def skip(self) -> None:
        """Forget what is logged so far: the next probe's line is what comes after."""
        self._read = {port: self._size(port) for port in self._logs}

    def served_by(self, origin_port: int, within: float = PROBE_LOG_WAIT) -> int | None:
        """The port of the Squid that logged a probe since `skip`, or None if none did in time."""
        needle = f" {PROBE_HOST}:{origin_port} ".encode()
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            for port, path in self._logs.items():
                with path.open("rb") as log:
                    log.seek(self._read[port])
                    if needle in log.read():
                        return port
            time.sleep(0.02)
        return None


def pinned_probe(
    gateway: GatewayProcess,
    origin: TlsOrigin,
    logs: ProbeLogs,
    credentials: tuple[str, str],
    member: str,
) -> int | None:
    """One request pinned to `member` through the gateway: the port of the Squid that
    served it, or None if it failed or no Squid logged it."""
    user, password = credentials
    logs.skip()
    try:
        answer = request(
            ("127.0.0.1", gateway.port),
            f"{user}-proxy-{member}",
            password,
            (PROBE_HOST, origin.port),
            origin.client_ssl_context,
        )
    except OSError:
        return None
    return logs.served_by(origin.port) if answer.ok else None


def gateway_processes(gateway: GatewayProcess) -> list[int]:
    """The gateway's process and everything it runs: its children (Squid, the router,
    the watchdog) and anything serving from its state directory."""
    assert gateway.process is not None
    below = descendants(gateway.process.pid, children_by_parent())
    return sorted(set(below) | set(procfs.processes_under(gateway.state_dir)))


def gateway_cpu(gateway: GatewayProcess) -> float:
    """CPU seconds the gateway's processes have used so far (those still running)."""
    return sum(cpu_seconds(pid) for pid in gateway_processes(gateway))


def gateway_rss_kib(gateway: GatewayProcess) -> int:
    """Resident memory of the gateway's processes, summed (pages they share count in each)."""
    return sum(status_value(pid, "VmRSS") for pid in gateway_processes(gateway))


def session_members(gateway: GatewayProcess, keys: Iterable[str]) -> dict[str, str | None]:
    """What the control API says each session key goes to now (None: no member can carry it)."""
    assert gateway.api is not None
    port, token = gateway.api
    found: dict[str, str | None] = {}
    for key in keys:
        reply = call(port, "GET", f"/v1/sessions/{key}", token=token)
        found[key] = reply.json()["member"] if reply.status == 200 else None
    return found


def gateway_members(gateway: GatewayProcess) -> list[dict[str, Any]]:
    """The control API's `/v1/members`: the members the gateway routes to."""
    assert gateway.api is not None
    port, token = gateway.api
    reply = call(port, "GET", "/v1/members", token=token)
    members: list[dict[str, Any]] = reply.json()["members"]
    return members
