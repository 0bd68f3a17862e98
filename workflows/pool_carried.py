"""What a ProxyPool hands its next run on continue-as-new, and its compact encoding.

A pool of 1,000 members continues as new with every member's summary in one
payload, which Temporal warns about over 512 KiB and refuses over 2 MiB
(then the pool fails, its members lose their owner, and orphan GC deletes
the fleet). As dataclasses, one dict per member with long keys, that was
660 KiB with no errors and over 2 MiB with long ones. So `encode` writes
schema `SCHEMA`, the only one `decode` reads:

- each member is a row (a JSON array, `_ROW` gives the order), not a dict;
- every text (errors, reasons, bans, vacancies) is stored once in `texts`
  and rows name it by position; endpoints and odd member ids likewise in
  `names`;
- what is derived is not stored: a member's id is `<pool id>/<index>`, its
  lifetime the jitter formula of its index, its provider and placement one
  of a few `places`; timestamps are microseconds since the epoch;
- the texts together get at most `TEXT_BUDGET` bytes: when they would take
  more, the longest are cut to a common length, so the payload stays bounded
  whatever members report (tests/helpers/worst_pool.py builds the worst case).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio.converter import value_to_type

from workflows.pool_autoscale import Books, Usage
from workflows.pool_plan import Member, MemberPhase, jittered_lifetime

SCHEMA = 2
# Bytes (as JSON) all carried texts may take together: with the rows of
# 1,000 members at their largest, the payload stays under Temporal's 512 KiB
# warning.
TEXT_BUDGET = 64 * 1024
# A text is never cut below this, however many there are.
MIN_TEXT = 16
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# A remembered update result's member id `<pool id>/<n>` is kept as `/<n>`;
# a string that started with `/` already gets a second one.
RELATIVE = "/"
CUT = "…"


@dataclass(frozen=True)
class AppliedUpdate:
    """An update a run applied: a digest of its id, and the result it returned."""

    key: str
    result: dict[str, Any]


@dataclass
class PoolCarried:
    """Everything continue-as-new hands to the next run (as the pool holds it)."""

    replicas: int
    members: list[Member]
    next_index: int
    failures_in_a_row: int = 0
    last_error: str | None = None
    stopped_replacing: str | None = None
    start_after: str | None = None
    bans: list[str] = field(default_factory=list)
    last_reconcile: str | None = None
    terminate_reason: str | None = None
    rejected_reports: int = 0
    last_rejected: str | None = None
    vacancies: list[str] = field(default_factory=list)
    # Oldest first, REMEMBERED_UPDATES at most (a list: JSON objects' keys
    # come back sorted, not in the order they were added).
    applied_updates: list[AppliedUpdate] = field(default_factory=list)
    # An autoscaled pool's books (bounded: MAX_GATEWAYS reports), and its cost so far.
    autoscale: Books | None = None
    usage: Usage = field(default_factory=Usage)
    rotations_abandoned: int = 0


@dataclass(frozen=True)
class Lifetimes:
    """How member lifetimes derive from their index: the template's maximum and jitter."""

    max_lifetime_seconds: float
    jitter: float

    def of(self, index: int) -> float:
        return jittered_lifetime(self.max_lifetime_seconds, self.jitter, index)


@dataclass
class CompactCarried:
    """`PoolCarried` as schema `SCHEMA` writes it: rows, tables, and numbers for times.

    Text fields hold a position in `texts` (None: no text); times are
    microseconds since the epoch.
    """

    v: int
    replicas: int
    next_index: int
    texts: list[str]
    names: list[str]
    # [provider, placement, spread entry or None]
    places: list[list[Any]]
    lifetimes: Lifetimes | None
    members: list[list[Any]]
    failures_in_a_row: int = 0
    last_error: int | None = None
    stopped_replacing: int | None = None
    start_after: int | None = None
    bans: list[int] = field(default_factory=list)
    last_reconcile: int | None = None
    terminate_reason: int | None = None
    rejected_reports: int = 0
    last_rejected: int | None = None
    vacancies: list[int] = field(default_factory=list)
    # [key, result with member ids relative to the pool]
    applied_updates: list[list[Any]] = field(default_factory=list)
    autoscale: Books | None = None
    usage: Usage = field(default_factory=Usage)
    rotations_abandoned: int = 0


# A member row's columns, in order. Text columns name a position in
# `texts`, name columns one in `names`; `member` and `lifetime` are None
# when derived (the usual case).
_ROW = (
    "index",
    "place",
    "state",
    "generation",
    "started_at",
    "ready_since",
    "report_at",
    "report_seq",
    "phase",
    "reason",
    "rotating_from",
    "banned",
    "served",
    "last_rotation",
    "last_error",
    "endpoint",
    "verified",
    "member",
    "lifetime",
    "exit_address",
    "rotation_started",
    "retry_at",
)
_PHASES = {
    MemberPhase.ACTIVE: "a",
    MemberPhase.QUEUED: "q",
    MemberPhase.ROTATING: "r",
    MemberPhase.REMOVING: "x",
}
_PHASE_OF = {code: phase for phase, code in _PHASES.items()}


