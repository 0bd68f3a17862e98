"""What a ProxyPool does next, as pure functions of its members, its input and the time.

The workflow (workflows/pool.py) owns the Temporal side: it takes reports,
updates and timers, and turns a `Step` into commands (child starts, signals,
the reconcile activity, its one timer). Everything it decides lives here, in
functions that call no Temporal API, so a plan is unit-tested in milliseconds
(tests/workflows/test_pool_plan.py):

- `plan` is one step: queue members whose lifetime is up, start or remove
  members to reach `replicas`, start queued rotations (at most `max_surge`,
  bans first), and say whether a reconcile is due;
- `next_wake` is the earliest thing the pool must do on its own, and what;
- `after_failure` is the replacement backoff and failure budget;
- `ban_refusal` is the ban rate limit;
- `pool_state`, `waiting_for` and `is_serving` are what `status` and
  `endpoints` show.

A member's place in the pool is one `MemberPhase`, plus the facts that
outlive a phase: the ban that keeps it out of `endpoints` until its next
generation is Ready, and whether it has ever served.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from contract import PoolState, ProxyState
from workflows import policies
from workflows.membership import MemberReport
from workflows.pool_input import BanLimit, PoolInput

# How long a member leaving the pool (scaled down, or the old instance of a
# rotation) keeps serving after it left `endpoints`, unless the template sets
# `drain_seconds`: longer than a gateway takes to poll, debounce and hand the
# change to its router (docs/architecture.md, "The gateway").
DEFAULT_MEMBER_DRAIN_SECONDS = 15
# The reconcile runs when the pool is awake anyway and this long has passed,
RECONCILE_EVERY = timedelta(minutes=10)
# and on a timer of its own after this long idle, or sooner while the pool
# waits on its members (starting, rotating, ending).
RECONCILE_IDLE = timedelta(hours=1)
RECONCILE_BUSY = timedelta(seconds=30)
# Member starts in flight at once: a pool of hundreds starts in batches, so
# no one workflow task carries hundreds of commands. The pool also counts
# the members it started that have not been Ready yet: the worker that runs
# them then brings up a bounded number at a time, instead of a thousand
# first workflow tasks queueing behind each other past the server's 10 s
# task timeout (docs/benchmarks.md).
START_BATCH = 50
# Removals and rotations one step (one workflow task) starts at most; the
# rest follow a second later (`Step.more`).
COMMAND_BATCH = 50
ENDED = (ProxyState.TERMINATED, ProxyState.FAILED)
SCALED_DOWN = "scaled down"
MAX_LIFETIME = "max lifetime"
# The reason of a rotation for an exit another member uses (and how one is recognised).
SHARED_EXIT = "exit shared:"
# Rotations `waiting_for` names; the rest it counts (a pool may rotate hundreds at once).
NAMED_ROTATIONS = 3
# How `Member.last_rotation` of an abandoned rotation begins.
ABANDONED = "abandoned"
# After every time (a rotation queued with no lifetime due).
_NEVER = datetime.max.replace(tzinfo=UTC)
# A member's times as the plan reads them, parsed once: the same texts come
# back at every step, for every member, and parsing them again took most of
# `rotate_at` (pure, so a worker's pools may share it).
_parsed_time = functools.lru_cache(maxsize=16_384)(datetime.fromisoformat)


class MemberPhase(StrEnum):
    """What the pool is doing with a member; each phase leaves only by the transitions named."""

    # Kept as it is: starting, serving, or being healed by its own lifecycle.
    # -> QUEUED (lifetime up, `rotate`, a ban), -> REMOVING.
    ACTIVE = "active"
    # Waits for a surge slot to rotate; `reason` says why.
    # -> ROTATING (a slot, and the member Ready), -> REMOVING.
    QUEUED = "queued"
    # Sent `rotate`; until it reports Ready on a generation after `rotating_from`.
    # -> ACTIVE, -> REMOVING.
    ROTATING = "rotating"
    # Sent `terminate` (after its drain), `reason` says why; forgotten when it ends.
    REMOVING = "removing"


# The enum members read in per-member loops, bound once: looking one up through
# its class takes about 0.2 µs on Python 3.11, which was most of a pass over
# 1,000 members, and a pool passes over them several times a step (so in
# every replayed step too).
_ACTIVE = MemberPhase.ACTIVE
_QUEUED = MemberPhase.QUEUED
_ROTATING = MemberPhase.ROTATING
_REMOVING = MemberPhase.REMOVING
_READY = ProxyState.READY


@dataclass
class Member:
    """What the pool knows about one member; carried across continue-as-new as is."""

    member: str
    index: int
    provider: str
    placement: dict[str, str]
    started_at: str
    # Index into `spread`, None without one.
    spread: int | None = None
    lifetime_seconds: float | None = None
    state: str = ProxyState.PROVISIONING
    # As the member's last report said: untrusted (a signal anyone may send).
    endpoint: str = ""
    # The endpoint its provider confirmed the member's own instance serves
    # on: the only one `endpoints`, and so any gateway, ever sees.
    verified: str = ""
    generation: int = 0
    ready_since: str | None = None
    last_error: str | None = None
    # When the last report taken was made, and its sequence number: a report
    # is taken only if it comes after (the rest of it is in the fields above).
    report_at: str | None = None
    report_seq: int = 0
    phase: MemberPhase = _ACTIVE
    # Why it is QUEUED, ROTATING or REMOVING.
    reason: str | None = None
    # ROTATING: the generation the rotation replaces.
    rotating_from: int | None = None
    # Out of `endpoints` until its next generation is Ready, and why. A ban
    # outlasts the phase it came in (a banned member may be removed).
    banned: str | None = None
    # Became Ready at least once: the first time makes the failure budget whole.
    served: bool = False
    # The last rotation that ended: why, the generations, and when.
    last_rotation: str | None = None
    # Where its confirmed instance's traffic leaves from ("" unknown): the
    # pool's own check (activities/exit_echo.py) or the provider's word.
    exit_address: str = ""
    # ROTATING: when the `rotate` went out, for its deadline.
    rotation_started: str | None = None
    # After an abandoned rotation: its lifetime rotation waits until then.
    retry_at: str | None = None

    def take(self, report: MemberReport) -> bool:
        """Apply the member's own report; True when it is its first Ready."""
        self.report_at, self.report_seq = report.at, report.seq
        self.state = report.state
        self.endpoint = report.endpoint
        self.generation = report.generation
        self.ready_since = report.ready_since
        self.last_error = report.last_error
        if report.state != _READY:
            self.verified = self.exit_address = ""  # its instance may be gone
            return False
        first = not self.served
        self.served = True
        if self.rotating_from is not None and report.generation > self.rotating_from:
            self.last_rotation = (
                f"{self.reason or 'rotate'} (generation {self.rotating_from} to "
                f"{report.generation}, {report.at[:19]}Z)"
            )
            self.phase, self.reason, self.rotating_from = _ACTIVE, None, None
            self.rotation_started = None
            if self.banned is not None:
                # The banned instance must not come back while the new one
                # is checked: out of `endpoints` until then.
                self.verified = self.exit_address = ""
            self.banned = None
        return first

    def copy(self) -> Member:
        """A copy a plan may change (shallow: `placement` is never changed in place).

        Built without `dataclasses.replace`, which re-runs `__init__` and took
        most of a 1,000-member plan's time.
        """
        clone = object.__new__(Member)
        clone.__dict__.update(self.__dict__)
        return clone

    def queue(self, reason: str) -> bool:
        """Queue a rotation unless one is queued or under way already."""
        if self.phase is not _ACTIVE:
            return False
        self.phase, self.reason = _QUEUED, reason
        return True

    def ban_changes_nothing(self, seen_on: str | None) -> bool:
        """A ban report of one banned already, or seen on an instance it no longer has."""
        return self.banned is not None or bool(seen_on and seen_on != self.endpoint)

    def ban(self, reason: str) -> None:
        """Out of `endpoints` now; rotated first, unless a rotation is under way already."""
        self.banned = reason
        if self.phase is not _ROTATING:
            self.phase, self.reason = _QUEUED, f"ban: {reason}"

    def remove(self, reason: str, drain: int = 0) -> None:
        self.phase = _REMOVING
        self.reason = f"{reason}, draining {drain}s" if drain else reason
        self.rotating_from = None

    def start_rotation(self, now: datetime | None = None) -> None:
        """Sent `rotate`: the rotation lasts until a generation after this one is Ready.

        `now` starts its deadline.
        """
        self.phase, self.rotating_from = _ROTATING, self.generation
        self.rotation_started = now.isoformat() if now is not None else None
        self.retry_at = None

    def abandon_rotation(self, now: datetime, deadline: int) -> None:
        """Its new instance was not Ready in time: the old one keeps serving, retried later.

        The member's own lifecycle goes on with the rotation it was sent (a
        later Ready on a new generation is taken as ever); the pool stops
        counting it against `max_surge`, so one slow member holds no other.
        """
        self.last_rotation = (
            f"{ABANDONED}: {self.reason or 'rotate'} not Ready within {deadline}s "
            f"(generation {self.rotating_from}, {now.isoformat(timespec='seconds')})"
        )
        self.phase, self.reason, self.rotating_from = _ACTIVE, None, None
        self.rotation_started = None
        self.retry_at = (now + timedelta(seconds=deadline)).isoformat()


