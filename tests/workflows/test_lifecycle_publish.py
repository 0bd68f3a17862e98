"""A proxy's search attributes: upserted once a workflow task at most, and
naming every instance before it can exist (workflows/lifecycle_publish.py).

Each upsert is a Temporal Cloud action. Up to 0.3.9 a proxy's first task
upserted twice (Provisioning, then its first instance's name just before
the create), and so did its last (the last instance gone, then Terminated)
and a rotation's first when the previous one's old instance had just gone.
Orphan GC trusts `ProxyInstances`: an instance whose name is not there is
an orphan, so the name must be upserted in the task that schedules the
create, never after it.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowHandle

from contract import INSTANCES, STATE
from tests.helpers.stacks import Stack
from tests.helpers.waiting import rotated, wait_for, wait_status

pytestmark = pytest.mark.slow


async def _events(handle: WorkflowHandle[Any, Any]) -> list[HistoryEvent]:
    return [event async for event in handle.fetch_history_events()]


def _upserted_instances(event: HistoryEvent) -> list[str] | None:
    """What an upsert of the proxy's own attributes set ProxyInstances to; None: not one."""
    fields = event.upsert_workflow_search_attributes_event_attributes.search_attributes
    if STATE.name not in fields.indexed_fields:
        return None  # the SDK's TemporalChangeVersion
    data = fields.indexed_fields[INSTANCES.name].data
    return list(json.loads(data)) if data else []


async def test_a_proxy_upserts_once_a_task_and_names_each_instance_as_it_creates_it(
    stack: Stack,
) -> None:
    handle = await stack.start()
    first = await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    second = await rotated(handle, first, "test")
    # At once: the second rotation begins as the first one's old instance is
    # deleted, in the task that learns it is gone, if the delete is still on.
    third = await rotated(handle, second, "again")
    await wait_for(lambda: stack.instances() == [third.instance], "the old instances deleted")
    await handle.signal("terminate")
    assert (await handle.result())["state"] == "Terminated"

    events = await _events(handle)
    # Each upsert, by the workflow task whose commands it was one of.
    upserts: dict[int, list[str]] = {}
    per_task: Counter[int] = Counter()
    created: dict[int, int] = {}  # create_instance's scheduled event -> its task
    names: dict[int, str] = {}  # create_instance's scheduled event -> the instance made
    for event in events:
        if event.event_type == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES:
            instances = _upserted_instances(event)
            if instances is not None:
                task = event.upsert_workflow_search_attributes_event_attributes
                per_task[task.workflow_task_completed_event_id] += 1
                upserts[task.workflow_task_completed_event_id] = instances
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            scheduled = event.activity_task_scheduled_event_attributes
            if scheduled.activity_type.name == "create_instance":
                created[event.event_id] = scheduled.workflow_task_completed_event_id
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            completed = event.activity_task_completed_event_attributes
            if completed.scheduled_event_id in created:
                result = json.loads(completed.result.payloads[0].data)
                names[completed.scheduled_event_id] = result["name"]

    assert per_task and max(per_task.values()) == 1, per_task
    assert sorted(names.values()) == sorted({first.instance, second.instance, third.instance})
    for scheduled, task in created.items():
        # ProxyInstances as that task left it: its upsert, else the last before.
        shown = upserts[max(t for t in upserts if t <= task)]
        assert names[scheduled] in shown, (names[scheduled], shown)

    described = (await handle.describe()).typed_search_attributes
    assert described.get(STATE) == "Terminated"
    assert described.get(INSTANCES) is None
