"""A pool monitors its members itself: one activity per shard, members run none.

Real dev server, real Squids (the local provider). A member's Squid killed
is found by the pool's monitor, which tells that member; the member probes
its instance itself and replaces it. A forged `instance_failing` about a
healthy member makes it probe, and nothing more. The shard split is pure and
tested without a server.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType, PendingActivityState
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from contract import INSTANCE_FAILING_SIGNAL, MEMBER_CHANGED_SIGNAL
from providers.errors import QuotaExceeded
from tests.helpers.histories import record_history
from tests.helpers.run_chain import signal_until_continued
from tests.helpers.stacks import Stack
from tests.helpers.waiting import wait_for
from tests.workflows.test_continue_as_new import (  # noqa: F401 (a fixture)
    SUGGESTED_AT,
    eager_can_env,
)
from workflows.pool_monitor import shards


async def running_activities(handle: WorkflowHandle[Any, Any]) -> list[str]:
    """The types of the activities a workflow has started and not yet seen end."""
    description = await handle.describe()
    return [
        pending.activity_type.name
        for pending in description.raw_description.pending_activities
        if pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
    ]


async def history_of(handle: WorkflowHandle[Any, Any]) -> list[Any]:
    return [event async for event in handle.fetch_history_events()]


async def monitored_pool(stack: Stack, replicas: int) -> tuple[WorkflowHandle[Any, Any], Any]:
    """A pool whose `replicas` members serve and are all watched by its monitor."""
    pool = await stack.start_pool(replicas)
    seen: list[Any] = []

    async def watched() -> bool:
        seen.append(await pool.query("status"))
        status = seen[-1]
        return bool(
            status["ready"] == replicas
            and status["monitored"] == replicas
            and "monitor_members" in await running_activities(pool)
        )

    await wait_for(watched, f"{replicas} members serving under the pool's monitor", deadline=180)
    return pool, seen[-1]


@pytest.mark.slow
async def test_a_member_whose_squid_dies_is_found_by_the_pools_monitor_and_replaced(
    stack: Stack,
) -> None:
    pool, status = await monitored_pool(stack, 2)
    victim, other = status["members"]
    member = stack.client.get_workflow_handle(victim["member"])
    assert "monitor" not in await running_activities(member), "a member ran its own monitor"

    before = (await member.query("status"))["instance"]
    os.kill(stack.pid_of(before), signal.SIGKILL)

    async def replaced() -> bool:
        now = await member.query("status")
        return bool(now["state"] == "Ready" and now["generation"] == 1)

    await wait_for(replaced, "the dead member replaced", deadline=120)
    events = await history_of(member)
    signals = [
        e.workflow_execution_signaled_event_attributes.signal_name
        for e in events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
    ]
    assert INSTANCE_FAILING_SIGNAL in signals, signals
    # The other member was left alone.
    untouched = await stack.client.get_workflow_handle(other["member"]).query("status")
    assert (untouched["state"], untouched["generation"]) == ("Ready", 0)
    await pool.signal("terminate")
    await pool.result()
    await record_history(pool, "pool_monitored_member_replaced")
    await record_history(member, "pool_member_replaced_on_its_pools_word")


@pytest.mark.slow
async def test_a_rotating_members_old_instance_stays_watched_by_the_pool(stack: Stack) -> None:
    """Its replacement waits for quota; the old one dies: the pool's word withdraws it."""
    pool, status = await monitored_pool(stack, 1)
    (only,) = status["members"]
    member = stack.client.get_workflow_handle(only["member"])
    old = await member.query("status")
    stack.provider.fail_until_recovered(
        "create", QuotaExceeded("Quota 'CPUS' exceeded in europe-west1", retry_after_seconds=5)
    )
    await member.signal("rotate")

    async def waiting_for_quota() -> bool:
        now = await member.query("status")
        return (now["waiting_for"] or "").startswith("waiting for quota")

    await wait_for(waiting_for_quota, "the rotation waiting for quota")
    os.kill(stack.pid_of(old["instance"]), signal.SIGKILL)

    async def withdrawn() -> bool:
        now = await member.query("status")
        return bool(now["state"] == "Replacing" and now["endpoint"] == "")

    await wait_for(withdrawn, "the dead old instance withdrawn", deadline=90)
    stack.provider.recover("create")

    async def replaced() -> bool:
        now = await member.query("status")
        return bool(now["state"] == "Ready" and now["generation"] == 1)

    await wait_for(replaced, "the replacement Ready", deadline=120)
    await pool.signal("terminate")
    await pool.result()
    assert stack.instances() == []


