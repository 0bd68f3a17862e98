"""The pool's planning (workflows/pool_plan.py), without a server: scale, surge, bans, failures.

Each test builds the members a pool knows and asks what it does next; one
runs a pool over simulated hours, members answering the pool's commands the
way ProxyLifecycle does, so a property that takes a server minutes to show
(members never rotate together) is checked in milliseconds. The workflow that
applies these plans is tested end to end in test_pool.py, test_pool_timers.py,
test_pool_lifetimes.py, test_drain.py and test_gateway.py.
"""

from __future__ import annotations

import dataclasses
import itertools
from datetime import datetime, timedelta
from typing import Any

import pytest

from contract import PoolState, ProxyState
from tests.helpers.pool_simulation import POOL, T0, report, rotations_in, serves, simulate
from workflows.inputs import parse_model
from workflows.pool_input import PoolInput
from workflows.pool_plan import (
    COMMAND_BATCH,
    RECONCILE_BUSY,
    RECONCILE_EVERY,
    RECONCILE_IDLE,
    START_BATCH,
    BanStanding,
    Member,
    MemberPhase,
    Situation,
    Step,
    Wake,
    after_failure,
    ban_refusal,
    ban_standing,
    census,
    distinct_exits,
    is_serving,
    jittered_lifetime,
    next_wake,
    plan,
    pool_state,
    recent_bans,
    rotate_at,
    settled,
    waiting_for,
)
from workflows.pool_view import last_change


def pool_input(**fields: Any) -> PoolInput:
    template = {"provider": "local", **fields.pop("template", {})}
    return PoolInput.model_validate({"replicas": 3, "template": template, **fields})


def ready(index: int, *, since: datetime = T0, generation: int = 0, **fields: Any) -> Member:
    """Member `index`, Ready since `since`, its endpoint confirmed by its provider."""
    endpoint = f"127.0.0.1:{4000 + index}"
    fields.setdefault("verified", endpoint)
    return Member(
        member=f"{POOL}/{index}",
        index=index,
        provider="local",
        placement={},
        started_at=since.isoformat(),
        state=ProxyState.READY,
        endpoint=endpoint,
        generation=generation,
        ready_since=since.isoformat(),
        served=True,
        **fields,
    )


def starting(index: int) -> Member:
    return Member(f"{POOL}/{index}", index, "local", {}, T0.isoformat())


def situation(*members: Member, replicas: int | None = None, **books: Any) -> Situation:
    count = len([m for m in members if m.phase is not MemberPhase.REMOVING])
    return Situation(
        replicas=count if replicas is None else replicas,
        members=members,
        next_index=max((m.index + 1 for m in members), default=0),
        last_reconcile=books.pop("last_reconcile", T0),
        **books,
    )


def phases(step: Step) -> dict[str, MemberPhase]:
    return {m.member: m.phase for m in step.members}


# ---- scale ------------------------------------------------------------------------------


def test_an_empty_pool_starts_its_replicas_with_the_template_placed_and_unrotated() -> None:
    inp = pool_input(template={"max_lifetime_seconds": 3600, "port": 3129})

    step = plan(situation(replicas=3), inp, POOL, T0)

    assert [s.member.member for s in step.starts] == [f"{POOL}/{n}" for n in range(3)]
    assert step.next_index == 3
    body = step.starts[0].body
    assert body["provider"] == "local" and body["port"] == 3129
    # The pool rotates its members itself, and drains them before their end.
    assert "max_lifetime_seconds" not in body
    assert body["drain_seconds"] == 15
    assert [s.member.lifetime_seconds for s in step.starts] == [3600, 3600 * 0.9, 3600 * 0.95]
    assert {m.member for m in step.members} == {s.member.member for s in step.starts}


def test_each_start_says_why_replacements_first_and_a_scale_down_drops_the_vacancies() -> None:
    first = plan(situation(replicas=2), pool_input(), POOL, T0)
    assert [s.cause for s in first.starts] == ["first start, 2 replicas"] * 2

    lost = f"replaces {POOL}/0, ended Failed: crash loop"
    short = situation(ready(1), replicas=3, vacancies=(lost,))
    step = plan(short, pool_input(), POOL, T0)
    assert [s.cause for s in step.starts] == [lost, "scale up to 3 replicas"]
    assert step.vacancies == ()

    # Backing off, the vacancy waits with the start; scaled down meanwhile, nothing is owed.
    backing_off = dataclasses.replace(short, start_after=T0 + timedelta(seconds=10))
    assert plan(backing_off, pool_input(), POOL, T0).vacancies == (lost,)
    scaled_down = dataclasses.replace(short, replicas=1)
    assert plan(scaled_down, pool_input(), POOL, T0).vacancies == ()