@dataclass(frozen=True)
class Situation:
    """What a plan reads: the pool's members (in member order) and its own books."""

    replicas: int
    members: tuple[Member, ...]
    next_index: int = 0
    failures_in_a_row: int = 0
    # Why the pool stopped replacing failed members, until a `scale`.
    stopped: str | None = None
    # No member starts before this (the replacement backoff).
    start_after: datetime | None = None
    last_reconcile: datetime | None = None
    reconciling: bool = False
    ending: bool = False
    # Removals and rotations the run's history still has room for before the
    # pool's event budget, those under way included (`command_batch`); None:
    # COMMAND_BATCH a step whatever the run's length (a situation read, not
    # planned for a run: `status`, the unit tests).
    headroom: int | None = None
    # Why members the pool did not remove are gone, oldest first: the causes
    # of the starts that replace them (`Start.cause`).
    vacancies: tuple[str, ...] = ()


@dataclass(frozen=True)
class Start:
    """Start child workflow `member.member` with `body`, its ProxyLifecycle input, for `cause`."""

    member: Member
    body: dict[str, Any]
    cause: str


@dataclass(frozen=True)
class Removal:
    """Signal `terminate` to `member` once gateways have had `drain` seconds to drop it."""

    member: str
    reason: str
    drain: int


@dataclass(frozen=True)
class Rotation:
    """Signal `rotate` to `member` (make before break)."""

    member: str
    reason: str


