"""The gateway's Prometheus series, read from its access logs.

Squid (front.log) and the router (router.log) log every request in
`squid.gateway.GATEWAY_LOG_FORMAT`'s fields:

    <time> <ms> <status> <squid status>/<hierarchy> <peer name> <peer ip> <peer port> <method> <url>

The router's lines say which member carried a request (the peer name, mapped
back to the member id), Squid's what the client was answered. Lines are
read as they are written, by a thread that follows each file.

Two views of one registry. The control API's /metrics (gateway/api.py,
behind its token) serves every series. PUBLIC, for the metrics listener
that Prometheus and the kubelet reach without a token, names no member and
no exit address (the map of the fleet a client could aim at): counters are
summed over those labels, and gauges that name members are left out (their
aggregates, MEMBERS and DISTINCT_EXITS, stay). The alert rules and
dashboards use aggregates only, so they read the public listener.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from squid.gateway import TUNNEL_OPENED, GatewayMember, Route, peer_name

REQUESTS = Counter(
    "proxy_operator_gateway_requests",
    "CONNECTs a pool member carried, by member, route (rotate, session, pin) and status",
    ["member", "route", "status"],
)
RESPONSES = Counter(
    "proxy_operator_gateway_responses",
    "What clients were answered, by status (200, 403, 407, 5xx)",
    ["status"],
)
FAILURES = Counter(
    "proxy_operator_gateway_failures",
    "Client requests the gateway could not carry: answered 5xx, or no answer at all",
    ["status"],
)
# The `outcome` label of RELOADS; the alert rules count "failed".
RELOAD_OK = "ok"
RELOAD_FAILED = "failed"
RELOAD_OUTCOMES = (RELOAD_OK, RELOAD_FAILED)
RELOADS = Counter(
    "proxy_operator_gateway_reloads",
    "Membership changes applied to the router, by outcome",
    ["outcome"],
)
CHANGE_SECONDS = Histogram(
    "proxy_operator_gateway_change_seconds",
    "From a membership change leaving the follower to the router answering that it is in force",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
MEMBERS = Gauge("proxy_operator_gateway_members", "Pool members in rotation, every pool's")
POOL_MEMBERS = Gauge(
    "proxy_operator_gateway_pool_members",
    "Members in rotation from each pool the gateway fronts (gateway/pools.py)",
    ["pool"],
)
POOL_OPEN = Gauge(
    "proxy_operator_gateway_pool_open",
    "1 while the pool's workflow runs; 0 once it closed and its members left rotation",
    ["pool"],
)
MEMBER_EXITS = Gauge(
    "proxy_operator_gateway_member_exit_info",
    "1 per member in rotation and the exit address its pool confirmed (unknown: not listed)",
    ["member", "exit_address"],
)
DISTINCT_EXITS = Gauge(
    "proxy_operator_gateway_distinct_exits",
    "Different exit addresses among the members in rotation (unknown ones not counted)",
)


def set_members(members: Sequence[GatewayMember]) -> None:
    """The member gauges: how many, and where each one's traffic leaves from."""
    MEMBERS.set(len(members))
    MEMBER_EXITS.clear()
    for member in members:
        if member.exit_address:
            MEMBER_EXITS.labels(member.member, member.exit_address).set(1)
    DISTINCT_EXITS.set(len({m.exit_address for m in members if m.exit_address}))


MEMBERSHIP_ERRORS = Counter(
    "proxy_operator_gateway_membership_errors",
    "Polls of a pool's endpoints query that failed, by pool (its members in rotation stay)",
    ["pool"],
)
# The `reason` label of REFUSED_ENDPOINTS (gateway/member_networks.py).
REFUSED_NETWORK = "network"
REFUSED_HOSTNAME = "hostname"
REFUSED_REASONS = (REFUSED_NETWORK, REFUSED_HOSTNAME)
REFUSED_ENDPOINTS = Counter(
    "proxy_operator_gateway_refused_endpoints",
    "Endpoints in the pool's answer refused as parents, each counted when it first "
    "appears: outside the member networks, or a hostname",
    ["reason"],
)
# Autoscaling (gateway/demand.py, gateway/wake.py).
OPEN_TUNNELS = Gauge("proxy_operator_gateway_open_tunnels", "Client tunnels the front holds now")
# The `outcome` label of DEMAND_REPORTS.
REPORT_SENT = "sent"
REPORT_REFUSED = "refused"
REPORT_FAILED = "failed"
DEMAND_REPORTS = Counter(
    "proxy_operator_gateway_demand_reports",
    "Demand reports to a pool, by pool and outcome (sent, refused by the pool, failed to reach it)",
    ["pool", "outcome"],
)
POOL_REPLICAS = Gauge(
    "proxy_operator_gateway_pool_replicas",
    "The pool's size, as its answer to the gateway's last report said",
    ["pool"],
)
POOL_MEMBER_SECONDS = Gauge(
    "proxy_operator_gateway_pool_member_seconds",
    "Instance time the pool has cost since it started (member-seconds), as of its last answer",
    ["pool"],
)
# The `outcome` label of WAKES.
WAKE_SERVED = "served"
WAKE_TIMED_OUT = "timed_out"
WAKE_RETRY_REFUSED = "retry_refused"
WAKE_REFUSED = "refused"
WAKES = Counter(
    "proxy_operator_gateway_held_connects",
    "CONNECTs held while the pool had no member: tunnelled once one served, answered "
    "503 with Retry-After past the wake timeout, or (Squid's retry of one) answered 503 at "
    "once; and CONNECTs to a holder without the fleet's credentials, answered 407 at once",
    ["outcome"],
)