def test_a_large_scale_up_starts_in_batches() -> None:
    assert len(plan(situation(replicas=500), pool_input(), POOL, T0).starts) == START_BATCH


def test_a_pool_brings_up_a_bounded_number_of_members_at_a_time() -> None:
    """Started but never Ready counts against the batch, not just starts in flight."""
    inp = pool_input()
    first = plan(situation(replicas=1000), inp, POOL, T0)
    assert len(first.starts) == START_BATCH
    started = situation(*first.members, replicas=1000)
    assert plan(started, inp, POOL, T0).starts == (), "none Ready yet: nothing more"
    members = [m.copy() for m in first.members]
    for member in members[:10]:
        serves(member, report(member, ProxyState.READY, 0, T0))
    ten_ready = situation(*members, replicas=1000)
    assert len(plan(ten_ready, inp, POOL, T0).starts) == 10


def test_a_pool_removes_and_rotates_in_batches_and_says_there_is_more() -> None:
    members = [ready(n) for n in range(300)]
    step = plan(situation(*members, replicas=0), pool_input(), POOL, T0)
    assert len(step.removals) == COMMAND_BATCH and step.more
    left = situation(*step.members, replicas=0)
    assert len(plan(left, pool_input(), POOL, T0).removals) == COMMAND_BATCH

    for member in members:
        member.queue("rotate all")
    rotating = plan(situation(*members), pool_input(max_surge=100), POOL, T0)
    assert len(rotating.rotations) == COMMAND_BATCH and rotating.more
    calm = plan(situation(*(ready(n) for n in range(300))), pool_input(), POOL, T0)
    assert not calm.more


def test_a_step_starts_no_more_removals_and_rotations_than_its_runs_events_have_room_for() -> None:
    """Those under way count against the headroom; with none under way one goes
    whatever the headroom, so a run that must start something always reaches its
    budget and hands over."""
    inp = pool_input(max_surge="100%")

    def queued() -> list[Member]:
        members = [ready(n) for n in range(300)]
        for member in members:
            member.queue("rotate all")
        return members

    first = plan(situation(*queued(), headroom=30), inp, POOL, T0)
    assert len(first.rotations) == 30 and not first.more, "cut by the headroom: no step of its own"
    rotating = first.members
    assert len(plan(situation(*rotating, headroom=40), inp, POOL, T0).rotations) == 10
    assert plan(situation(*rotating, headroom=20), inp, POOL, T0).rotations == ()
    assert len(plan(situation(*queued(), headroom=0), inp, POOL, T0).rotations) == 1
    roomy = plan(situation(*queued(), headroom=1_000), inp, POOL, T0)
    assert len(roomy.rotations) == COMMAND_BATCH and roomy.more

    members = [ready(n) for n in range(300)]
    down = plan(situation(*members, replicas=0, headroom=25), pool_input(), POOL, T0)
    assert len(down.removals) == 25 and not down.more
    removing = situation(*down.members, replicas=0, headroom=35)
    assert len(plan(removing, pool_input(), POOL, T0).removals) == 10, "being removed is under way"


def test_a_plan_copies_only_the_members_it_changes() -> None:
    members = tuple(ready(n) for n in range(1000))
    step = plan(situation(*members), pool_input(), POOL, T0)
    assert all(a is b for a, b in zip(step.members, members, strict=True))

    rotated = dataclasses.replace(members[7])
    rotated.queue("rotate update")
    before = dataclasses.replace(rotated)
    step = plan(situation(*members[:7], rotated, *members[8:]), pool_input(), POOL, T0)
    assert [r.member for r in step.rotations] == [rotated.member]
    assert step.members[7] is not rotated and step.members[7].phase is MemberPhase.ROTATING
    assert rotated == before, "the situation's member is left as it was"
    assert all(a is b for a, b in zip(step.members[8:], members[8:], strict=True))


def test_plan_leaves_the_situation_it_read_unchanged() -> None:
    members = (ready(0), ready(1), ready(2))
    before = [dataclasses.replace(m) for m in members]

    step = plan(situation(*members, replicas=1), pool_input(), POOL, T0)

    assert len(step.removals) == 2
    assert list(members) == before


