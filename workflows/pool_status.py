"""What the `status` query of a ProxyPool answers, a page of members at a time.

A query's answer is one payload. Every member of a 1,000-member pool with
every text at its cap (an error, a ban, a rotation's reason, each up to 500
characters that take 12 bytes apiece as JSON) made an 18 MiB answer, over
what the server carries. So `status` lists at most `StatusRequest.limit`
members (`pool_input.DEFAULT_PAGE` unless asked; a pool no larger answers whole, as
before), the page's texts together take at most `PAGE_TEXT_BUDGET` bytes
(the longest cut to a common length, as the continue-as-new payload's are),
and `next_page` is the argument that asks for the rest. Any page of the
worst case stays under 1 MiB (tests/workflows/test_pool_status.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from contract import PoolState
from workflows import pool_autoscale, pool_plan
from workflows.pool_carried import within_budget
from workflows.pool_input import PoolInput, StatusRequest
from workflows.pool_plan import BanStanding, Member, MemberPhase, Situation, rotate_at
from workflows.pool_record import PoolRecord

# Bytes (as JSON) a page's member texts may take together.
PAGE_TEXT_BUDGET = 256 * 1024


@dataclass
class MemberStatus:
    """One member in the `status` query."""

    member: str
    state: str
    # The endpoint its provider confirmed ("" until then): what clients get.
    endpoint: str
    provider: str
    placement: dict[str, str]
    generation: int
    started_at: str
    ready_since: str | None
    rotate_at: str | None
    rotating: bool
    banned: str | None
    removing: str | None
    last_rotation: str | None
    last_error: str | None
    # A reported endpoint its provider has not confirmed (yet): checking, or refused.
    unconfirmed_endpoint: str | None = None
    # Where its traffic leaves from, once its endpoint is confirmed (None: unknown).
    exit_address: str | None = None


@dataclass
class PoolStatus:
    """What the `status` query returns, as of the pool's last workflow task (`as_of`).

    A query cannot read the time it is asked at: `workflow.now()` in a query
    handler is the time of the last workflow task, which in a calm pool is
    up to an hour old. So `status` gives timestamps (`ready_since`), and the
    reader computes ages from its own clock (docs/operations.md).
    """

    state: PoolState
    as_of: str
    replicas: int
    ready: int
    # A page of the members, in member order (`StatusRequest`).
    members: list[MemberStatus]
    waiting_for: str | None
    failures_in_a_row: int
    last_error: str | None
    stopped_replacing: str | None
    terminate_reason: str | None
    # `member_changed` reports refused: malformed, stamped in the future, or
    # naming an endpoint the member's provider does not confirm.
    rejected_reports: int = 0
    last_rejected: str | None = None
    # Fixed or autoscaled, why this size, demand, member-hours.
    scaling: pool_autoscale.ScalingStatus | None = None
    # Different exit addresses among the serving members (unknown ones not counted).
    distinct_exits: int = 0
    # Why the last exit check through the echo service gave no address.
    last_exit_problem: str | None = None
    # Rotations whose new instance was not Ready within `rotation_deadline_seconds`.
    rotations_abandoned: int = 0
    # Members the pool's own monitor probes now (workflows/pool_monitor.py).
    monitored: int = 0
    # All the members the pool has; `members` lists a page of them.
    members_total: int = 0
    # The `status` argument that asks for the next page; None after the last.
    next_page: dict[str, int] | None = None
    # The ban rate limit (`bans` in the input) and how much of it is used, as of `as_of`.
    bans: BanStanding | None = None


def member_status(m: Member) -> MemberStatus:
    rotate = rotate_at(m)
    return MemberStatus(
        member=m.member,
        state=m.state,
        endpoint=m.verified,
        provider=m.provider,
        placement=m.placement,
        generation=m.generation,
        started_at=m.started_at,
        ready_since=m.ready_since,
        rotate_at=rotate.isoformat(timespec="seconds") if rotate else None,
        rotating=m.phase is MemberPhase.ROTATING,
        banned=m.banned,
        removing=m.reason if m.phase is MemberPhase.REMOVING else None,
        last_rotation=m.last_rotation,
        last_error=m.last_error,
        unconfirmed_endpoint=m.endpoint if m.endpoint != m.verified else None,
        exit_address=m.exit_address or None,
    )


# The texts of a member's entry, each cut to fit the page's budget.
_TEXTS = ("banned", "removing", "last_rotation", "last_error")


def member_page(
    members: Sequence[Member], request: StatusRequest
) -> tuple[list[MemberStatus], dict[str, int] | None]:
    """The members (in index order) after `request.after`, `request.limit` at most, and
    the request for the next page (None when this is the last)."""
    after = [m for m in members if m.index > request.after]
    page = [member_status(m) for m in after[: request.limit]]
    slots = [(entry, name) for entry in page for name in _TEXTS if getattr(entry, name)]
    cut = within_budget([getattr(entry, name) for entry, name in slots], PAGE_TEXT_BUDGET)
    for (entry, name), text in zip(slots, cut, strict=True):
        setattr(entry, name, text)
    if len(after) <= request.limit:
        return page, None
    return page, {"after": after[request.limit - 1].index, "limit": request.limit}


def answer(
    record: PoolRecord,
    situation: Situation,
    inp: PoolInput | None,
    page: StatusRequest,
    *,
    scaling_why: str | None,
    last_exit_problem: str | None,
    monitored: int,
    now: datetime,
) -> PoolStatus:
    """The `status` answer: the pool as `record` and `situation` have it, and `page`."""
    counted = pool_plan.census(situation.members)
    members, next_page = member_page(situation.members, page)
    return PoolStatus(
        state=pool_plan.pool_state(situation, counted),
        as_of=now.isoformat(timespec="seconds"),
        replicas=record.replicas,
        ready=counted.serving,
        members=members,
        waiting_for=pool_plan.waiting_for(situation, counted),
        failures_in_a_row=record.failures_in_a_row,
        last_error=record.last_error,
        stopped_replacing=record.stopped,
        terminate_reason=record.terminate_reason,
        rejected_reports=record.rejected_reports,
        last_rejected=record.last_rejected,
        scaling=pool_autoscale.scaling_status(
            record.autoscale,
            inp.autoscale if inp else None,
            record.replicas,
            scaling_why,
            record.usage,
            now,
        ),
        distinct_exits=pool_plan.distinct_exits(situation.members),
        last_exit_problem=last_exit_problem,
        rotations_abandoned=record.rotations_abandoned,
        monitored=monitored,
        members_total=len(situation.members),
        next_page=next_page,
        bans=pool_plan.ban_standing(record.bans, inp.bans, record.replicas, now) if inp else None,
    )