@dataclass(frozen=True)
class Step:
    """One step's outcome: the pool's members and books after it, and its commands in order."""

    members: tuple[Member, ...]
    next_index: int
    start_after: datetime | None
    # Of `members`, for the pool's details and next wake in the same step.
    census: Census
    # The vacancies no start has filled yet.
    vacancies: tuple[str, ...] = ()
    removals: tuple[Removal, ...] = ()
    starts: tuple[Start, ...] = ()
    rotations: tuple[Rotation, ...] = ()
    reconcile: bool = False
    # A batch was full: the pool takes its next step soon, on its own.
    more: bool = False
    # Members whose rotation this step abandoned (past the rotation deadline).
    abandoned: tuple[str, ...] = ()


@dataclass(frozen=True)
class Wake:
    """When the pool must wake on its own, and what it does then."""

    at: datetime
    action: str


@dataclass(frozen=True)
class Failure:
    """The pool's books after a member ended Failed."""

    failures_in_a_row: int
    last_error: str
    # Set: the budget is spent and nothing is started until a `scale`.
    stopped: str | None
    # Otherwise: the next member starts no earlier than this.
    start_after: datetime | None


class _Draft:
    """The members as a plan leaves them: the situation's own until the plan changes
    one, then a copy in its place.

    A plan changes a few members at a time, and copying all of them took a
    third of a 1,000-member plan's time (so of every pool step and replay).
    """

    def __init__(self, given: Sequence[Member]) -> None:
        self._given = tuple(given)
        self.members = list(given)
        self._at: dict[str, int] | None = None

    def own(self, member: Member) -> Member:
        """`member` as this plan may change it: a copy of the situation's, made once."""
        if self._at is None:
            self._at = {m.member: i for i, m in enumerate(self._given)}
        i = self._at.get(member.member)
        if i is None:
            return member  # one this plan made
        if self.members[i] is self._given[i]:
            self.members[i] = self._given[i].copy()
        return self.members[i]