@pytest.mark.slow
async def test_a_forged_instance_failing_about_a_healthy_member_only_makes_it_probe(
    stack: Stack,
) -> None:
    pool, status = await monitored_pool(stack, 1)
    (only,) = status["members"]
    member = stack.client.get_workflow_handle(only["member"])
    first = await member.query("status")
    forged = {"endpoint": first["endpoint"], "reason": "forged: replace me"}
    for raw in (forged, "not a dict", {"endpoint": "10.0.0.1:1"}, {"endpoint": ["x"]}, None):
        await member.signal(INSTANCE_FAILING_SIGNAL, raw)

    async def probed() -> bool:
        events = await history_of(member)
        confirms = {
            e.event_id
            for e in events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
            and "forged: replace me" in e.user_metadata.summary.data.decode()
        }
        return any(
            e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
            and e.activity_task_completed_event_attributes.scheduled_event_id in confirms
            for e in events
        )

    await wait_for(probed, "the member's own probe of its instance", deadline=60)
    after = await member.query("status")
    assert (after["state"], after["generation"], after["replacements"]) == ("Ready", 0, 0)
    # Its pool heard of it once, when it was Ready at its endpoint: not when
    # it started (the pool started it) nor when its instance got an address
    # while Provisioning.
    reports = [
        json.loads(
            e.signal_external_workflow_execution_initiated_event_attributes.input.payloads[0].data
        )
        for e in await history_of(member)
        if e.event_type == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED
        and e.signal_external_workflow_execution_initiated_event_attributes.signal_name
        == MEMBER_CHANGED_SIGNAL
    ]
    assert [(r["state"], r["generation"]) for r in reports] == [("Ready", 0)], reports
    await pool.signal("terminate")
    await pool.result()
    await record_history(member, "pool_member_forged_instance_failing")


async def test_a_standalone_proxy_cannot_ask_to_be_monitored_by_a_pool(stack: Stack) -> None:
    handle = await stack.start(monitor="pool")
    with pytest.raises(Exception) as failed:
        await handle.result()
    assert "monitor: 'pool' is for the members a pool starts" in str(failed.value.__cause__)


def test_shards_split_the_members_and_a_change_touches_one_shard() -> None:
    members = [(f"pool/{n}", "local", f"127.0.0.1:{20000 + n}") for n in range(450)]
    split = shards(members, 200)
    assert len(split) == 3
    assert sorted(m for part in split.values() for m in part) == sorted(members)
    # One member's new endpoint changes its own shard only.
    moved = [*members[:-1], ("pool/449", "local", "127.0.0.1:1")]
    again = shards(moved, 200)
    changed = [n for n in split if split[n] != again[n]]
    assert len(changed) == 1
    assert shards([], 200) == {}


async def test_a_member_flooded_with_signals_it_ignores_hands_over_to_a_new_run(
    eager_can_env: WorkflowEnvironment,  # noqa: F811 (the fixture imported above)
    stack_on: Callable[[WorkflowEnvironment], Awaitable[Stack]],
) -> None:
    """A member its pool monitors waits for nothing but a rotation or its pool's word,
    so events it ignores (here `instance_failing` about another endpoint, which
    anyone may send) would grow its run for as long as it served. A long
    history (past EVENT_BUDGET, or here the server's suggestion) wakes it,
    and it continues as new.
    """
    stack = await stack_on(eager_can_env)
    pool, status = await monitored_pool(stack, 1)
    (only,) = status["members"]
    member = stack.client.get_workflow_handle(only["member"])
    first = await member.query("status")
    elsewhere = {"endpoint": "192.0.2.1:3128", "reason": "not this member's endpoint"}
    await signal_until_continued(
        member, INSTANCE_FAILING_SIGNAL, lambda _: elsewhere, settled_under=SUGGESTED_AT
    )
    # The same instance serves on in the new run, and its pool still lists it.
    after = await member.query("status")
    assert (after["state"], after["generation"], after["endpoint"]) == (
        "Ready",
        first["generation"],
        first["endpoint"],
    )
    assert (await pool.query("status"))["ready"] == 1
    await pool.signal("terminate")
    await pool.result()
