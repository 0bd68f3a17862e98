"""How big an autoscaled ProxyPool should be, as pure functions of its books and the time.

Gateways report their demand (`report_demand` update: open tunnels at the
busiest moment of a window, and tunnels opened in it); the pool keeps the
latest report of each gateway in its `Books` and, on every step, asks
`decide` for its size. The rules (docs/architecture.md, "Autoscaling"):

- the wanted size is ceil(open tunnels / target_tunnels_per_member), at
  least 1 while any tunnel was opened, clamped to [min_replicas, max_replicas];
- the pool grows to the wanted size once it has wanted more for
  `scale_up_after_seconds` without a break, and then waits as long again
  before it grows again: however reports are forged, the pool grows at
  most one step per `scale_up_after_seconds` and never past max_replicas;
- it shrinks one member per `scale_down_after_seconds` while it wants less,
  removing banned members first, then those not serving, then the youngest
  (`victims`);
- bounds changed by `scale` apply at once;
- at zero, a gateway's `wake` starts one member (max(1, min_replicas)) at
  once; a wake of a pool that has members changes nothing, so gateways
  waking together start one member, not one each.

A report is untrusted (anyone who may send an update can send one), so it is
validated (`Report`), rate-limited per gateway (`report_refusal`), bounded in
count (MAX_GATEWAYS) and forgotten when stale (REPORT_STALE): its whole
effect is a size within the bounds, reached no faster than the rates above.

Nothing here calls Temporal, so the rules are unit-tested in milliseconds
(tests/workflows/test_pool_autoscale.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Annotated

from pydantic import Field

from contract import ProxyState
from workflows.inputs import StrictInput
from workflows.pool_input import Autoscale
from workflows.pool_plan import Member, MemberPhase, is_serving

# Gateways whose reports the pool keeps; a new one past this is refused
# until one goes stale, so forged gateway names cannot grow the pool's state.
MAX_GATEWAYS = 32
# A gateway's report counts this long: a gateway that stopped reporting
# (ended, or cut off) stops holding the pool up.
REPORT_STALE = timedelta(minutes=15)
# One gateway's reports are taken this far apart at least.
MIN_REPORT_INTERVAL = timedelta(seconds=5)
# More open or new tunnels than this in one report is no gateway's: refused.
MAX_TUNNELS = 1_000_000
# The error type of a `report_demand` or `wake` sent to a fixed pool: a
# gateway stops reporting to that pool.
NOT_AUTOSCALED = "NotAutoscaled"
GATEWAY_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,99}$"


class Report(StrictInput):
    """A gateway's `report_demand` request."""

    # Which gateway: its latest report replaces its previous one.
    gateway: Annotated[str, Field(pattern=GATEWAY_NAME)]
    # The most tunnels open at once during the window.
    open_tunnels: Annotated[int, Field(ge=0, le=MAX_TUNNELS)]
    # Tunnels opened during the window.
    new_tunnels: Annotated[int, Field(ge=0, le=MAX_TUNNELS)] = 0
    window_seconds: Annotated[int, Field(ge=1, le=3600)] = 15


class WakeRequest(StrictInput):
    """A gateway's `wake` request: a client waits at a gateway with no members."""

    gateway: Annotated[str, Field(pattern=GATEWAY_NAME)]


@dataclass
class Demand:
    """One gateway's latest report, as taken (at the pool's time)."""

    gateway: str
    at: str
    open_tunnels: int
    new_tunnels: int


@dataclass
class Books:
    """What the autoscaler keeps across steps and continue-as-new."""

    # The bounds now: the input's, until a `scale` changes them.
    min_replicas: int
    max_replicas: int
    reports: list[Demand] = field(default_factory=list)
    # Since when the pool has wanted more (fewer) members without a break.
    above_since: str | None = None
    below_since: str | None = None
    last_decision: str | None = None
    decided_at: str | None = None


@dataclass(frozen=True)
class Decision:
    """The size to have now, why, and the books after."""

    replicas: int
    reason: str
    books: Books
    changed: bool


def new_books(bounds: Autoscale) -> Books:
    return Books(min_replicas=bounds.min_replicas, max_replicas=bounds.max_replicas)