def test_scale_down_removes_members_not_serving_first_then_the_oldest() -> None:
    hour = timedelta(hours=1)
    members = (
        ready(0, since=T0 + 2 * hour),
        ready(1, since=T0),
        starting(2),
        ready(3, since=T0 + hour, banned="403"),
        ready(4, since=T0 + 3 * hour),
    )

    step = plan(situation(*members, replicas=2), pool_input(), POOL, T0 + 4 * hour)

    # Starting and banned members are not serving; then member 1 is the oldest.
    assert [r.member for r in step.removals] == [f"{POOL}/2", f"{POOL}/3", f"{POOL}/1"]
    assert all(r.reason == "scaled down" and r.drain == 15 for r in step.removals)
    removed = [m for m in step.members if m.phase is MemberPhase.REMOVING]
    assert [m.reason for m in removed] == ["scaled down, draining 15s"] * 3
    assert not step.starts


def test_a_removed_member_is_not_counted_so_its_place_is_filled() -> None:
    gone = ready(0)
    gone.remove("scaled down")

    step = plan(situation(gone, ready(1), replicas=2), pool_input(), POOL, T0)

    assert [s.member.member for s in step.starts] == [f"{POOL}/2"]  # ids are never reused


def test_spread_fills_each_entry_by_weight() -> None:
    inp = pool_input(
        spread=[{"provider": "zone-a", "weight": 2}, {"provider": "zone-b", "weight": 1}]
    )
    step = plan(situation(replicas=6), inp, POOL, T0)

    providers = [s.member.provider for s in step.starts]
    assert (providers.count("zone-a"), providers.count("zone-b")) == (4, 2)
    assert providers[:2] == ["zone-a", "zone-b"]  # each entry gets its first member early
    assert all(s.body["provider"] == s.member.provider for s in step.starts)
    # A replacement goes where a member is missing.
    members = [m for m in step.members if m.index != 1]
    refill = plan(situation(*members, replicas=6), inp, POOL, T0)
    assert [s.member.provider for s in refill.starts] == ["zone-b"]


# ---- rotation ---------------------------------------------------------------------------


def test_members_whose_lifetime_is_up_rotate_one_surge_at_a_time_in_member_order() -> None:
    members = tuple(ready(n, lifetime_seconds=600) for n in range(4))
    inp = pool_input(max_surge=2)

    step = plan(situation(*members), inp, POOL, T0 + timedelta(minutes=10))

    assert [(r.member, r.reason) for r in step.rotations] == [
        (f"{POOL}/0", "max lifetime"),
        (f"{POOL}/1", "max lifetime"),
    ]
    assert list(phases(step).values()) == [MemberPhase.ROTATING] * 2 + [MemberPhase.QUEUED] * 2
    # The next surge slot opens when a rotation ends, not before.
    later = plan(situation(*step.members), inp, POOL, T0 + timedelta(minutes=11))
    assert not later.rotations


def test_bans_rotate_first_and_even_below_size_other_rotations_wait_for_it() -> None:
    members = (
        ready(0, lifetime_seconds=600),
        ready(1),
        ready(2),
        starting(3),
    )
    members[2].ban("403 from shop")

    step = plan(situation(*members), pool_input(max_surge=2), POOL, T0 + timedelta(minutes=10))

    # Below size (member 3 is starting): the ban goes, the lifetime waits.
    assert [(r.member, r.reason) for r in step.rotations] == [(f"{POOL}/2", "ban: 403 from shop")]
    assert phases(step)[f"{POOL}/0"] is MemberPhase.QUEUED


def test_a_queued_member_that_is_not_ready_waits_while_the_next_one_goes() -> None:
    members = (ready(0), ready(1))
    members[0].ban("403")
    members[0].state = ProxyState.REPLACING  # getting a new instance anyway
    members[1].ban("403")

    step = plan(situation(*members), pool_input(max_surge=2), POOL, T0)

    assert [r.member for r in step.rotations] == [f"{POOL}/1"]
    assert phases(step)[f"{POOL}/0"] is MemberPhase.QUEUED