def encode(carried: PoolCarried, pool_id: str, lifetimes: Lifetimes | None) -> CompactCarried:
    """`carried` in schema `SCHEMA`, its texts within `TEXT_BUDGET` together."""
    texts = _Table()
    names = _Table()
    places = _Table()

    def text(value: str | None) -> int | None:
        return None if value is None else texts.ref(value)

    rows = []
    for m in carried.members:
        derived_id = m.member == f"{pool_id}/{m.index}"
        place = json.dumps([m.provider, m.placement, m.spread], sort_keys=True)
        rows.append(
            [
                m.index,
                places.ref(place),
                m.state,
                m.generation,
                _micros(m.started_at),
                _micros(m.ready_since),
                _micros(m.report_at),
                m.report_seq,
                _PHASES[m.phase],
                text(m.reason),
                m.rotating_from,
                text(m.banned),
                1 if m.served else 0,
                text(m.last_rotation),
                text(m.last_error),
                names.ref(m.endpoint),
                names.ref(m.verified),
                None if derived_id else names.ref(m.member),
                _lifetime_column(m, lifetimes),
                names.ref(m.exit_address),
                _micros(m.rotation_started),
                _micros(m.retry_at),
            ]
        )
    prefix = f"{pool_id}/"
    # Every text is named before the table is cut to the budget.
    books = {
        "last_error": text(carried.last_error),
        "stopped_replacing": text(carried.stopped_replacing),
        "terminate_reason": text(carried.terminate_reason),
        "last_rejected": text(carried.last_rejected),
    }
    vacancies = [texts.ref(v) for v in carried.vacancies]
    return CompactCarried(
        v=SCHEMA,
        replicas=carried.replicas,
        next_index=carried.next_index,
        texts=within_budget(texts.values, TEXT_BUDGET),
        names=names.values,
        places=[json.loads(p) for p in places.values],
        lifetimes=lifetimes,
        members=rows,
        failures_in_a_row=carried.failures_in_a_row,
        start_after=_micros(carried.start_after),
        bans=[t for t in (_micros(b) for b in carried.bans) if t is not None],
        last_reconcile=_micros(carried.last_reconcile),
        rejected_reports=carried.rejected_reports,
        rotations_abandoned=carried.rotations_abandoned,
        vacancies=vacancies,
        applied_updates=[
            [a.key, _map_strings(a.result, lambda s: _relative(s, prefix))]
            for a in carried.applied_updates
        ],
        autoscale=carried.autoscale,
        usage=carried.usage,
        **books,
    )


def decode(raw: Any, pool_id: str) -> PoolCarried:
    """The carried state of a previous run, as `encode` wrote it; raises on anything else."""
    if not (isinstance(raw, dict) and raw.get("v") == SCHEMA):
        raise ValueError(f"not the carried state of schema {SCHEMA}")
    compact: CompactCarried = value_to_type(CompactCarried, raw)
    texts, names = compact.texts, compact.names

    def text(ref: int | None) -> str | None:
        return None if ref is None else texts[ref]

    members = []
    for row in compact.members:
        if len(row) != len(_ROW):
            raise ValueError(f"a member row has {len(row)} columns, not {len(_ROW)}")
        c = dict(zip(_ROW, row, strict=True))
        index = int(c["index"])
        provider, placement, spread = compact.places[c["place"]]
        lifetime = c["lifetime"]
        if lifetime is None:
            if compact.lifetimes is None:
                raise ValueError("a member's lifetime is derived, but no rule is carried")
            lifetime = compact.lifetimes.of(index)
        members.append(
            Member(
                member=f"{pool_id}/{index}" if c["member"] is None else names[c["member"]],
                index=index,
                provider=str(provider),
                placement={str(k): str(v) for k, v in dict(placement).items()},
                started_at=_iso(c["started_at"]) or "",
                spread=None if spread is None else int(spread),
                lifetime_seconds=float(lifetime) or None,
                state=str(c["state"]),
                endpoint=names[c["endpoint"]],
                verified=names[c["verified"]],
                generation=int(c["generation"]),
                ready_since=_iso(c["ready_since"]),
                last_error=text(c["last_error"]),
                report_at=_iso(c["report_at"]),
                report_seq=int(c["report_seq"]),
                phase=_PHASE_OF[c["phase"]],
                reason=text(c["reason"]),
                rotating_from=None if c["rotating_from"] is None else int(c["rotating_from"]),
                banned=text(c["banned"]),
                served=bool(c["served"]),
                last_rotation=text(c["last_rotation"]),
                exit_address=names[c["exit_address"]],
                rotation_started=_iso(c["rotation_started"]),
                retry_at=_iso(c["retry_at"]),
            )
        )
    prefix = f"{pool_id}/"
    return PoolCarried(
        replicas=compact.replicas,
        members=members,
        next_index=compact.next_index,
        failures_in_a_row=compact.failures_in_a_row,
        last_error=text(compact.last_error),
        stopped_replacing=text(compact.stopped_replacing),
        start_after=_iso(compact.start_after),
        bans=[b for b in (_iso(t) for t in compact.bans) if b is not None],
        last_reconcile=_iso(compact.last_reconcile),
        terminate_reason=text(compact.terminate_reason),
        rejected_reports=compact.rejected_reports,
        rotations_abandoned=compact.rotations_abandoned,
        last_rejected=text(compact.last_rejected),
        vacancies=[texts[v] for v in compact.vacancies],
        applied_updates=[
            AppliedUpdate(str(key), _map_strings(dict(result), lambda s: _absolute(s, prefix)))
            for key, result in compact.applied_updates
        ],
        autoscale=compact.autoscale,
        usage=compact.usage,
    )