POLL_SECONDS = 0.2
# Labels that say which member, or where its traffic leaves from.
MEMBER_LABELS = frozenset({"member", "exit_address"})


class Aggregates(Collector):
    """`registry`'s series with MEMBER_LABELS summed away (counters) or left out (the rest)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self._registry.collect():
            if not any(MEMBER_LABELS & sample.labels.keys() for sample in family.samples):
                yield family
            elif family.type == "counter":
                yield _summed(family)


def _summed(family: Metric) -> Metric:
    """A counter family summed over MEMBER_LABELS; `_created` goes (no one time fits a sum)."""
    totals: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for sample in family.samples:
        if sample.name.endswith("_created"):
            continue
        labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in MEMBER_LABELS))
        totals[sample.name, labels] = totals.get((sample.name, labels), 0.0) + sample.value
    summed = Metric(family.name, family.documentation, family.type, family.unit)
    for (name, labels), value in totals.items():
        summed.add_sample(name, dict(labels), value)
    return summed


PUBLIC = CollectorRegistry()
PUBLIC.register(Aggregates(REGISTRY))


class MemberNames:
    """Peer names back to member ids, for every member the gateway has ever had."""

    def __init__(self) -> None:
        self._members: dict[str, tuple[str, Route]] = {}
        # The members added: each change names them all, mostly ones already here.
        self._known: set[str] = set()

    def add(self, member: str) -> None:
        if member in self._known:
            return
        self._known.add(member)
        for route in Route:
            self._members[peer_name(member, route)] = (member, route)

    def get(self, name: str) -> tuple[str, str]:
        member, route = self._members.get(name, ("", ""))
        return member, str(route)


def count_router_line(line: str, names: MemberNames) -> None:
    fields = line.split()
    if len(fields) < 5 or fields[4] == "-" or fields[3] == TUNNEL_OPENED:
        return  # a granted tunnel's line: its CONNECT is counted when it ends
    member, route = names.get(fields[4])
    REQUESTS.labels(member=member, route=route, status=fields[2]).inc()


def count_front_line(line: str) -> None:
    fields = line.split()
    if len(fields) < 3:
        return
    status = fields[2]
    RESPONSES.labels(status=status).inc()
    if status == "000" or status.startswith("5"):
        FAILURES.labels(status=status).inc()


class LogFollower:
    """Follows access logs as Squid appends to them; `stop` ends the thread."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._files: list[tuple[Path, Callable[[str], None]]] = []
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}
        # One reader at a time: the thread, or a caller catching up.
        self._reading = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="access-logs", daemon=True)

    def follow(self, path: Path, handle: Callable[[str], None]) -> None:
        self._files.append((path, handle))
        self._offsets[path], self._partial[path] = 0, ""

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def catch_up(self) -> None:
        """Handle every whole line written so far, now: what a caller needs to have been
        read (a session's carrier, for a ban) need not wait for the next poll."""
        with self._reading:
            for path, handle in self._files:
                with contextlib.suppress(FileNotFoundError):
                    with path.open(errors="replace") as log:
                        log.seek(self._offsets[path])
                        text = self._partial[path] + log.read()
                        self._offsets[path] = log.tell()
                    *lines, self._partial[path] = text.split("\n")
                    for line in lines:
                        handle(line)

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            self.catch_up()
            if stopping:
                return
            self._stop.wait(POLL_SECONDS)
