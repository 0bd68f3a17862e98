"""Inputs and outputs of the activities: single typed dataclasses, JSON on the wire.

Workflows import these, so they hold plain data only, and never a secret:
credentials are added inside the worker, after the payload has been decoded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from providers.base import Disruption, endpoint


@dataclass(frozen=True)
class InstanceRef:
    """What a workflow remembers about one instance it owns."""

    provider: str
    provider_id: str
    name: str
    generation: int
    ip: str = ""
    port: int = 0
    created_at: str = ""
    # The address its traffic leaves from, as the provider knows it ("" unknown).
    exit_address: str = ""

    @property
    def endpoint(self) -> str:
        return endpoint(self.ip, self.port)


@dataclass(frozen=True)
class ValidateTargetInput:
    provider: str
    port: int | None
    placement: dict[str, str]
    health_target: str


@dataclass(frozen=True)
class TargetCheck:
    """What `validate_target` found: every problem, and the worker's installation.

    The installation is how a new lifecycle learns, deterministically, the
    scope its instance names are hashed in (providers/naming.py).
    """

    problems: list[str]
    installation: str


@dataclass(frozen=True)
class CreateInstanceInput:
    provider: str
    owner_id: str
    generation: int
    port: int | None = None
    labels: dict[str, str] = field(default_factory=dict)
    placement: dict[str, str] = field(default_factory=dict)
    # The installation the lifecycle learned at its first run; empty for a
    # lifecycle started before installations were hashed into names, which
    # keeps the old formula so its instances keep their names.
    installation: str = ""


@dataclass(frozen=True)
class InstanceInput:
    """Names one instance for get-like activities (wait, delete)."""

    instance: InstanceRef
    timeout_seconds: float = 600.0


@dataclass(frozen=True)
class ProbeThrough:
    """What the probing activities probe: a CONNECT through `instance` to the health `target`."""

    instance: InstanceRef
    target: str


@dataclass(frozen=True)
class ProbeInput(ProbeThrough):
    """`wait_healthy`: probe a new instance until it passes once, or the deadline."""

    timeout_seconds: float = 5.0
    deadline_seconds: float = 120.0
    # Return a failed probe after this long, before the deadline, so the
    # workflow can show it; None: only at the deadline.
    report_after_seconds: float | None = None


@dataclass(frozen=True, kw_only=True)
class ProbeCadence:
    """How the monitors probe: every interval, for how long, and how many failures fail.

    One base for both monitors' inputs rather than a nested field, so each
    input's JSON stays flat: a monitor scheduled by an older worker still
    decodes on a newer one during a rollout (keys, not positions, are decoded).
    """

    interval_seconds: float
    failure_threshold: int
    # Return after this long even when nothing changed, so the workflow can
    # rotate, continue-as-new and refresh its status (policies.MONITOR_PERIOD).
    max_duration_seconds: float
    probe_timeout_seconds: float = 5.0


@dataclass(frozen=True)
class MonitorInput(ProbeCadence, ProbeThrough):
    """`monitor`: probe a Ready instance every interval until it fails, vanishes or time is up."""


@dataclass(frozen=True)
class ProbeSummary:
    """The JSON-friendly part of a probe result that status and heartbeats show."""

    ok: bool
    at: str
    total_ms: float | None = None
    failure: str | None = None
    error: str | None = None
    # While waiting for an instance's first probe: how many were made so far.
    attempts: int | None = None


class MonitorReason(StrEnum):
    """Why the monitor returned; the first two mean the instance must be replaced."""

    UNHEALTHY = "unhealthy"
    GONE = "gone"
    ELAPSED = "elapsed"
    HANDOVER = "handover"


@dataclass(frozen=True)
class MonitorOutcome:
    """What the monitor saw when it returned, and why it did."""

    reason: MonitorReason
    last_probe: ProbeSummary | None
    consecutive_failures: int = 0
    probes: int = 0
    detail: str = ""
    # `gone` only: set when the platform took the instance away (no crash of the proxy's).
    disruption: Disruption | None = None


@dataclass(frozen=True)
class WatchedMember:
    """One pool member a pool's monitor probes: at the endpoint the pool advertises."""

    member: str
    provider: str
    endpoint: str


@dataclass(frozen=True)
class PoolMonitorInput(ProbeCadence):
    """`monitor_members`: probe a shard of a pool's members every interval, under one heartbeat."""

    members: list[WatchedMember]
    target: str


@dataclass(frozen=True)
class FailingMember:
    """A member whose advertised endpoint failed `failure_threshold` probes in a row."""

    member: str
    endpoint: str
    detail: str


@dataclass(frozen=True)
class PoolMonitorOutcome:
    """Why a pool's monitor returned (unhealthy: `failing` says who), and its probe count."""

    reason: MonitorReason
    failing: list[FailingMember] = field(default_factory=list)
    probes: int = 0


@dataclass(frozen=True)
class VerifyEndpointInput:
    """A member's claim to serve at `endpoint`, to be checked against its provider.

    `provider` and `owner_id` come from the pool's own record of the member;
    `endpoint` is what the member's report (an untrusted signal) said.
    """

    provider: str
    owner_id: str
    endpoint: str
    # The pool's `exit_echo_url`: asked through the proxy once it is confirmed.
    echo_url: str = ""
    # The generation the report names and the member's placement: where a
    # provider can look the instance up by name (providers.base.NamedLookup),
    # one read instead of a list. None from pools that did not send it.
    generation: int | None = None
    placement: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EndpointCheck:
    """Whether the provider confirmed the endpoint; if not, why (for the pool's status)."""

    verified: bool
    problem: str = ""
    # Where the member's traffic leaves from: what the echo service saw when
    # the pool names one and it answered, else what the provider says ("" unknown).
    exit_address: str = ""
    # Why the echo service gave no address (the provider's is kept meanwhile).
    exit_problem: str = ""
