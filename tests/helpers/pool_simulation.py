"""A pool run on plans alone (workflows/pool_plan.py), over simulated hours.

Members answer the pool's commands the way ProxyLifecycle does: a start is
Ready at once, a rotation's new instance after `rotation_takes`. A property
that takes a server hours to show (members never rotate together, how many
rotations an hour the pool keeps up with) is computed in seconds, for
tests/workflows/test_pool_plan.py and `bench.pool`.
"""

from __future__ import annotations

import dataclasses
import heapq
from datetime import UTC, datetime, timedelta

from contract import ProxyState
from workflows.membership import MemberReport
from workflows.pool_input import PoolInput
from workflows.pool_plan import Member, Situation, next_wake, plan

POOL = "pool-a"
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def report(member: Member, state: str, generation: int, at: datetime) -> MemberReport:
    ready_since = at.isoformat() if state == ProxyState.READY else None
    return MemberReport(
        member.member, state, "127.0.0.1:5000", "local", generation, ready_since, at.isoformat(), 0
    )


def serves(member: Member, ready: MemberReport) -> None:
    """The member's Ready report taken, and its endpoint confirmed, as the workflow would."""
    member.take(ready)
    member.verified = ready.endpoint


def simulate(
    inp: PoolInput,
    *,
    until: datetime,
    rotation_takes: timedelta,
    never_ready: frozenset[str] = frozenset(),
) -> list[tuple[str, datetime, datetime]]:
    """Run a pool on plans alone; members start at once and rotate in `rotation_takes`,
    except those in `never_ready`, whose new instance never serves.

    Returns each rotation as (member, rotate sent, new generation Ready).
    """
    now = T0
    books = Situation(replicas=inp.replicas, members=(), last_reconcile=T0)
    members: dict[str, Member] = {}
    pending: list[tuple[datetime, str]] = []  # (when, member) a rotation completes
    sent: dict[str, datetime] = {}
    spans = []
    while now < until:
        step = plan(books, inp, POOL, now)
        members = {m.member: m for m in step.members}
        for start in step.starts:
            serves(start.member, report(start.member, ProxyState.READY, 0, now))
        for rotation in step.rotations:
            sent[rotation.member] = now
            if rotation.member not in never_ready:
                heapq.heappush(pending, (now + rotation_takes, rotation.member))
        books = dataclasses.replace(
            books,
            members=tuple(members.values()),
            next_index=step.next_index,
            last_reconcile=now if step.reconcile else books.last_reconcile,
        )
        wake = next_wake(books, inp)
        candidates = [until] + ([wake.at] if wake else []) + ([pending[0][0]] if pending else [])
        if step.more:
            candidates.append(now)
        # As the workflow's timer: never less than a second ahead.
        now = max(min(candidates), now + timedelta(seconds=1))
        while pending and pending[0][0] <= now:
            _, done = heapq.heappop(pending)
            member = members[done]
            serves(member, report(member, ProxyState.READY, member.generation + 1, now))
            spans.append((done, sent.pop(done), now))
        # A member starting (its ready report) so the paced pool starts the next.
        books = dataclasses.replace(books, members=tuple(members.values()))
    return spans


def rotations_in(spans: list[tuple[str, datetime, datetime]], start: datetime) -> int:
    """Rotations that ended in the hour from `start`."""
    return len([end for _, _, end in spans if start <= end < start + timedelta(hours=1)])
