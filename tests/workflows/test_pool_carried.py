"""The pool's continue-as-new payload (workflows/pool_carried.py): bounded, and every shape decodes.

A pool at its maximum size with every string at its cap must continue as
new under Temporal's 512 KiB payload warning (and far under the 2 MiB
limit, past which the pool would fail and orphan GC delete its fleet), and
a state carried by an earlier release must still decode. No server: the
payload is what the SDK's default converter makes of the argument.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from temporalio.converter import default

from contract import ProxyState
from tests.helpers.worst_pool import (
    LIFETIMES,
    LIMIT_SIZE,
    POOL,
    T0,
    WARNING_SIZE,
    payload_size,
    worst_state,
)
from workflows.pool_autoscale import Books, Demand, Usage
from workflows.pool_carried import (
    TEXT_BUDGET,
    AppliedUpdate,
    PoolCarried,
    decode,
    encode,
    json_length,
    within_budget,
)
from workflows.pool_plan import Member


def round_trip(value: Any) -> Any:
    """What the next run's untyped argument is."""
    converter = default().payload_converter
    return converter.from_payloads(converter.to_payloads([value]))[0]


def test_the_largest_pool_with_every_string_at_its_cap_continues_under_the_warning_size() -> None:
    state = worst_state()
    before = payload_size(state)  # the dataclass itself, uncompacted
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


def test_a_state_in_any_other_shape_is_refused() -> None:
    """Only `encode`'s schema is read: the floor release wrote nothing else."""
    for other in (round_trip(typical_state()), None, [], {"v": 1}):
        with pytest.raises(ValueError, match="not the carried state of schema 2"):
            decode(other, POOL)


def test_texts_over_the_budget_are_cut_to_a_common_length_and_short_ones_kept() -> None:
    texts = ["short", "x" * 1000, "é" * 1000, "y" * 100]
    kept = within_budget(texts, 900)
    assert kept[0] == "short" and kept[3] == "y" * 100
    assert sum(json_length(t) for t in kept) <= 900
    assert kept[1].startswith("xxx") and kept[2].startswith("é")
    assert within_budget(texts[:1], TEXT_BUDGET) == texts[:1]
