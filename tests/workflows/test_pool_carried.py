"""The pool's continue-as-new payload (workflows/pool_carried.py): bounded, and every shape decodes.

A pool at its maximum size with every string at its cap must continue as
new under Temporal's 512 KiB payload warning (and far under the 2 MiB
limit, past which the pool would fail and orphan GC delete its fleet), and
a state carried by an earlier release must still decode. No server: the
payload is what the SDK's default converter makes of the argument.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio.converter import default

from contract import ProxyState
from workflows.inputs import MAX_REASON
from workflows.membership import MAX_COUNTER, MAX_ENDPOINT_LENGTH, MAX_ERROR_LENGTH
from workflows.pool import REMEMBERED_LIST, REMEMBERED_UPDATES
from workflows.pool_autoscale import MAX_GATEWAYS, MAX_TUNNELS, Books, Demand, Usage
from workflows.pool_carried import (
    TEXT_BUDGET,
    AppliedUpdate,
    Lifetimes,
    PoolCarried,
    decode,
    encode,
    json_length,
    within_budget,
)
from workflows.pool_input import MAX_REPLICAS
from workflows.pool_plan import Member, MemberPhase

WARNING_SIZE = 512 * 1024  # Temporal's payload size warning
LIMIT_SIZE = 2 * 1024 * 1024  # the server refuses a larger payload
POOL = "p" * 200  # the longest pool id
T0 = datetime(2026, 1, 1, tzinfo=UTC)
LIFETIMES = Lifetimes(3600, 0.2)
ENDPOINT_ALPHABET = "0123456789abcdef:[]."


def payload_size(value: Any) -> int:
    [payload] = default().payload_converter.to_payloads([value])
    return len(payload.data)


def round_trip(value: Any) -> Any:
    """What the next run's untyped argument is."""
    converter = default().payload_converter
    return converter.from_payloads(converter.to_payloads([value]))[0]


def longest(n: int, length: int) -> str:
    """A text unique to `n`, of `length` characters that each take 12 bytes as JSON."""
    return (f"{n}:" + "\U0001f525" * length)[:length]


def endpoint(n: int) -> str:
    digits = "".join(ENDPOINT_ALPHABET[int(d)] for d in str(n))
    return (digits + "[" * MAX_ENDPOINT_LENGTH)[:MAX_ENDPOINT_LENGTH]


def worst_member(index: int) -> Member:
    """Member `index` with every field at its largest, every text its own."""
    ban = longest(index, MAX_REASON)
    return Member(
        member=f"{POOL}/{index}",
        index=index,
        provider="p" * 63,
        placement={"zone": "europe-west12-a", "namespace": "n" * 63},
        started_at=T0.isoformat(),
        spread=99,
        lifetime_seconds=LIFETIMES.of(index),
        state=ProxyState.PROVISIONING,
        endpoint=endpoint(index),
        verified=endpoint(index + MAX_REPLICAS),
        generation=MAX_COUNTER - 1,
        ready_since=(T0 + timedelta(microseconds=123456)).isoformat(),
        last_error=longest(index, MAX_ERROR_LENGTH),
        report_at=(T0 + timedelta(microseconds=654321)).isoformat(),
        report_seq=MAX_COUNTER - 1,
        phase=MemberPhase.ROTATING,
        reason=f"ban: {ban}",
        rotating_from=MAX_COUNTER - 1,
        banned=ban,
        served=True,
        last_rotation=f"ban: {longest(-index, MAX_REASON)} (generation 1 to 2, {T0})",
        exit_address=f"2001:db8:ffff:ffff:ffff:ffff:ffff:{index:04x}",  # an IPv6 at its longest
        rotation_started=(T0 + timedelta(microseconds=111111)).isoformat(),
        retry_at=(T0 + timedelta(microseconds=222222)).isoformat(),
    )