def plan(situation: Situation, inp: PoolInput, pool_id: str, now: datetime) -> Step:
    """What the pool does now. Pure: a member it changes is a copy, the situation's never."""
    draft = _Draft(situation.members)
    abandoned = _abandon_late_rotations(draft, inp, now)
    for member in draft.members:
        if member.phase is not _ACTIVE or member.lifetime_seconds is None:
            continue
        due = rotate_at(member)
        if due is not None and due <= now:
            draft.own(member).queue(MAX_LIFETIME)
    if inp.distinct_exits:
        _queue_shared_exits(draft)
    # Taken again only after a scale-down: the starts that follow change no
    # count the rotations read (serving, queued, rotating).
    counted = census(draft.members)
    removals = _scale_down(
        draft, counted, situation.replicas, drain_seconds(inp), command_batch(situation, counted)
    )
    starts: list[Start] = []
    start_after = situation.start_after
    vacancies: tuple[str, ...] = ()  # a scale-down leaves none to fill
    if removals:
        counted = census(draft.members)
    else:
        starts, start_after, vacancies = _scale_up(draft, counted, situation, inp, pool_id, now)
    rotations = _rotate(draft, counted, situation, inp, now, command_batch(situation, counted))
    members = draft.members
    after = census(members)
    every = RECONCILE_EVERY if calm(situation, after) else RECONCILE_BUSY
    reconcile = not situation.reconciling and (
        situation.last_reconcile is None or now - situation.last_reconcile >= every
    )
    return Step(
        members=tuple(members),
        next_index=situation.next_index + len(starts),
        start_after=start_after,
        census=after,
        vacancies=vacancies,
        removals=tuple(removals),
        starts=tuple(starts),
        rotations=tuple(rotations),
        reconcile=reconcile,
        more=COMMAND_BATCH in (len(removals), len(rotations)),
        abandoned=tuple(abandoned),
    )


def command_batch(situation: Situation, counted: Census) -> int:
    """How many removals or rotations a step may start now.

    COMMAND_BATCH a step; with a `headroom`, also no more than the run's
    history holds beside those under way (rotating, being removed), each of
    which writes a few events before the pool may hand over. Without that, a
    run that starts a surge just under its budget holds until all of it has
    reported, and the worker that replays it pays for every event past the
    budget. With nothing under way, one goes whatever the headroom: it is what
    fills the budget that hands over to a run with room again.
    """
    if situation.headroom is None:
        return COMMAND_BATCH
    under_way = len(counted.rotating) + counted.members - counted.live
    least = 0 if under_way else 1
    return min(COMMAND_BATCH, max(least, situation.headroom - under_way))


def _scale_down(
    draft: _Draft, counted: Census, replicas: int, drain: int, batch: int
) -> list[Removal]:
    """Members not serving go first, then the oldest instances; `batch` at most."""
    excess = min(counted.live - replicas, batch)
    if excess <= 0:
        return []
    victims = sorted(
        _live(draft.members), key=lambda m: (is_serving(m), m.ready_since or "", m.index)
    )
    for member in victims[:excess]:
        draft.own(member).remove(SCALED_DOWN, drain)
    return [Removal(m.member, SCALED_DOWN, drain) for m in victims[:excess]]