def test_a_rotation_ends_when_a_later_generation_is_ready_and_lifts_the_ban() -> None:
    member = ready(0, generation=3)
    member.ban("403")
    member.start_rotation()

    assert not member.take(report(member, ProxyState.READY, 3, T0))  # the old instance
    assert member.phase is MemberPhase.ROTATING and member.banned == "403"
    member.take(report(member, ProxyState.READY, 4, T0))
    assert (member.phase, member.banned, member.rotating_from) == (MemberPhase.ACTIVE, None, None)
    assert member.last_rotation == "ban: 403 (generation 3 to 4, 2026-01-01T00:00:00Z)"


def test_a_ban_of_a_banned_member_or_of_an_instance_it_no_longer_has_changes_nothing() -> None:
    member = ready(0)
    assert not member.ban_changes_nothing(None)
    assert not member.ban_changes_nothing(member.endpoint)
    assert member.ban_changes_nothing("10.0.0.9:3128")  # its previous instance
    member.ban("403")
    assert member.ban_changes_nothing(None)


def test_a_ban_during_a_rotation_keeps_the_rotation_and_a_second_queue_is_refused() -> None:
    member = ready(0)
    assert member.queue("rotate all")
    assert not member.queue("max lifetime")
    member.start_rotation()
    member.ban("403")
    assert (member.phase, member.banned) == (MemberPhase.ROTATING, "403")


def test_only_a_members_first_ready_makes_the_failure_budget_whole() -> None:
    member = starting(0)
    assert not member.take(report(member, ProxyState.PROVISIONING, 0, T0))
    assert member.take(report(member, ProxyState.READY, 0, T0))
    assert not member.take(report(member, ProxyState.READY, 1, T0))


def test_jittered_lifetimes_spread_any_run_of_members_and_never_exceed_the_template() -> None:
    lifetimes = [jittered_lifetime(3600, 0.5, n) for n in range(16)]

    assert max(lifetimes) == 3600 and min(lifetimes) >= 1800
    # Any 8 consecutive members cover the window's eighths, one each.
    for start in range(8):
        run = lifetimes[start : start + 8]
        assert sorted(int((3600 - t) / 225) for t in run) == list(range(8))


def test_twenty_members_over_two_lifetimes_never_rotate_together() -> None:
    inp = pool_input(replicas=20, lifetime_jitter=0.5, template={"max_lifetime_seconds": 3600})

    spans = simulate(inp, until=T0 + timedelta(hours=5), rotation_takes=timedelta(seconds=40))

    assert {member for member, _, _ in spans} == {f"{POOL}/{n}" for n in range(20)}
    assert len(spans) >= 40  # every member rotated at least twice
    ordered = sorted((start, end) for _, start, end in spans)
    for (_, end), (start, _) in itertools.pairwise(ordered):
        assert end <= start, "two members rotating at once"
    # Jitter spreads the first rotations over the lifetime's window.
    firsts = sorted(min(s for m, s, _ in spans if m == member) for member, _, _ in spans)
    assert firsts[-1] - firsts[0] >= timedelta(minutes=25)


def test_a_percentage_surge_keeps_up_with_hour_lifetimes_where_one_at_a_time_cannot() -> None:
    """200 members, 1 h lifetimes, 75 s to serve a new instance (a Compute Engine boot).

    They need 200 * 75 / 3600 = 4.2 rotations under way at once on average:
    "3%" is 6 (docs/operations.md, Rotation throughput).
    """
    lifetime = {"max_lifetime_seconds": 3600}
    boot = timedelta(seconds=75)
    until = T0 + timedelta(hours=3)
    fast = pool_input(replicas=200, max_surge="3%", template=lifetime)
    spans = simulate(fast, until=until, rotation_takes=boot)
    assert rotations_in(spans, T0 + timedelta(hours=2)) >= 200, "every member an hour"

    slow = pool_input(replicas=200, max_surge=1, template=lifetime)
    one_at_a_time = simulate(slow, until=until, rotation_takes=boot)
    assert rotations_in(one_at_a_time, T0 + timedelta(hours=2)) <= 3600 / 75


def test_a_rotation_past_its_deadline_is_abandoned_and_holds_no_other() -> None:
    inp = pool_input(
        replicas=10, rotation_deadline_seconds=900, template={"max_lifetime_seconds": 3600}
    )
    stuck = f"{POOL}/0"
    spans = simulate(
        inp,
        until=T0 + timedelta(hours=3),
        rotation_takes=timedelta(seconds=75),
        never_ready=frozenset({stuck}),
    )
    others = {member for member, _, _ in spans}
    assert others == {f"{POOL}/{n}" for n in range(1, 10)}, "all others rotated, with one surge"
    assert rotations_in(spans, T0 + timedelta(hours=2)) >= 9


