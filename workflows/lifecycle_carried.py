"""What a ProxyLifecycle knows about its proxy, and the `status` computed from it.

`CarriedState` is the workflow's one store of what outlives a run: every
step writes it, continue-as-new hands it to the next run as it is, and the
`status` query is computed from it (`status_of`), never kept beside it. What
belongs to one run only (its waits, a terminate received) is the workflow's
own and comes in as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from activities.models import InstanceRef, ProbeSummary
from contract import ProxyState
from workflows.lifecycle_states import INITIAL


@dataclass
class InstanceCause:
    """Why an instance was made, and when that was decided.

    `why` is at most MAX_CAUSE characters (`instance_cause`): it is carried
    across continue-as-new and may quote a reason someone else sent.
    """

    why: str
    # ISO 8601, to the second.
    at: str


# The longest `InstanceCause.why`: a capped signal reason (500) with its wording.
MAX_CAUSE = 700


def instance_cause(why: str, at: str) -> InstanceCause:
    """A cause, cut to MAX_CAUSE characters."""
    return InstanceCause(why if len(why) <= MAX_CAUSE else why[: MAX_CAUSE - 1] + "…", at)


@dataclass
class ProxyStatus:
    """What the `status` query returns."""

    state: ProxyState = INITIAL
    provider: str = ""
    endpoint: str = ""
    provider_id: str = ""
    instance: str = ""
    generation: int = 0
    ready_since: str | None = None
    last_probe: ProbeSummary | None = None
    replacements: int = 0
    failures_in_a_row: int = 0
    waiting_for: str | None = None
    last_error: str | None = None
    terminate_reason: str | None = None
    # When last_error happened: an error older than ready_since is history.
    last_error_at: str | None = None
    # Where the instance's traffic leaves from, as its provider knows it.
    exit_address: str | None = None
    # Why the instance shown exists (or is being brought up), and when that was decided.
    cause: InstanceCause | None = None
    # While a rotation is under way: why the instance shown is being replaced.
    replaced_because: InstanceCause | None = None
    # Instances the platform took away (preempted, interrupted, evicted) and
    # the proxy replaced: counted apart from failures, never a crash.
    disruptions: int = 0


@dataclass
class ProviderWait:
    """How far the lifecycle is into waiting out quota or a provider outage.

    Carried, so a run that continues as new in the middle of the wait goes on
    with it: the backoff where it was, the time it began still shown.
    """

    # When the first call of this wait failed (ISO 8601).
    since: str
    # Calls that failed for provider trouble (PROVIDER_WAIT's backoff step).
    provider_failures: int = 0
    # Calls that failed in all, quota included.
    failed_calls: int = 0
    # What status says of the wait ("waiting for quota: ... (since ..., N
    # failed calls)"), still said while the call is tried again.
    shown: str = ""


@dataclass
class CarriedState:
    """Everything a lifecycle knows that outlives a run; continue-as-new carries it whole.

    A terminate pending is not here: a run with one never continues as new,
    and one that hands over while Terminating carries `terminating`.
    """

    state: ProxyState = INITIAL
    provider: str = ""
    # The instance serving (Ready), or None while there is none.
    current: InstanceRef | None = None
    # The instance `status` shows: the current one, or, while there is none,
    # the one being brought up; None once it is retired.
    shown: InstanceRef | None = None
    # The generation of the instance last shown (kept when it is retired).
    generation: int = 0
    # Every instance made and not yet confirmed gone, oldest first.
    owned: list[InstanceRef] = field(default_factory=list)
    next_generation: int = 0
    ready_since: str | None = None
    last_probe: ProbeSummary | None = None
    replacements: int = 0
    failures_in_a_row: int = 0
    # Instances the platform took away, over the proxy's life (ProxyStatus.disruptions),
    # and since an instance last became Ready (what paces their replacement).
    disruptions: int = 0
    disruptions_in_a_row: int = 0
    last_error: str | None = None
    last_error_at: str | None = None
    # The installation instance names are hashed with; None for a lifecycle
    # started before that, which keeps the old names (providers/naming.py).
    installation: str | None = None
    # A `rotate` signal not yet carried out.
    rotate_reason: str | None = None
    # The generation being brought up (created, waited for, first-probed)
    # until it is Ready or written off: a run that continued as new in the
    # middle resumes it instead of starting another.
    bringing_up: int | None = None
    # The lifecycle's wait for quota or its provider, while one lasts.
    provider_wait: ProviderWait | None = None
    # Set by a run that handed over while Terminating: the terminate's
    # reason, which the next run goes on with, and a delete refused for good
    # on the way (the proxy then ends Failed, naming it).
    terminating: str | None = None
    delete_refused: str | None = None
    # Why the serving instance (`current`) was made; None for one made by
    # a release that did not say.
    cause: InstanceCause | None = None
    # Why the next generation is (being) brought up: the first start, a
    # rotation, a failure. It becomes `cause` when that generation is Ready.
    next_cause: InstanceCause | None = None

    def own(self, ref: InstanceRef) -> None:
        """Remember an instance until it is gone; a newer view of one replaces it in place."""
        for index, known in enumerate(self.owned):
            if known.provider_id == ref.provider_id:
                self.owned[index] = ref
                return
        self.owned.append(ref)

    def disown(self, ref: InstanceRef) -> None:
        """Forget an instance confirmed gone."""
        self.owned = [known for known in self.owned if known.provider_id != ref.provider_id]


def status_of(
    carried: CarriedState, *, waiting_for: str | None, terminate_reason: str | None
) -> ProxyStatus:
    """The `status` query's answer: the carried state, plus what this run is doing."""
    shown = carried.shown
    serving = carried.current is not None and shown == carried.current
    return ProxyStatus(
        state=carried.state,
        provider=carried.provider,
        endpoint=shown.endpoint if shown else "",
        provider_id=shown.provider_id if shown else "",
        instance=shown.name if shown else "",
        generation=carried.generation,
        ready_since=carried.ready_since,
        last_probe=carried.last_probe,
        replacements=carried.replacements,
        failures_in_a_row=carried.failures_in_a_row,
        waiting_for=waiting_for,
        last_error=carried.last_error,
        terminate_reason=terminate_reason,
        last_error_at=carried.last_error_at,
        exit_address=(shown.exit_address or None) if shown else None,
        cause=carried.cause if serving else carried.next_cause,
        replaced_because=carried.next_cause if serving else None,
        disruptions=carried.disruptions,
    )