def worst_state() -> PoolCarried:
    members = [worst_member(n) for n in range(MAX_REPLICAS)]
    rotated = {"queued": [m.member for m in members[:REMEMBERED_LIST]]}
    return PoolCarried(
        replicas=MAX_REPLICAS,
        members=members,
        next_index=MAX_COUNTER - 1,
        failures_in_a_row=MAX_COUNTER - 1,
        last_error=longest(1, MAX_ERROR_LENGTH),
        stopped_replacing=longest(2, MAX_ERROR_LENGTH),
        start_after=T0.isoformat(),
        bans=[(T0 + timedelta(microseconds=n)).isoformat() for n in range(MAX_REPLICAS)],
        last_reconcile=T0.isoformat(),
        terminate_reason=longest(3, MAX_REASON),
        rejected_reports=MAX_COUNTER - 1,
        last_rejected=longest(4, MAX_ERROR_LENGTH),
        vacancies=[f"replaces x, ended Failed: {longest(n, 500)}" for n in range(MAX_REPLICAS)],
        applied_updates=[AppliedUpdate("k" * 32, rotated) for _ in range(REMEMBERED_UPDATES)],
        autoscale=Books(
            0,
            MAX_REPLICAS,
            reports=[
                Demand(f"{n:02d}" + "g" * 98, T0.isoformat(), MAX_TUNNELS, MAX_TUNNELS)
                for n in range(MAX_GATEWAYS)
            ],
            above_since=T0.isoformat(),
            last_decision=longest(5, MAX_ERROR_LENGTH),
            decided_at=T0.isoformat(),
        ),
        usage=Usage(1e12, T0.isoformat(), MAX_REPLICAS),
    )


def test_the_largest_pool_with_every_string_at_its_cap_continues_under_the_warning_size() -> None:
    state = worst_state()
    before = payload_size(state)  # the dataclass as releases up to 0.2.0 carried it
    compact = payload_size(encode(state, POOL, LIFETIMES))
    assert before > LIMIT_SIZE, "the worst case is a real one: it broke the old encoding"
    assert compact < WARNING_SIZE, f"{compact} bytes"


def test_the_worst_case_decodes_with_its_texts_cut_and_everything_else_whole() -> None:
    state = worst_state()
    back = decode(round_trip(encode(state, POOL, LIFETIMES)), POOL)
    assert [m.member for m in back.members] == [m.member for m in state.members]
    assert [(m.endpoint, m.verified, m.generation) for m in back.members] == [
        (m.endpoint, m.verified, m.generation) for m in state.members
    ]
    for cut, whole in zip(back.members, state.members, strict=True):
        assert cut.last_error and whole.last_error
        assert cut.last_error.endswith("…") and whole.last_error.startswith(cut.last_error[:-1])


def typical_state() -> PoolCarried:
    ready = Member(
        f"{POOL}/0", 0, "local", {}, T0.isoformat(), None, LIFETIMES.of(0),
        ProxyState.READY, "127.0.0.1:4000", "127.0.0.1:4000", 2,
        T0.isoformat(), None, T0.isoformat(), 7, served=True,
        last_rotation="max lifetime (generation 1 to 2, 2026-01-01T00:00:00Z)",
        exit_address="203.0.113.7",
    )  # fmt: skip
    queued = dataclasses.replace(ready, member=f"{POOL}/1", index=1, endpoint="[::1]:5")
    queued.queue("rotate all")
    odd = dataclasses.replace(
        ready, member="renamed-by-hand", index=2, lifetime_seconds=5.5, spread=1
    )
    odd.remove("scaled down", 15)
    starting = Member(f"{POOL}/3", 3, "gcp", {"zone": "europe-west1-b"}, T0.isoformat(), 0)
    return PoolCarried(
        replicas=3,
        members=[ready, queued, odd, starting],
        next_index=4,
        last_error="could not start x",
        bans=[T0.isoformat()],
        vacancies=["replaces pool/9, ended Failed: boom"],
        applied_updates=[
            AppliedUpdate("a", {"queued": [f"{POOL}/0", f"{POOL}/x", "/etc", "other"]}),
            AppliedUpdate("b", {"member": f"{POOL}/1", "banned": True, "already": False}),
            AppliedUpdate("c", {"replicas": 3, "previous": 2}),
        ],
        autoscale=Books(0, 5, [Demand("gw-a", T0.isoformat(), 12, 3)], T0.isoformat()),
        usage=Usage(3600.0, T0.isoformat(), 4),
    )


def test_a_typical_state_round_trips_exactly() -> None:
    state = typical_state()
    assert decode(round_trip(encode(state, POOL, LIFETIMES)), POOL) == state


def test_a_state_carried_by_an_earlier_release_still_decodes() -> None:
    state = typical_state()
    assert decode(round_trip(state), POOL) == state


def test_texts_over_the_budget_are_cut_to_a_common_length_and_short_ones_kept() -> None:
    texts = ["short", "x" * 1000, "é" * 1000, "y" * 100]
    kept = within_budget(texts, 900)
    assert kept[0] == "short" and kept[3] == "y" * 100
    assert sum(json_length(t) for t in kept) <= 900
    assert kept[1].startswith("xxx") and kept[2].startswith("é")
    assert within_budget(texts[:1], TEXT_BUDGET) == texts[:1]