def _scale_up(
    draft: _Draft,
    counted: Census,
    situation: Situation,
    inp: PoolInput,
    pool_id: str,
    now: datetime,
) -> tuple[list[Start], datetime | None, tuple[str, ...]]:
    """New members to reach `replicas`, unless stopped or backing off; the backoff and
    the vacancies after."""
    members = draft.members
    missing = situation.replicas - counted.live
    if missing <= 0:
        return [], situation.start_after, ()  # scaled down since: nothing to replace
    if situation.stopped is not None or (
        situation.start_after is not None and now < situation.start_after
    ):
        return [], situation.start_after, situation.vacancies
    starts = []
    # A bounded batch per workflow task: the next starts when these are Ready.
    busy = counted.unserved
    for n in range(min(missing, max(0, START_BATCH - busy))):
        member = _new_member(members, inp, pool_id, situation.next_index + n, now)
        members.append(member)
        starts.append(Start(member, member_body(inp, member), _cause(situation, n)))
    return starts, None, situation.vacancies[len(starts) :]


def _cause(situation: Situation, n: int) -> str:
    """Why the step's `n`th start: the oldest vacancy, else the pool's first start or a scale-up."""
    if n < len(situation.vacancies):
        return situation.vacancies[n]
    if situation.next_index == 0:
        return f"first start, {situation.replicas} replicas"
    return f"scale up to {situation.replicas} replicas"


def _new_member(
    members: list[Member], inp: PoolInput, pool_id: str, index: int, now: datetime
) -> Member:
    spread, provider, placement = _placement(members, inp)
    lifetime = None
    if inp.template.max_lifetime_seconds is not None:
        lifetime = jittered_lifetime(inp.template.max_lifetime_seconds, inp.lifetime_jitter, index)
    return Member(
        member=f"{pool_id}/{index}",
        index=index,
        provider=provider,
        placement=placement,
        started_at=now.isoformat(),
        spread=spread,
        lifetime_seconds=lifetime,
    )


def member_body(inp: PoolInput, member: Member) -> dict[str, Any]:
    """The ProxyLifecycle input of `member`: the template, placed, rotated by the pool."""
    body = inp.template.model_dump(mode="json", exclude_none=True)
    body["provider"] = member.provider
    body["placement"] = member.placement
    # The pool rotates its members itself (`rotate` signal), one surge at a time.
    body.pop("max_lifetime_seconds", None)
    body["drain_seconds"] = drain_seconds(inp)
    return body


def _placement(members: list[Member], inp: PoolInput) -> tuple[int | None, str, dict[str, str]]:
    """The spread entry furthest below its share of the live members."""
    spread = inp.spread
    if not spread:
        return None, inp.template.provider, inp.template.placement.as_dict()
    counts = [0] * len(spread)
    for member in _live(members):
        if member.spread is not None and member.spread < len(counts):
            counts[member.spread] += 1
    total = sum(e.weight for e in spread)
    after = sum(counts) + 1
    best = max(range(len(spread)), key=lambda i: (spread[i].weight * after / total - counts[i], -i))
    entry = spread[best]
    return best, entry.provider, entry.placement.as_dict()


def _rotate(
    draft: _Draft,
    counted: Census,
    situation: Situation,
    inp: PoolInput,
    now: datetime,
    batch: int,
) -> list[Rotation]:
    """Queued rotations to start now, bans first, up to the surge under way at once.

    `max_surge` of the replicas, the most overdue member first; lifetime
    rotations start while at most `max_unavailable` members are short of
    serving, and at most `batch` per step.
    """
    replicas = situation.replicas
    queued = list(counted.queue)
    rotating, serving = len(counted.rotating), counted.serving
    surge = inp.surge(replicas)
    queued.sort(key=lambda m: (m.banned is None, _overdue_key(m), m.index))
    # A rotation is make before break: it takes nothing out of service.
    available = serving >= replicas - inp.unavailable(replicas)
    rotations: list[Rotation] = []
    for member in queued[: max(0, surge - rotating)]:
        if member.banned is None and not available:
            break
        if member.state != _READY:
            continue  # it is getting a new instance anyway
        if len(rotations) == batch:
            break
        rotated = draft.own(member)
        rotated.start_rotation(now)
        rotations.append(Rotation(rotated.member, rotated.reason or "rotate"))
    return rotations


