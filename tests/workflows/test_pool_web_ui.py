"""A pool's story as the Temporal Web UI tells it, read through the same API the UI reads.

A real pool of 3 local Squids is banned, loses a member to a hand-made
terminate and is rotated; then its history and its page must name, for
every member it started or signalled, which member and why: the child
starts' summaries, the signals' inputs, the timers' summaries and the
member table in the current details (the User Metadata tab).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import WorkflowHandle
from temporalio.converter import default

from tests.helpers.stacks import Stack
from tests.helpers.waiting import wait_for
from tests.workflows.test_pool_view import table_rows

pytestmark = pytest.mark.slow


async def test_the_pools_history_and_page_name_each_member_and_why(stack: Stack) -> None:
    pool = await stack.client.start_workflow(
        "ProxyPool",
        {"replicas": 3, "template": stack.proxy_input()},
        id=f"pool-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
    )
    await wait_for(lambda: settled(pool, {0: 0, 1: 0, 2: 0}), "3 Ready members", deadline=90)

    banned = f"{pool.id}/1"
    await pool.execute_update("report_ban", {"member": banned, "reason": "403 from the shop"})
    await wait_for(lambda: settled(pool, {0: 0, 1: 1, 2: 0}), "the banned member rotated")
    row = member_row(await current_details(pool), banned)
    assert row[-1].startswith("rotated: ban: 403 from the shop (generation 0 to 1, ")
    # The member's own page says why its instance is there, and since when.
    why = await current_details(stack.client.get_workflow_handle(banned))
    assert "why this instance: the pool asked for a rotation: ban: 403 from the shop (" in why
    assert "; Ready since " in why

    # Ended by hand, from outside the pool: the pool starts a member in its place.
    await stack.client.get_workflow_handle(f"{pool.id}/2").signal("terminate")
    await wait_for(lambda: settled(pool, {0: 0, 1: 1, 3: 0}), f"{pool.id}/3 in its place")

    await pool.execute_update("rotate", {"all": True})
    await wait_for(lambda: settled(pool, {0: 1, 1: 2, 3: 1}), "every member rotated", deadline=90)

    events = (await pool.fetch_history()).events
    starts = {
        e.start_child_workflow_execution_initiated_event_attributes.workflow_id: text(
            e.user_metadata.summary
        )
        for e in events
        if e.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED
    }
    first = {f"{pool.id}/{n}": f"start {pool.id}/{n}: first start, 3 replicas" for n in range(3)}
    outside = f"replaces {pool.id}/2, Terminated from outside the pool"
    assert starts == {**first, f"{pool.id}/3": f"start {pool.id}/3: {outside}"}
    # The member's own page says the same, with the details in full.
    replacement = await stack.client.get_workflow_handle(f"{pool.id}/3").describe()
    assert await replacement.static_summary() == starts[f"{pool.id}/3"]
    assert f"member of pool `{pool.id}`" in (await replacement.static_details() or "")

    # The SDK takes no summary for a signal: its Event Group's label names the
    # member and the cause, and so does its input.
    signals = [
        (
            e.signal_external_workflow_execution_initiated_event_attributes.signal_name,
            e.signal_external_workflow_execution_initiated_event_attributes.workflow_execution.workflow_id,
            text(e.signal_external_workflow_execution_initiated_event_attributes.input.payloads[0]),
            [text(m.label.label) for m in e.event_group_markers],
        )
        for e in events
        if e.event_type == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED
    ]
    ban, rotate_all = "pool: ban: 403 from the shop", "pool: rotate all"
    assert signals == [
        ("rotate", banned, {"reason": ban}, [f"rotate {banned}: {ban}"]),
        *(
            ("rotate", m, {"reason": rotate_all}, [f"rotate {m}: {rotate_all}"])
            for m in (f"{pool.id}/0", banned, f"{pool.id}/3")
        ),
    ]
    # A member's report to the pool is labelled in the member's history.
    member_events = (await stack.client.get_workflow_handle(banned).fetch_history()).events
    reports = [
        text(m.label.label)
        for e in member_events
        if e.event_type == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED
        for m in e.event_group_markers
    ]
    assert reports and all(r.startswith(f"{banned} ") for r in reports), reports
    assert any(r.startswith(f"{banned} Ready, 127.0.0.1:") for r in reports), reports
    timers = [
        text(e.user_metadata.summary)
        for e in events
        if e.event_type == EventType.EVENT_TYPE_TIMER_STARTED
    ]
    assert timers and all(t.startswith("at ") for t in timers), timers
    assert any(t.endswith(": reconcile members with visibility") for t in timers), timers

    details = await current_details(pool)
    assert details.startswith("**Ready**: 3 replicas, 3 Ready, 3 members")
    for member, generation in ((0, 1), (1, 2), (3, 1)):
        row = member_row(details, f"{pool.id}/{member}")
        assert row[1:4] == ["Ready", row[2], str(generation)] and row[2].startswith("127.0.0.1:")
        assert row[4].startswith(f"rotated: rotate all (generation {generation - 1} to ")

    # Ages are the reader's to compute: a query cannot read the time it is asked at.
    status = await pool.query("status")
    assert status["as_of"] and all(m["ready_since"] for m in status["members"])
    assert "age_seconds" not in status["members"][0]
    await pool.signal("terminate")
    assert (await pool.result())["state"] == "Terminated"


async def settled(pool: WorkflowHandle[Any, Any], generations: dict[int, int]) -> bool:
    """The pool is Ready with exactly these members at these generations, and waits for nothing.

    Serving too: a member Ready with its endpoint not yet confirmed by its
    provider is not in `endpoints`, and a ban of it is refused.
    """
    status = await pool.query("status")
    seen = {m["member"]: (m["state"], m["generation"]) for m in status["members"]}
    expected = {f"{pool.id}/{n}": ("Ready", g) for n, g in generations.items()}
    return bool(
        seen == expected and status["waiting_for"] is None and status["ready"] == len(generations)
    )


async def current_details(pool: WorkflowHandle[Any, Any]) -> str:
    """What the Web UI's User Metadata tab shows as a workflow's current details."""
    metadata = await pool.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)
    return str(metadata.current_details)


def member_row(details: str, member: str) -> list[str]:
    (row,) = [row for row in table_rows(details) if row[0] == member]
    return row


def text(payload: Any) -> Any:
    return default().payload_converter.from_payload(payload)