def test_an_abandoned_rotation_frees_its_slot_and_is_retried_a_deadline_later() -> None:
    inp = pool_input(max_surge=1, rotation_deadline_seconds=900)
    late = ready(0, lifetime_seconds=600)
    late.start_rotation(T0)
    waiting = ready(1)
    waiting.queue("rotate update")
    now = T0 + timedelta(seconds=900)
    books = situation(late, waiting, replicas=2)
    wake = next_wake(books, inp)
    assert wake == Wake(now, f"abandon the rotation of {POOL}/0 if still not Ready")

    step = plan(books, inp, POOL, now)

    assert step.abandoned == (f"{POOL}/0",)
    assert [r.member for r in step.rotations] == [f"{POOL}/1"], "the slot went to the next"
    abandoned = phases(step)[f"{POOL}/0"]
    assert abandoned is MemberPhase.ACTIVE, "not queued again at once"
    member = step.members[0]
    assert member.last_rotation is not None and member.last_rotation.startswith("abandoned")
    assert last_change(member).startswith("rotation abandoned: rotate not Ready within 900s")
    assert rotate_at(member) == now + timedelta(seconds=900)


def test_rotations_go_most_overdue_first_not_by_index() -> None:
    members = tuple(
        ready(n, since=T0 - timedelta(minutes=n), lifetime_seconds=600) for n in range(4)
    )
    step = plan(situation(*members), pool_input(max_surge=2), POOL, T0 + timedelta(hours=1))
    assert [r.member for r in step.rotations] == [f"{POOL}/3", f"{POOL}/2"]


def test_lifetime_rotations_go_on_while_no_more_than_max_unavailable_are_short() -> None:
    members = (*(ready(n, lifetime_seconds=600) for n in range(19)), starting(19))
    later = T0 + timedelta(hours=1)
    # 10% of 20: two may be short; one is.
    assert plan(situation(*members), pool_input(), POOL, later).rotations
    strict = pool_input(max_unavailable=0)
    assert not plan(situation(*members), strict, POOL, later).rotations


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_surge", 0),
        ("max_surge", "0%"),
        ("max_surge", "101%"),
        ("max_surge", "ten"),
        ("max_surge", True),
        ("max_surge", 1.5),
        ("max_unavailable", -1),
        ("max_unavailable", "%"),
        ("max_unavailable", 1001),
        ("rotation_deadline_seconds", 0),
    ],
)
def test_rotation_knobs_refuse_bad_values_naming_the_field(field: str, value: Any) -> None:
    _, problems = parse_model(
        PoolInput, {"replicas": 3, "template": {"provider": "local"}, field: value}, ""
    )
    assert problems and all(p.startswith(f"{field}: ") for p in problems), problems


def test_surge_and_unavailable_are_counts_or_shares_of_the_replicas() -> None:
    assert (pool_input(max_surge="3%").surge(1000), pool_input(max_surge="3%").surge(10)) == (30, 1)
    assert pool_input(max_surge=7).surge(1000) == 7
    assert (pool_input().unavailable(1000), pool_input().unavailable(9)) == (100, 0)


# ---- failures ---------------------------------------------------------------------------


def test_replacements_back_off_doubling_and_stop_when_the_budget_is_spent() -> None:
    backoffs = []
    failures = 0
    for _ in range(3):
        failure = after_failure(failures, 4, f"{POOL}/0", "gave up", T0)
        failures = failure.failures_in_a_row
        assert failure.stopped is None and failure.start_after is not None
        backoffs.append((failure.start_after - T0).total_seconds())
    assert backoffs == [10, 20, 40]

    spent = after_failure(failures, 4, f"{POOL}/3", None, T0)
    assert spent.start_after is None
    assert spent.stopped is not None
    assert spent.stopped.startswith("stopped replacing after 4 members in a row ended Failed")
    assert spent.last_error == f"{POOL}/3 ended Failed: no reason given"