def _queue_shared_exits(draft: _Draft) -> None:
    """Queue a rotation of every serving member whose exit an older one uses already.

    Once in a row per member: a member whose last rotation was for a shared
    exit keeps the exit it got (all instances behind one NAT would otherwise
    be replaced for ever); `status` counts the distinct exits either way.
    """
    first_user: dict[str, Member] = {}
    for member in sorted(_live(draft.members), key=lambda m: m.index):
        if not member.exit_address or not is_serving(member):
            continue
        older = first_user.setdefault(member.exit_address, member)
        shared = older is not member and not (member.last_rotation or "").startswith(SHARED_EXIT)
        if shared and member.phase is _ACTIVE:
            draft.own(member).queue(f"{SHARED_EXIT} {member.exit_address} with {older.member}")


def distinct_exits(members: Sequence[Member]) -> int:
    """How many different exit addresses the serving members have (unknown ones not counted)."""
    return len({m.exit_address for m in _live(members) if m.exit_address and is_serving(m)})


def _overdue_key(member: Member) -> datetime:
    """The most overdue first; a member queued without a lifetime due comes after."""
    due = rotate_at(member)
    return due if due is not None else _NEVER


def _abandon_late_rotations(draft: _Draft, inp: PoolInput, now: datetime) -> list[str]:
    """Rotations whose new instance is not Ready within the deadline, abandoned."""
    deadline = inp.rotation_deadline_seconds
    late = [
        m
        for m in draft.members
        if m.phase is _ROTATING
        and m.rotation_started is not None
        and now - _parsed_time(m.rotation_started) >= timedelta(seconds=deadline)
    ]
    for member in late:
        draft.own(member).abandon_rotation(now, deadline)
    return [m.member for m in late]


def next_wake(
    situation: Situation, inp: PoolInput | None = None, counted: Census | None = None
) -> Wake | None:
    """The earliest thing the pool must do on its own: a lifetime, a rotation's deadline
    (given `inp`), a backoff's end, a reconcile; `counted`: the census of its members,
    if taken already."""
    lifetime: tuple[datetime, int, str] | None = None
    started: tuple[datetime, str] | None = None
    # One pass for both: a pool of 1,000 asks this at every step.
    for m in situation.members:
        if m.phase is _ACTIVE:
            due = rotate_at(m)
            if due is not None and (lifetime is None or (due, m.index) < lifetime[:2]):
                lifetime = (due, m.index, m.member)
        elif m.phase is _ROTATING and m.rotation_started is not None:
            at = _parsed_time(m.rotation_started)
            if started is None or (at, m.member) < started:
                started = (at, m.member)
    wakes = []
    if lifetime is not None:
        # Worded for the earliest only: a pool of 1,000 wakes for one at a time.
        due, _, member_id = lifetime
        wakes.append(Wake(due, f"rotate {member_id}, its lifetime is up"))
    if started is not None and inp is not None:
        at, member_id = started
        deadline = timedelta(seconds=inp.rotation_deadline_seconds)
        wakes.append(Wake(at + deadline, f"abandon the rotation of {member_id} if still not Ready"))
    if situation.start_after is not None and situation.stopped is None:
        wakes.append(Wake(situation.start_after, "start a replacement, the backoff is over"))
    if situation.last_reconcile is not None and not situation.reconciling:
        # (A reconcile under way wakes the pool when it ends.)
        every = RECONCILE_IDLE if calm(situation, counted) else RECONCILE_BUSY
        wakes.append(Wake(situation.last_reconcile + every, "reconcile members with visibility"))
    return min(wakes, key=lambda w: w.at, default=None)


