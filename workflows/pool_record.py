"""What a pool knows of itself and hands to its next run, in one store.

A pool's run ends in continue-as-new every few hundred events
(workflows/pool_budget.py), so everything the pool must not forget (its
size, its members, its backoff and failure budget, its bans, the updates it
applied, an autoscaled pool's demand and decisions) lives here, and the run hands it over
whole: `carried` is its shape on the wire (`PoolCarried`,
workflows/pool_carried.py), `taken_over` the next run's record from it.
Whatever is not here is the run's own, and starts afresh in each run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from operator import attrgetter

from contract import ProxyState
from workflows import pool_plan
from workflows.membership import MAX_ERROR_LENGTH
from workflows.pool_autoscale import Books, Usage
from workflows.pool_carried import PoolCarried
from workflows.pool_input import BanLimit
from workflows.pool_plan import Member, MemberPhase, Situation, Step
from workflows.pool_requests import AppliedUpdates


@dataclass
class PoolRecord:
    """The pool's size, members and bookkeeping: what outlives a run (`PoolCarried` on the wire)."""

    replicas: int = 0
    # By member id, in index order (`keep`): the order every view and plan reads.
    members: dict[str, Member] = field(default_factory=dict)
    next_index: int = 0
    failures_in_a_row: int = 0
    last_error: str | None = None
    # Why the pool stopped replacing failed members, until a `scale`.
    stopped: str | None = None
    # No member starts before this (the replacement backoff).
    start_after: datetime | None = None
    # When bans were taken lately (ISO times), for the ban limit.
    bans: list[str] = field(default_factory=list)
    last_reconcile: datetime | None = None
    terminate_reason: str | None = None
    rejected_reports: int = 0
    last_rejected: str | None = None
    # Why members the pool did not remove are gone: the causes of their replacements.
    vacancies: list[str] = field(default_factory=list)
    applied_updates: AppliedUpdates = field(default_factory=AppliedUpdates)
    # An autoscaled pool's demand and decisions (pool_autoscale.Books), and its
    # usage in member-seconds.
    autoscale: Books | None = None
    usage: Usage = field(default_factory=Usage)
    rotations_abandoned: int = 0

    def keep(self, members: Iterable[Member]) -> None:
        """The members from now on, in index order."""
        self.members = {m.member: m for m in sorted(members, key=attrgetter("index"))}

    def situation(self, *, reconciling: bool = False, headroom: int | None = None) -> Situation:
        """What a plan reads (`pool_plan.Situation`)."""
        return Situation(
            replicas=self.replicas,
            # Kept in index order (`keep`): read after every step, not sorted.
            members=tuple(self.members.values()),
            next_index=self.next_index,
            failures_in_a_row=self.failures_in_a_row,
            stopped=self.stopped,
            start_after=self.start_after,
            last_reconcile=self.last_reconcile,
            reconciling=reconciling,
            ending=self.terminate_reason is not None,
            vacancies=tuple(self.vacancies),
            headroom=headroom,
        )

    def take(self, step: Step) -> None:
        """A step's members, next index, backoff and vacancies (its commands are the
        pool's to issue)."""
        self.keep(step.members)
        self.next_index = step.next_index
        self.start_after = step.start_after
        self.vacancies = list(step.vacancies)
        if step.abandoned:
            self.rotations_abandoned += len(step.abandoned)
            self.last_error = (
                f"rotation abandoned, not Ready within the deadline: {', '.join(step.abandoned)}"
            )[:MAX_ERROR_LENGTH]

    def ended(
        self, member: Member, state: str, error: str | None, failure_budget: int, now: datetime
    ) -> None:
        """A member closed: forget it; replace it unless the pool asked for its end, after
        a backoff if it failed (`pool_plan.after_failure`)."""
        self.members.pop(member.member, None)
        if member.phase is MemberPhase.REMOVING or self.terminate_reason is not None:
            return
        if state != ProxyState.FAILED:
            # Ended from outside the pool (a user's terminate): replaced at once.
            self.vacancies.append(f"replaces {member.member}, {state} from outside the pool")
            return
        self.vacancies.append(f"replaces {member.member}, ended Failed: {error or 'no reason'}")
        failure = pool_plan.after_failure(
            self.failures_in_a_row, failure_budget, member.member, error, now
        )
        self.failures_in_a_row, self.last_error = failure.failures_in_a_row, failure.last_error
        if failure.stopped is not None:
            self.stopped = failure.stopped
        else:
            self.start_after = failure.start_after

    @classmethod
    def taken_over(cls, carried: PoolCarried) -> PoolRecord:
        """The record a continued run takes over from its previous run."""
        record = cls(
            replicas=carried.replicas,
            next_index=carried.next_index,
            failures_in_a_row=carried.failures_in_a_row,
            last_error=carried.last_error,
            stopped=carried.stopped_replacing,
            start_after=_time(carried.start_after),
            bans=carried.bans,
            last_reconcile=_time(carried.last_reconcile),
            terminate_reason=carried.terminate_reason,
            rejected_reports=carried.rejected_reports,
            last_rejected=carried.last_rejected,
            vacancies=carried.vacancies,
            applied_updates=AppliedUpdates(carried.applied_updates),
            autoscale=carried.autoscale,
            usage=carried.usage,
            rotations_abandoned=carried.rotations_abandoned,
        )
        record.keep(carried.members)
        return record

    def carried(self, ban_limit: BanLimit | None, now: datetime) -> PoolCarried:
        """What the next run takes over; bans past `ban_limit`'s window are dropped."""
        return PoolCarried(
            replicas=self.replicas,
            members=list(self.members.values()),
            next_index=self.next_index,
            failures_in_a_row=self.failures_in_a_row,
            last_error=self.last_error,
            stopped_replacing=self.stopped,
            start_after=self.start_after.isoformat() if self.start_after else None,
            bans=pool_plan.recent_bans(self.bans, ban_limit, now)
            if ban_limit is not None
            else self.bans,
            last_reconcile=self.last_reconcile.isoformat() if self.last_reconcile else None,
            terminate_reason=self.terminate_reason,
            rejected_reports=self.rejected_reports,
            last_rejected=self.last_rejected,
            vacancies=self.vacancies,
            applied_updates=self.applied_updates.carried(),
            autoscale=self.autoscale,
            usage=self.usage,
            rotations_abandoned=self.rotations_abandoned,
        )


def _time(carried: str | None) -> datetime | None:
    return datetime.fromisoformat(carried) if carried else None