def within_budget(texts: list[str], budget: int) -> list[str]:
    """`texts`, the longest cut to one common length so that together they take at most `budget`.

    Length is what a text takes as JSON (non-ASCII characters take 6 or 12
    bytes there), so the bound holds for any text. Water-filling: short
    texts are kept whole, and only what would not fit is cut.
    """
    costs = [json_length(t) for t in texts]
    if sum(costs) <= budget:
        return texts
    ordered = sorted(costs)
    spent, cap = 0, MIN_TEXT
    for n, cost in enumerate(ordered):
        share = (budget - spent) // (len(ordered) - n)
        if cost > share:
            cap = max(MIN_TEXT, share)
            break
        spent += cost
    return [t if c <= cap else clip(t, cap) for t, c in zip(texts, costs, strict=True)]


def clip(text: str, limit: int) -> str:
    """The longest start of `text` that takes at most `limit` bytes as JSON, marked as cut."""
    room = limit - json_length(CUT)
    fits = bisect.bisect_right(range(len(text) + 1), room, key=lambda n: json_length(text[:n]))
    return text[: max(0, fits - 1)] + CUT


def json_length(text: str) -> int:
    """Bytes `text` takes inside a JSON string (Temporal's converter escapes non-ASCII)."""
    return len(json.dumps(text)) - 2


class _Table:
    """Distinct values in first-seen order, each named by its position."""

    def __init__(self) -> None:
        self.values: list[str] = []
        self._refs: dict[str, int] = {}

    def ref(self, value: str) -> int:
        ref = self._refs.get(value)
        if ref is None:
            ref = self._refs[value] = len(self.values)
            self.values.append(value)
        return ref


def _lifetime_column(member: Member, lifetimes: Lifetimes | None) -> float | None:
    """None: derived from the index (the usual case); 0: no lifetime; else the lifetime."""
    if member.lifetime_seconds is None:
        return 0
    if lifetimes is not None and member.lifetime_seconds == lifetimes.of(member.index):
        return None
    return member.lifetime_seconds


def aware_time(stamp: object) -> datetime | None:
    """An ISO 8601 time with its zone, as a pool writes its times; None for anything else."""
    if not isinstance(stamp, str):
        return None
    try:
        parsed = datetime.fromisoformat(stamp)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


def _micros(stamp: str | None) -> int | None:
    """An ISO 8601 time as microseconds since the epoch; None if absent or unreadable."""
    parsed = aware_time(stamp)
    return None if parsed is None else (parsed - EPOCH) // timedelta(microseconds=1)


def _iso(micros: int | None) -> str | None:
    if micros is None:
        return None
    return (EPOCH + timedelta(microseconds=int(micros))).isoformat()


def _map_strings(value: Any, change: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return change(value)
    if isinstance(value, list):
        return [_map_strings(v, change) for v in value]
    if isinstance(value, dict):
        return {k: _map_strings(v, change) for k, v in value.items()}
    return value


def _relative(value: str, prefix: str) -> str:
    rest = value[len(prefix) :]
    if value.startswith(prefix) and rest.isdigit():
        return RELATIVE + rest
    return RELATIVE + value if value.startswith(RELATIVE) else value


def _absolute(value: str, prefix: str) -> str:
    if value.startswith(RELATIVE + RELATIVE):
        return value[1:]
    if value.startswith(RELATIVE):
        return prefix + value[1:]
    return value