def test_no_member_starts_during_the_backoff_or_once_stopped() -> None:
    backing_off = situation(replicas=1, start_after=T0 + timedelta(seconds=10))
    held = plan(backing_off, pool_input(), POOL, T0)
    assert not held.starts and held.start_after == backing_off.start_after

    after = plan(backing_off, pool_input(), POOL, T0 + timedelta(seconds=10))
    assert len(after.starts) == 1 and after.start_after is None

    assert not plan(situation(replicas=1, stopped="spent"), pool_input(), POOL, T0).starts


# ---- bans -------------------------------------------------------------------------------


def test_bans_are_limited_per_window_and_the_refusal_says_from_when() -> None:
    limit = pool_input(bans={"max": 2, "window_seconds": 600}).bans
    old, recent = (T0 - timedelta(minutes=11)).isoformat(), T0.isoformat()

    assert ban_refusal([old, recent], limit, 8, T0 + timedelta(minutes=1)) is None
    refusal = ban_refusal([old, recent, recent], limit, 8, T0 + timedelta(minutes=1))
    assert refusal is not None
    assert '2 bans accepted in the last 600s (limit 2: the pool\'s "bans.max")' in refusal
    assert "accepted from 2026-01-01T00:10:00+00:00" in refusal


def test_the_default_ban_limit_is_a_quarter_of_the_replicas_at_least_one() -> None:
    limit = pool_input().bans
    bans = [T0.isoformat()] * 2
    refusal = ban_refusal(bans[:1], limit, 3, T0)
    assert refusal is not None
    assert '(limit 1: a quarter of 3 replicas, at least 1; "bans" in the pool\'s input' in refusal
    assert ban_refusal(bans, limit, 12, T0) is None
    assert ban_refusal(bans * 2, limit, 12, T0) is not None


def test_the_ban_standing_says_the_limit_what_is_used_and_when_the_next_is_accepted() -> None:
    limit = pool_input(bans={"max": 2, "window_seconds": 600}).bans
    first, second = T0.isoformat(), (T0 + timedelta(minutes=3)).isoformat()
    assert ban_standing([], limit, 8, T0) == BanStanding(2, 600, 0, None)
    assert ban_standing([first], limit, 8, T0) == BanStanding(2, 600, 1, None)
    # Full: the next fits once the oldest leaves the window.
    full = ban_standing([first, second], limit, 8, T0 + timedelta(minutes=4))
    assert full == BanStanding(2, 600, 2, "2026-01-01T00:10:00+00:00")


def test_after_a_scale_down_the_next_ban_waits_until_enough_have_left_the_window() -> None:
    limit = pool_input().bans  # a quarter of the replicas
    bans = [(T0 + timedelta(minutes=m)).isoformat() for m in (0, 1, 2)]
    # Three accepted at 12 replicas (limit 3); scaled down to 4, the limit is 1.
    standing = ban_standing(bans, limit, 4, T0 + timedelta(minutes=3))
    assert standing == BanStanding(1, 600, 3, "2026-01-01T00:12:00+00:00")
    assert ban_refusal(bans, limit, 4, T0 + timedelta(minutes=11)) is not None
    assert ban_refusal(bans, limit, 4, T0 + timedelta(minutes=12, seconds=1)) is None


# ---- timers and reconcile -----------------------------------------------------------------


def test_the_pool_wakes_for_the_earliest_lifetime_and_says_so() -> None:
    members = (ready(0, lifetime_seconds=900), ready(1, lifetime_seconds=600))

    wake = next_wake(situation(*members))

    assert wake is not None
    assert (wake.at, wake.action) == (
        T0 + timedelta(minutes=10),
        f"rotate {POOL}/1, its lifetime is up",
    )


def test_a_calm_pool_reconciles_hourly_and_a_busy_one_every_thirty_seconds() -> None:
    calm = next_wake(situation(ready(0)))
    busy = next_wake(situation(starting(0)))
    backoff = next_wake(situation(replicas=1, start_after=T0 + timedelta(seconds=20)))

    assert calm is not None and (calm.at, calm.action) == (
        T0 + RECONCILE_IDLE,
        "reconcile members with visibility",
    )
    assert busy is not None and busy.at == T0 + RECONCILE_BUSY
    assert backoff is not None and backoff.action == "start a replacement, the backoff is over"
    assert next_wake(situation(ready(0), reconciling=True)) is None


