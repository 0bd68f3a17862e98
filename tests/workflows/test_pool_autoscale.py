"""The autoscaler's rules (workflows/pool_autoscale.py), without a server.

Each test feeds gateway reports and the passing of time to the pure decision
function, the way the pool does on every step, and checks the size it asks
for: ramp up, hold, down one step at a time, zero and the wake, the bounds,
and what forged or absurd reports can and cannot do. The workflow that
applies these decisions is tested end to end in test_pool_autoscale_e2e.py.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError
from temporalio.converter import default, value_to_type

from contract import ProxyState
from workflows.inputs import parse_model
from workflows.pool import PoolCarried
from workflows.pool_autoscale import (
    MAX_GATEWAYS,
    MAX_TUNNELS,
    MIN_REPORT_INTERVAL,
    REPORT_STALE,
    Books,
    Report,
    Usage,
    counted,
    decide,
    new_books,
    next_wake,
    rebound,
    report_refusal,
    take,
    victims,
    wake,
)
from workflows.pool_input import Autoscale, PoolInput, ScaleRequest
from workflows.pool_plan import Member, MemberPhase

T0 = datetime(2026, 1, 1, tzinfo=UTC)
BOUNDS = Autoscale(
    min_replicas=0,
    max_replicas=5,
    target_tunnels_per_member=10,
    scale_up_after_seconds=30,
    scale_down_after_seconds=120,
)


def report(open_tunnels: int, gateway: str = "gw-a", new: int = 0) -> Report:
    return Report(gateway=gateway, open_tunnels=open_tunnels, new_tunnels=new)


class Pool:
    """A pool as the workflow runs one: reports taken, a decision on every step."""

    def __init__(self, bounds: Autoscale = BOUNDS, replicas: int = 0) -> None:
        self.bounds = bounds
        self.books = new_books(bounds)
        self.replicas = replicas
        self.now = T0
        self.reasons: list[str] = []

    def report(self, open_tunnels: int, gateway: str = "gw-a", new: int = 0) -> None:
        self.books = take(self.books, report(open_tunnels, gateway, new), self.now)

    def step(self, after: float = 0) -> int:
        self.now += timedelta(seconds=after)
        decision = decide(self.books, self.bounds, self.replicas, self.now)
        self.books, self.replicas = decision.books, decision.replicas
        self.reasons.append(decision.reason)
        return self.replicas

    def run(self, seconds: int, every: int = 5, open_tunnels: int | None = None) -> list[int]:
        """Steps every `every` seconds for `seconds`, the gateway reporting each time."""
        sizes = []
        for _ in range(seconds // every):
            if open_tunnels is not None:
                self.report(open_tunnels)
            sizes.append(self.step(every))
        return sizes


def test_a_ramp_scales_up_to_the_wanted_size_once_it_has_held_for_the_delay() -> None:
    pool = Pool(replicas=1)
    pool.report(35)  # wants ceil(35 / 10) = 4
    assert pool.step() == 1
    assert "scale up to 4 at" in pool.reasons[-1]
    assert pool.step(29) == 1
    assert pool.step(1) == 4  # one step, straight to the wanted size
    assert pool.reasons[-1].startswith("scale up 1 -> 4")
    assert pool.books.last_decision == pool.reasons[-1]


def test_a_dip_below_target_restarts_the_wait_to_scale_up() -> None:
    pool = Pool(replicas=1)
    pool.report(35)
    pool.step()
    pool.now += MIN_REPORT_INTERVAL
    pool.report(5)
    assert pool.step(20) == 1  # at target: the wait starts over
    pool.now += MIN_REPORT_INTERVAL
    pool.report(35)
    assert pool.step(20) == 1
    assert pool.step(29) == 1
    assert pool.step(1) == 4


def test_demand_within_target_holds_the_size() -> None:
    pool = Pool(replicas=2)
    assert pool.run(600, open_tunnels=15) == [2] * 120
    assert pool.reasons[-1].startswith("hold 2: demand 15 open tunnels")
    assert pool.books.above_since is None and pool.books.below_since is None


def test_scale_down_is_one_member_per_delay_down_to_zero() -> None:
    pool = Pool(replicas=4)
    pool.report(0)
    sizes = [pool.step(), pool.step(119), pool.step(1), pool.step(60), pool.step(60)]
    assert sizes == [4, 4, 3, 3, 2]
    assert pool.step(120) == 1
    assert pool.step(120) == 0
    assert pool.reasons[-1].startswith("scale down 1 -> 0")
    assert pool.step(600) == 0


def test_min_replicas_is_the_floor_and_max_replicas_the_ceiling() -> None:
    bounds = BOUNDS.model_copy(update={"min_replicas": 2, "max_replicas": 3})
    pool = Pool(bounds, replicas=2)
    pool.report(0)
    assert pool.run(1200) == [2] * 240
    pool.report(1000)  # wants 100
    assert pool.run(60)[-1] == 3
    assert pool.run(600)[-1] == 3


def test_new_bounds_apply_at_once() -> None:
    pool = Pool(replicas=4)
    pool.books, problem = rebound(pool.books, None, 2)
    assert problem is None
    assert pool.step() == 2
    assert "bounds are now 0..2: 4 -> 2" in pool.reasons[-1]
    pool.books, problem = rebound(pool.books, 3, None)
    assert problem == "min_replicas (3) must not exceed max_replicas (2)"
    assert pool.books.min_replicas == 0


def test_short_tunnels_keep_one_member_even_with_none_open_when_sampled() -> None:
    pool = Pool(replicas=1)
    pool.report(0, new=3)
    assert pool.run(600) == [1] * 120


def test_a_stale_report_stops_counting_and_the_pool_wakes_for_it() -> None:
    pool = Pool(replicas=1)
    pool.report(30)
    pool.step()
    due = next_wake(pool.books, pool.bounds)
    assert due == T0 + timedelta(seconds=30)  # the scale-up falling due
    pool.step(30)
    assert pool.replicas == 3
    assert next_wake(pool.books, pool.bounds) == T0 + REPORT_STALE
    pool.step(REPORT_STALE.total_seconds())  # the gateway went quiet
    assert pool.reasons[-1].startswith("hold 3: demand 0 open tunnels (0 new) over 0 gateways")


def test_wake_at_zero_starts_one_member_and_more_wakes_start_none() -> None:
    books = new_books(BOUNDS)
    first = wake(books, 0, "gw-a", T0)
    assert (first.replicas, first.changed) == (1, True)
    assert first.reason == "woken by gateway gw-a: 0 -> 1"
    # The other gateways' wakes find the pool awake: one member, not one each.
    for gateway in ("gw-b", "gw-c"):
        again = wake(first.books, first.replicas, gateway, T0)
        assert (again.replicas, again.changed) == (1, False)


def test_wake_starts_min_replicas_and_never_breaks_max_replicas_zero() -> None:
    floor = new_books(BOUNDS.model_copy(update={"min_replicas": 2}))
    assert wake(floor, 0, "gw-a", T0).replicas == 2
    closed = new_books(BOUNDS.model_copy(update={"max_replicas": 0}))
    assert wake(closed, 0, "gw-a", T0).replicas == 0


def test_a_woken_pool_with_no_demand_goes_back_to_zero_after_the_delay() -> None:
    pool = Pool()
    woken = wake(pool.books, 0, "gw-a", pool.now)
    pool.books, pool.replicas = woken.books, woken.replicas
    assert pool.step() == 1
    assert pool.step(119) == 1
    assert pool.step(1) == 0


def test_forged_reports_cannot_pass_max_replicas_nor_grow_faster_than_the_delay() -> None:
    pool = Pool(replicas=1)
    # A forger reports the most a report may say, under every name it can,
    # as often as it is let.
    for n in range(MAX_GATEWAYS):
        pool.report(MAX_TUNNELS, gateway=f"forged-{n}")
    refused = report_refusal(pool.books, report(MAX_TUNNELS, "one-too-many"), pool.now)
    assert refused == f"the pool keeps reports of {MAX_GATEWAYS} gateways at most, and has as many"
    sizes = [pool.step(), *(pool.step(1) for _ in range(29))]
    assert set(sizes) == {1}  # nothing before the delay is up
    assert pool.step(1) == BOUNDS.max_replicas  # and then no more than the bound
    assert pool.run(600)[-1] == BOUNDS.max_replicas


def test_a_gateway_reporting_too_often_is_refused_until_its_interval_is_up() -> None:
    books = take(new_books(BOUNDS), report(10), T0)
    refusal = report_refusal(books, report(50), T0 + timedelta(seconds=1))
    assert refusal is not None and "the next report is taken from" in refusal
    assert report_refusal(books, report(50), T0 + MIN_REPORT_INTERVAL) is None
    assert report_refusal(books, report(50, gateway="gw-b"), T0) is None


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"gateway": "gw", "open_tunnels": -1}, "open_tunnels: input should be greater"),
        ({"gateway": "gw", "open_tunnels": MAX_TUNNELS + 1}, "open_tunnels: input should be less"),
        ({"gateway": "gw", "open_tunnels": 1, "new_tunnels": 10**12}, "new_tunnels: input"),
        ({"gateway": "gw", "open_tunnels": 1.5}, "open_tunnels: input should be a valid integer"),
        ({"gateway": "gw", "open_tunnels": "9" * 5000}, "open_tunnels: input should be"),
        ({"gateway": "x" * 101, "open_tunnels": 1}, "gateway: string should match pattern"),
        ({"gateway": "a\nb", "open_tunnels": 1}, "gateway: string should match pattern"),
        ({"gateway": "gw", "open_tunnels": 1, "window_seconds": 0}, "window_seconds: input"),
        ({"gateway": "gw", "open_tunnels": 1, "replicas": 1000}, "replicas: unknown field"),
        ({"open_tunnels": 1}, "gateway: field required"),
    ],
)
def test_absurd_reports_are_refused_naming_the_field(body: dict[str, Any], problem: str) -> None:
    parsed, problems = parse_model(Report, body, "(the report_demand request)")
    assert parsed is None
    assert any(p.startswith(problem) for p in problems), problems


def pool_input(**fields: Any) -> dict[str, Any]:
    return {"replicas": 0, "template": {"provider": "local"}, **fields}


@pytest.mark.parametrize(
    ("autoscale", "replicas", "problem"),
    [
        ({"max_replicas": 1001}, 0, "autoscale.max_replicas: input should be less than or equal"),
        ({"min_replicas": 3, "max_replicas": 2}, 3, "autoscale: min_replicas (3) must not exceed"),
        ({"max_replicas": 2}, 3, "input: replicas (3) is the autoscaled pool's first size"),
        ({"min_replicas": 1, "max_replicas": 2}, 0, "input: replicas (0) is the autoscaled"),
        ({}, 0, "autoscale.max_replicas: field required"),
        ({"max_replicas": 2, "scale_up_after_seconds": 0}, 0, "autoscale.scale_up_after_seconds"),
        ({"max_replicas": 2, "target_tunnels_per_member": 0}, 0, "autoscale.target_tunnels_per"),
        ({"max_replicas": 2, "cooldown": 5}, 0, "autoscale.cooldown: unknown field"),
    ],
)
def test_bad_autoscale_input_names_the_field(
    autoscale: dict[str, Any], replicas: int, problem: str
) -> None:
    parsed, problems = parse_model(
        PoolInput, pool_input(replicas=replicas, autoscale=autoscale), "(a pool)"
    )
    assert parsed is None
    assert any(p.startswith(problem) for p in problems), problems


def test_an_autoscaled_pool_without_replicas_starts_at_min_replicas() -> None:
    autoscaled = {"template": {"provider": "local"}, "autoscale": {"max_replicas": 5}}
    assert PoolInput.model_validate(autoscaled).replicas == 0
    floor = autoscaled | {"autoscale": {"min_replicas": 2, "max_replicas": 5}}
    assert PoolInput.model_validate(floor).replicas == 2
    # Both: `replicas` is the first size, within the bounds.
    assert PoolInput.model_validate(floor | {"replicas": 4}).replicas == 4


@pytest.mark.parametrize(
    ("body", "problems"),
    [
        # A fixed pool's size is its own to give.
        ({"template": {"provider": "local"}}, ["replicas: field required"]),
        # A bad floor is named once, where it was given.
        (
            {
                "template": {"provider": "local"},
                "autoscale": {"min_replicas": -1, "max_replicas": 1},
            },
            ["autoscale.min_replicas: input should be greater than or equal to 0"],
        ),
    ],
)
def test_a_pool_without_replicas_is_refused_naming_the_field(
    body: dict[str, Any], problems: list[str]
) -> None:
    assert parse_model(PoolInput, body, "(a pool)") == (None, problems)


def test_scale_takes_a_size_or_bounds_never_both() -> None:
    assert ScaleRequest.model_validate({"max_replicas": 3}).max_replicas == 3
    assert ScaleRequest.model_validate({"replicas": 3}).replicas == 3
    with pytest.raises(ValidationError, match='give either "replicas"'):
        ScaleRequest.model_validate({"replicas": 1, "min_replicas": 1})


def member(index: int, *, started: int, **fields: Any) -> Member:
    ready = fields.pop("ready", True)
    return Member(
        member=f"pool/{index}",
        index=index,
        provider="local",
        placement={},
        started_at=(T0 + timedelta(minutes=started)).isoformat(),
        state=ProxyState.READY if ready else ProxyState.PROVISIONING,
        endpoint=f"127.0.0.1:{4000 + index}",
        verified=f"127.0.0.1:{4000 + index}" if ready else "",
        ready_since=(T0 + timedelta(minutes=started + 1)).isoformat() if ready else None,
        **fields,
    )


def test_scale_down_removes_the_banned_then_the_starting_then_the_youngest() -> None:
    old, young, younger = member(0, started=0), member(1, started=10), member(2, started=20)
    banned = member(3, started=5, banned="reported banned")
    starting = member(4, started=1, ready=False)
    leaving = member(5, started=30, phase=MemberPhase.REMOVING)
    members = [old, young, younger, banned, starting, leaving]
    assert [m.index for m in victims(members, 4)] == [3, 4, 2, 1]
    assert victims(members, 0) == []


def test_member_seconds_count_each_member_for_the_time_it_was_held() -> None:
    usage = counted(Usage(), 2, T0)
    usage = counted(usage, 3, T0 + timedelta(hours=1))  # two members for an hour
    usage = counted(usage, 0, T0 + timedelta(hours=2))  # then three for an hour
    usage = counted(usage, 0, T0 + timedelta(hours=9))  # then none
    assert usage.member_seconds == 5 * 3600


def test_the_books_survive_continue_as_new_unchanged() -> None:
    books = take(new_books(BOUNDS), report(12, new=4), T0)
    books = dataclasses.replace(books, above_since=T0.isoformat(), last_decision="scale up 0 -> 1")
    carried = PoolCarried(replicas=1, members=[], next_index=0, autoscale=books, usage=Usage(7.5))
    payload = default().payload_converter.to_payloads([carried])
    raw = default().payload_converter.from_payloads(payload)[0]
    back = value_to_type(PoolCarried, raw)
    assert back.autoscale == books and isinstance(back.autoscale, Books)
    assert back.usage == Usage(7.5)