def fresh(books: Books, now: datetime) -> list[Demand]:
    """The reports that still count."""
    return [r for r in books.reports if datetime.fromisoformat(r.at) > now - REPORT_STALE]


def demand(books: Books, now: datetime) -> tuple[int, int]:
    """(open tunnels, new tunnels) over every gateway's fresh report."""
    reports = fresh(books, now)
    return sum(r.open_tunnels for r in reports), sum(r.new_tunnels for r in reports)


def wanted(books: Books, target: int, now: datetime) -> int:
    """The size the demand asks for, within the bounds."""
    open_tunnels, new_tunnels = demand(books, now)
    size = math.ceil(open_tunnels / target)
    if new_tunnels and not size:
        size = 1  # short tunnels, none open when sampled: still someone to serve
    return min(max(size, books.min_replicas), books.max_replicas)


def report_refusal(books: Books, report: Report, now: datetime) -> str | None:
    """Why a gateway's report is refused now, or None."""
    reports = fresh(books, now)
    mine = [r for r in reports if r.gateway == report.gateway]
    if mine:
        next_at = datetime.fromisoformat(mine[0].at) + MIN_REPORT_INTERVAL
        if now < next_at:
            return (
                f"gateway {report.gateway!r} reported at {mine[0].at[:19]}; the next report "
                f"is taken from {next_at.isoformat(timespec='seconds')}"
            )
    elif len(reports) >= MAX_GATEWAYS:
        return f"the pool keeps reports of {MAX_GATEWAYS} gateways at most, and has as many"
    return None


def take(books: Books, report: Report, now: datetime) -> Books:
    """The books with `report` in place of its gateway's last one (stale ones dropped)."""
    kept = [r for r in fresh(books, now) if r.gateway != report.gateway]
    taken = Demand(report.gateway, now.isoformat(), report.open_tunnels, report.new_tunnels)
    return dataclasses.replace(books, reports=[*kept, taken])


def rebound(books: Books, minimum: int | None, maximum: int | None) -> tuple[Books, str | None]:
    """The books with new bounds from `scale`, or why they are refused."""
    low = books.min_replicas if minimum is None else minimum
    high = books.max_replicas if maximum is None else maximum
    if low > high:
        return books, f"min_replicas ({low}) must not exceed max_replicas ({high})"
    return dataclasses.replace(books, min_replicas=low, max_replicas=high), None


def decide(books: Books, bounds: Autoscale, current: int, now: datetime) -> Decision:
    """The size the pool should have now (`current`: the size it has been told to keep)."""
    want = wanted(books, bounds.target_tunnels_per_member, now)
    open_tunnels, new_tunnels = demand(books, now)
    said = (
        f"demand {open_tunnels} open tunnels ({new_tunnels} new) over "
        f"{len(fresh(books, now))} gateways, target {bounds.target_tunnels_per_member} per member"
    )
    stamp = now.isoformat()
    if current < books.min_replicas or current > books.max_replicas:
        size = min(max(current, books.min_replicas), books.max_replicas)
        return _changed(
            books,
            size,
            f"bounds are now {books.min_replicas}..{books.max_replicas}: {current} -> {size}",
            now,
        )
    if want > current:
        since = books.above_since or stamp
        up_at = datetime.fromisoformat(since) + timedelta(seconds=bounds.scale_up_after_seconds)
        if now >= up_at:
            reason = (
                f"scale up {current} -> {want}: {said}, above for {bounds.scale_up_after_seconds}s"
            )
            return _changed(books, want, reason, now)
        waiting = dataclasses.replace(books, above_since=since, below_since=None)
        reason = f"hold {current}: {said}; scale up to {want} at {up_at.isoformat('T', 'seconds')}"
        return Decision(current, reason, waiting, changed=False)
    if want < current:
        since = books.below_since or stamp
        down_at = datetime.fromisoformat(since) + timedelta(seconds=bounds.scale_down_after_seconds)
        if now >= down_at:
            reason = (
                f"scale down {current} -> {current - 1}: {said}, below for "
                f"{bounds.scale_down_after_seconds}s"
            )
            # One step; the next after as long again below.
            decision = _changed(books, current - 1, reason, now)
            books_after = dataclasses.replace(decision.books, below_since=stamp)
            return dataclasses.replace(decision, books=books_after)
        waiting = dataclasses.replace(books, below_since=since, above_since=None)
        reason = f"hold {current}: {said}; one fewer at {down_at.isoformat('T', 'seconds')}"
        return Decision(current, reason, waiting, changed=False)
    steady = dataclasses.replace(books, above_since=None, below_since=None)
    return Decision(current, f"hold {current}: {said}", steady, changed=False)