def after_failure(
    failures_in_a_row: int, budget: int, member: str, error: str | None, now: datetime
) -> Failure:
    """A member the pool kept ended Failed: back off before its replacement, or stop."""
    failures = failures_in_a_row + 1
    last_error = f"{member} ended Failed: {error or 'no reason given'}"
    if failures >= budget:
        stopped = (
            f"stopped replacing after {failures} members in a row ended Failed "
            f"(failure_budget {budget}); last: {last_error}. A `scale` update resumes."
        )
        return Failure(failures, last_error, stopped, None)
    return Failure(failures, last_error, None, now + policies.REPLACE_BACKOFF.delay(failures - 1))


def recent_bans(bans: Sequence[str], limit: BanLimit, now: datetime) -> list[str]:
    """The bans (when each was accepted) still inside the rate limit's window.

    All the pool keeps of its ban history: older ones count for nothing, and
    kept they would grow the carried state for as long as the pool runs.
    """
    window = timedelta(seconds=limit.window_seconds)
    return [at for at in bans if datetime.fromisoformat(at) > now - window]


@dataclass(frozen=True)
class BanStanding:
    """The pool's ban rate limit and where it stands: `status.bans`, and a refusal's words."""

    # Bans accepted per window: the input's `bans.max`, else a quarter of
    # the replicas (at least 1), so it follows `scale`.
    limit: int
    window_seconds: int
    # Accepted within the window before now.
    accepted: int
    # When the next ban is accepted; None: at once.
    next_accepted_at: str | None


def ban_standing(bans: Sequence[str], limit: BanLimit, replicas: int, now: datetime) -> BanStanding:
    """Where the ban limit stands at `now` (`bans`: when each was accepted)."""
    most = limit.limit(replicas)
    recent = recent_bans(bans, limit, now)
    next_at = None
    if len(recent) >= most:
        # The oldest that must leave the window for one more to fit.
        freed = datetime.fromisoformat(recent[len(recent) - most])
        next_at = (freed + timedelta(seconds=limit.window_seconds)).isoformat(timespec="seconds")
    return BanStanding(most, limit.window_seconds, len(recent), next_at)


def ban_refusal(bans: Sequence[str], limit: BanLimit, replicas: int, now: datetime) -> str | None:
    """Why one more ban is refused now (`bans`: when each was accepted), or None."""
    standing = ban_standing(bans, limit, replicas, now)
    if standing.next_accepted_at is None:
        return None
    source = (
        'the pool\'s "bans.max"'
        if limit.max is not None
        else f'a quarter of {replicas} replicas, at least 1; "bans" in the pool\'s input sets it'
    )
    return (
        f"ban rate limit: {standing.accepted} bans accepted in the last "
        f"{standing.window_seconds}s (limit {standing.limit}: {source}); "
        f"the next is accepted from {standing.next_accepted_at}"
    )


def jittered_lifetime(max_lifetime: float, jitter: float, index: int) -> float:
    """Member `index`'s lifetime: `max_lifetime * (1 - jitter * u)`, u spread evenly.

    u is the base-2 van der Corput sequence (0, 1/2, 1/4, 3/4, 1/8, ...): any
    run of consecutive members is spread evenly over the jitter window, and
    a member's lifetime never exceeds the template's.
    """
    u, denominator, n = 0.0, 1.0, index
    while n:
        denominator *= 2
        n, bit = divmod(n, 2)
        u += bit / denominator
    return max_lifetime * (1 - jitter * u)


def drain_seconds(inp: PoolInput) -> int:
    drain = inp.template.drain_seconds
    return DEFAULT_MEMBER_DRAIN_SECONDS if drain is None else drain


def rotate_at(member: Member) -> datetime | None:
    """When the member's lifetime is up; None without one, or while it rotates."""
    if member.lifetime_seconds is None or member.ready_since is None:
        return None
    if member.phase is _ROTATING:
        return None
    due = _parsed_time(member.ready_since) + timedelta(seconds=member.lifetime_seconds)
    if member.retry_at is not None:
        due = max(due, _parsed_time(member.retry_at))
    return due


def is_serving(member: Member) -> bool:
    """In `endpoints`: Ready with a verified endpoint, not banned, not being removed."""
    return (
        member.phase is not _REMOVING
        and member.state == _READY
        and bool(member.verified)
        and not member.banned
    )