@pytest.mark.parametrize(
    ("members", "elapsed", "due"),
    [
        ((ready(0),), RECONCILE_EVERY - timedelta(seconds=1), False),
        ((ready(0),), RECONCILE_EVERY, True),
        ((starting(0),), RECONCILE_BUSY, True),
    ],
)
def test_a_reconcile_is_due_sooner_while_the_pool_waits_on_members(
    members: tuple[Member, ...], elapsed: timedelta, due: bool
) -> None:
    assert plan(situation(*members), pool_input(), POOL, T0 + elapsed).reconcile is due
    assert not plan(
        situation(*members, reconciling=True), pool_input(), POOL, T0 + elapsed
    ).reconcile


def test_a_pool_is_settled_for_its_handover_only_when_no_member_is_on_its_way_to_a_report() -> None:
    serving = [ready(0), ready(1)]
    assert settled(situation(*serving))
    # Started and never Ready yet: its Ready report is coming.
    assert not settled(situation(*serving, starting(2)))
    rotating = ready(2, phase=MemberPhase.ROTATING, rotating_from=0, reason="rotate")
    assert not settled(situation(*serving, rotating))
    # Served once and failing now: its lifecycle heals it, which may take
    # hours; the pool does not wait for that (MAX_HOLD bounds the wait anyway).
    failing = dataclasses.replace(ready(2), state=ProxyState.UNHEALTHY)
    assert settled(situation(*serving, failing))
    # Being removed: it ends, it does not report.
    leaving = dataclasses.replace(starting(2), phase=MemberPhase.REMOVING, reason="scale down")
    assert settled(situation(*serving, leaving))


# ---- what status shows ----------------------------------------------------------------------


def test_pool_states_and_what_the_pool_waits_for() -> None:
    rotating = ready(1, generation=2)
    rotating.start_rotation()
    leaving = ready(2)
    leaving.remove("scaled down")
    queued = ready(3)
    queued.queue("rotate all")

    busy = situation(starting(0), rotating, leaving, queued, replicas=3)
    assert pool_state(busy) is PoolState.SCALING
    assert waiting_for(busy) == (
        f"1 members to be Ready; 1 members to end; rotation of {POOL}/1; "
        "1 members queued for rotation"
    )
    assert pool_state(situation(ready(0), ready(1))) is PoolState.READY
    assert waiting_for(situation(ready(0), ready(1))) is None
    degraded = situation(ready(0), replicas=2, failures_in_a_row=1)
    assert pool_state(degraded) is PoolState.DEGRADED
    ending = situation(ready(0), ending=True)
    assert (pool_state(ending), waiting_for(ending)) == (PoolState.TERMINATING, "1 members to end")


def test_the_census_counts_what_each_member_is_in_one_pass() -> None:
    """Every combination of phase, state, confirmed endpoint, ban and having served,
    counted as the per-member definitions (`is_serving`, the phases) count them."""
    members = []
    for n, (phase, state, verified, banned, served) in enumerate(
        itertools.product(
            MemberPhase, (ProxyState.READY, ProxyState.PROVISIONING), ("", "10.0.0.1:3128"),
            (None, "403"), (False, True),
        )
    ):  # fmt: skip
        members.append(
            dataclasses.replace(
                starting(n), phase=phase, state=state, verified=verified, banned=banned,
                served=served,
            )
        )  # fmt: skip
    counted = census(members)
    live = [m for m in members if m.phase is not MemberPhase.REMOVING]
    assert counted.members == len(members) == 64 and counted.live == len(live) == 48
    assert counted.serving == len([m for m in members if is_serving(m)]) == 6
    assert counted.not_ready == len([m for m in live if m.state != ProxyState.READY]) == 24
    assert counted.unserved == len([m for m in live if not m.served]) == 24
    assert counted.queue == tuple(m for m in live if m.phase is MemberPhase.QUEUED)
    assert len(counted.queue) == 16
    assert counted.rotating == tuple(m.member for m in live if m.phase is MemberPhase.ROTATING)
    assert len(counted.rotating) == 16
    assert not counted.all_ready
    assert census([ready(0), ready(1)]).all_ready