def _changed(books: Books, size: int, reason: str, now: datetime) -> Decision:
    after = dataclasses.replace(
        books,
        above_since=None,
        below_since=None,
        last_decision=reason,
        decided_at=now.isoformat(timespec="seconds"),
    )
    return Decision(size, reason, after, changed=True)


def wake(books: Books, current: int, gateway: str, now: datetime) -> Decision:
    """A gateway holds a client and the pool has no members: one at once; else nothing."""
    if current > 0:
        return Decision(current, f"awake already, {current} members", books, changed=False)
    size = max(1, books.min_replicas)
    if size > books.max_replicas:
        return Decision(current, "max_replicas is 0: the pool stays empty", books, changed=False)
    return _changed(books, size, f"woken by gateway {gateway}: 0 -> {size}", now)


def next_wake(books: Books, bounds: Autoscale) -> datetime | None:
    """When a pending decision falls due, or a report goes stale, with no report to wake it."""
    times = [datetime.fromisoformat(r.at) + REPORT_STALE for r in books.reports]
    if books.above_since is not None:
        times.append(
            datetime.fromisoformat(books.above_since)
            + timedelta(seconds=bounds.scale_up_after_seconds)
        )
    if books.below_since is not None:
        times.append(
            datetime.fromisoformat(books.below_since)
            + timedelta(seconds=bounds.scale_down_after_seconds)
        )
    return min(times, default=None)


def victims(members: Sequence[Member], count: int) -> list[Member]:
    """The `count` members a scale-down removes: banned, then not serving, then the youngest."""
    live = [m for m in members if m.phase is not MemberPhase.REMOVING]
    order = sorted(
        live,
        key=lambda m: (
            m.banned is None,
            is_serving(m),
            m.state == ProxyState.READY,
            # Youngest first: the latest started (a rotation's new instance
            # counts from its Ready).
            -_epoch(m.ready_since or m.started_at),
            -m.index,
        ),
    )
    return order[: max(0, count)]


def _epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


@dataclass
class Usage:
    """Member-seconds the pool has cost: each member counted from its start to its end."""

    member_seconds: float = 0.0
    counted_at: str | None = None
    # Members held when last counted: what the time since cost.
    members: int = 0


def counted(usage: Usage, members: int, now: datetime) -> Usage:
    """`usage` brought up to `now`, then holding `members`."""
    seconds = usage.member_seconds
    if usage.counted_at is not None:
        elapsed = (now - datetime.fromisoformat(usage.counted_at)).total_seconds()
        seconds += usage.members * max(0.0, elapsed)
    return Usage(seconds, now.isoformat(), members)


@dataclass
class ScalingStatus:
    """The `scaling` part of the pool's `status`: its mode, and why it has its size."""

    mode: str
    why: str
    member_hours: float
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_tunnels_per_member: int | None = None
    # Over every gateway's fresh report.
    open_tunnels: int = 0
    new_tunnels: int = 0
    gateways: int = 0
    last_decision: str | None = None
    decided_at: str | None = None


FIXED = "fixed"
AUTOSCALED = "autoscaled"


def scaling_status(
    books: Books | None,
    bounds: Autoscale | None,
    replicas: int,
    why: str | None,
    usage: Usage,
    now: datetime,
) -> ScalingStatus:
    hours = round(counted(usage, usage.members, now).member_seconds / 3600, 4)
    if books is None or bounds is None:
        return ScalingStatus(FIXED, f"fixed at {replicas} replicas (input or `scale`)", hours)
    open_tunnels, new_tunnels = demand(books, now)
    return ScalingStatus(
        AUTOSCALED,
        why or f"{replicas} replicas, the first size",
        hours,
        books.min_replicas,
        books.max_replicas,
        bounds.target_tunnels_per_member,
        open_tunnels,
        new_tunnels,
        len(fresh(books, now)),
        books.last_decision,
        books.decided_at,
    )