def live(situation: Situation) -> list[Member]:
    """Members the pool keeps: not being removed."""
    return _live(situation.members)


def _live(members: Sequence[Member]) -> list[Member]:
    return [m for m in members if m.phase is not _REMOVING]


def settled(situation: Situation) -> bool:
    """No member is on its way to a report the pool can wait for: none started and
    never Ready yet, none rotating.

    A continue-as-new that crosses a member's report is refused by the server
    and the run replayed, so a pool about to hand over waits for these.
    """
    return all(m.served and m.phase is not _ROTATING for m in _live(situation.members))


def calm(situation: Situation, counted: Census | None = None) -> bool:
    """Nothing the pool waits on from its members but their lifetimes; `counted`: the
    census of its members, if taken already."""
    return not situation.ending and (counted or census(situation.members)).all_ready


@dataclass(frozen=True)
class Census:
    """The counts a step reads (the plan's surge and reconcile, `pool_state`,
    `waiting_for`, the pool's details), from one pass.

    A pool of 1,000 members takes these at every step, so in every replayed
    step too: one pass over the members instead of one per count.
    """

    members: int
    # Not being removed.
    live: int
    # In `endpoints` (`is_serving`).
    serving: int
    # Live and not Ready yet.
    not_ready: int
    # The live members waiting for a surge slot (QUEUED), in member order.
    queue: tuple[Member, ...]
    # The ids of the live members rotating, in member order.
    rotating: tuple[str, ...]
    # Live and never Ready yet (starts in flight).
    unserved: int

    @property
    def all_ready(self) -> bool:
        """Every member Ready and none being removed (`calm`, but for the pool's end)."""
        return self.live == self.members and not self.not_ready


def census(members: Sequence[Member]) -> Census:
    live = serving = not_ready = unserved = 0
    queue = []
    rotating = []
    for m in members:
        phase = m.phase
        if phase is _REMOVING:
            continue
        live += 1
        if not m.served:
            unserved += 1
        if m.state != _READY:
            not_ready += 1
        elif m.verified and not m.banned:
            serving += 1
        if phase is _ROTATING:
            rotating.append(m.member)
        elif phase is _QUEUED:
            queue.append(m)
    return Census(len(members), live, serving, not_ready, tuple(queue), tuple(rotating), unserved)


def pool_state(situation: Situation, counted: Census | None = None) -> PoolState:
    """The pool's state; `counted`: the census of its members, if taken already."""
    if situation.ending:
        return PoolState.TERMINATING if situation.members else PoolState.TERMINATED
    ready = (counted or census(situation.members)).serving
    if ready < situation.replicas and (situation.failures_in_a_row or situation.stopped):
        return PoolState.DEGRADED
    if ready != situation.replicas or len(situation.members) != situation.replicas:
        return PoolState.SCALING
    return PoolState.READY


def waiting_for(situation: Situation, counted: Census | None = None) -> str | None:
    """What the pool waits for, in words, or None when it waits for nothing."""
    if situation.ending:
        return f"{len(situation.members)} members to end" if situation.members else None
    if situation.stopped:
        return situation.stopped
    if situation.start_after is not None:
        return (
            f"backing off until {situation.start_after.isoformat(timespec='seconds')} after "
            f"{situation.failures_in_a_row} failed members in a row"
        )
    counted = counted or census(situation.members)
    parts = []
    if counted.not_ready:
        parts.append(f"{counted.not_ready} members to be Ready")
    removing = counted.members - counted.live
    if removing:
        parts.append(f"{removing} members to end")
    rotating = counted.rotating
    if rotating:
        named = ", ".join(rotating[:NAMED_ROTATIONS])
        more = len(rotating) - NAMED_ROTATIONS
        parts.append(f"rotation of {named}" + (f" and {more} more" if more > 0 else ""))
    if counted.queue:
        parts.append(f"{len(counted.queue)} members queued for rotation")
    return "; ".join(parts) or None