def test_a_step_carries_the_census_of_the_members_it_leaves() -> None:
    """The pool reads a step's census for its details and next wake instead of counting
    again: it must be the census of the step's members after every kind of change."""
    lifetime = {"template": {"max_lifetime_seconds": 600}}
    banned = ready(2, lifetime_seconds=600)
    banned.ban("403")
    late = ready(3)
    late.start_rotation(T0 - timedelta(hours=1))
    later = T0 + timedelta(hours=1)
    cases = [
        (situation(replicas=60), pool_input(replicas=60), T0),
        (situation(*(ready(n, lifetime_seconds=600) for n in range(6))),
         pool_input(max_surge=2, **lifetime), later),
        (situation(ready(0), ready(1), banned, late, replicas=6),
         pool_input(replicas=6), later),
        (situation(*(ready(n) for n in range(80)), replicas=5),
         pool_input(replicas=5), T0),
        (situation(*(ready(n, lifetime_seconds=600) for n in range(5))),
         pool_input(replicas=5, max_surge=1), later),
    ]  # fmt: skip
    for books, inp, now in cases:
        step = plan(books, inp, POOL, now)
        assert step.starts or step.removals or step.rotations or step.abandoned
        assert step.census == census(step.members)


def test_what_the_pool_waits_for_names_a_few_rotations_and_counts_the_rest() -> None:
    rotating = [ready(n) for n in range(250)]
    for member in rotating:
        member.start_rotation()
    assert waiting_for(situation(*rotating)) == (
        f"rotation of {POOL}/0, {POOL}/1, {POOL}/2 and 247 more"
    )


# ---- carried state ------------------------------------------------------------------------


# ---- verified endpoints -----------------------------------------------------------------


def test_only_an_endpoint_its_provider_confirmed_is_served() -> None:
    reported = ready(0, verified="")
    assert not is_serving(reported), "a report alone (a signal anyone may send) is not enough"
    assert is_serving(ready(0))


def test_a_member_that_is_no_longer_ready_loses_its_confirmed_endpoint() -> None:
    member = ready(0)
    member.take(report(member, ProxyState.REPLACING, 1, T0 + timedelta(minutes=1)))
    assert member.verified == ""
    member.take(report(member, ProxyState.READY, 1, T0 + timedelta(minutes=2)))
    assert not is_serving(member), "its new endpoint is not confirmed yet"


def test_a_rotated_member_keeps_serving_its_confirmed_endpoint_until_the_new_one_is() -> None:
    member = ready(0)
    old = member.verified
    member.take(report(member, ProxyState.READY, 1, T0 + timedelta(minutes=1)))
    assert member.endpoint != old
    assert is_serving(member) and member.verified == old


def test_ban_history_keeps_only_the_window_the_limit_counts() -> None:
    limit = pool_input().bans
    assert limit.window_seconds == 600
    bans = [(T0 + timedelta(minutes=n)).isoformat() for n in range(100)]  # one a minute
    kept = recent_bans(bans, limit, T0 + timedelta(minutes=99))
    assert kept == bans[90:], "the last ten minutes' ten bans"


def test_a_banned_member_stays_out_until_its_new_endpoint_is_confirmed() -> None:
    member = ready(0)
    member.ban("403 from the shop")
    member.start_rotation()
    member.take(report(member, ProxyState.READY, 1, T0 + timedelta(minutes=1)))
    assert member.banned is None
    assert not is_serving(member), "the banned endpoint came back while the new one is checked"
    assert member.ban_changes_nothing(f"127.0.0.1:{4000}"), "a repeat of the ban, seen on it"


def test_distinct_exits_replace_the_younger_members_that_share_an_exit_once_in_a_row() -> None:
    members = (
        ready(0, exit_address="203.0.113.1"),
        ready(1, exit_address="203.0.113.1"),
        ready(2, exit_address="203.0.113.2"),
        ready(3, exit_address="203.0.113.1"),
        ready(4),  # its exit unknown: nothing to compare
    )
    inp = pool_input(distinct_exits=True, max_surge=5)

    step = plan(situation(*members), inp, POOL, T0)

    shared = f"exit shared: 203.0.113.1 with {POOL}/0"
    assert [(r.member, r.reason) for r in step.rotations] == [
        (f"{POOL}/1", shared),
        (f"{POOL}/3", shared),
    ]
    assert distinct_exits(step.members) == 2
    # A member whose new instance lands on a shared exit again keeps it (a NAT
    # in front of every instance would otherwise replace for ever).
    again = ready(1, generation=1, exit_address="203.0.113.1", last_rotation=f"{shared} (...)")
    later = plan(situation(members[0], again), inp, POOL, T0)
    assert not later.rotations
    # Without distinct_exits, shared exits are only counted.
    assert not plan(situation(*members), pool_input(max_surge=5), POOL, T0).rotations
