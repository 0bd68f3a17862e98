"""The drain: an instance leaving a pool serves on after it left `endpoints`, visibly.

Gateways follow `endpoints`; the drain is the time they have to drop a
member before its instance is deleted (docs/architecture.md, "The gateway").
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle

from tests.helpers.network import accepts_connections
from tests.helpers.stacks import Stack
from tests.helpers.waiting import status_of, wait_for, wait_status

pytestmark = pytest.mark.slow

DRAIN = 4


async def test_a_rotation_drains_the_old_instance_before_deleting_it(stack: Stack) -> None:
    handle = await stack.start(drain_seconds=DRAIN)
    first = await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    old_port = int(first.endpoint.rpartition(":")[2])

    await handle.signal("rotate")
    draining = await wait_status(
        handle,
        lambda s: s.generation > first.generation and (s.waiting_for or "").startswith("draining"),
        "the new instance Ready, the old one draining",
    )

    assert draining.state == "Ready" and draining.endpoint != first.endpoint
    assert first.instance in draining.waiting_for
    # Still serving: a gateway that has not taken the change yet loses nothing.
    assert first.instance in stack.instances() and accepts_connections(old_port)
    await wait_for(lambda: first.instance not in stack.instances(), "the old instance deleted")
    assert (await status_of(handle)).waiting_for is None
    summaries = [
        event.user_metadata.summary.data
        async for event in handle.fetch_history_events()
        if event.event_type == EventType.EVENT_TYPE_TIMER_STARTED
    ]
    assert any(f"drain {first.instance} {DRAIN}s".encode() in s for s in summaries), summaries
    await handle.signal("terminate")
    await handle.result()


async def test_a_scaled_down_member_leaves_endpoints_then_drains(stack: Stack) -> None:
    pool = await stack.client.start_workflow(
        "ProxyPool",
        {"replicas": 2, "template": stack.proxy_input(drain_seconds=DRAIN)},
        id=f"pool-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
    )

    async def serving(count: int) -> bool:
        return len(await pool.query("endpoints")) == count

    await wait_for(lambda: serving(2), "two members serving", deadline=120)
    await pool.execute_update("scale", {"replicas": 1})

    await wait_for(lambda: serving(1), "one member left in endpoints")
    status = await pool.query("status")
    (leaving,) = [m for m in status["members"] if m["removing"]]
    assert leaving["removing"] == f"scaled down, draining {DRAIN}s"
    member = stack.client.get_workflow_handle(leaving["member"])
    assert (await member.describe()).status == WorkflowExecutionStatus.RUNNING
    assert (await status_of(member)).state == "Ready", "still serving while it drains"
    await wait_for(
        lambda: _closed(member), f"{leaving['member']} terminated after the drain", deadline=60
    )
    await pool.signal("terminate")
    await pool.result()
    assert stack.instances() == []


async def _closed(handle: WorkflowHandle[Any, Any]) -> bool:
    return (await handle.describe()).status != WorkflowExecutionStatus.RUNNING
