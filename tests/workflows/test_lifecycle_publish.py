"""A proxy's search attributes: upserted once a workflow task, every state
still shown, and every instance named before it can exist
(workflows/lifecycle_publish.py).

Each upsert is a Temporal Cloud action. A proxy's first task publishes twice
(Provisioning, then its first instance's name just before the create), and
so does its last (the last instance gone, then Terminated) and a rotation's
first when the previous one's old instance has just gone: one upsert each.
Orphan GC trusts `ProxyInstances`: an instance whose name is not there is
an orphan, so the name must be upserted in the task that schedules the
create, never after it.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent

from contract import INSTANCES, STATE
from tests.helpers.stacks import Stack
from tests.helpers.waiting import rotated, wait_for, wait_status

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class _Upsert:
    """An upsert of the proxy's own search attributes, and the workflow task it was made in."""

    task: int
    state: str
    instances: list[str]


def _upsert(event: HistoryEvent) -> _Upsert | None:
    """The proxy's own attributes an upsert event set; None for the SDK's TemporalChangeVersion."""
    attributes = event.upsert_workflow_search_attributes_event_attributes
    fields = attributes.search_attributes.indexed_fields
    if STATE.name not in fields:
        return None
    instances = fields[INSTANCES.name].data
    return _Upsert(
        task=attributes.workflow_task_completed_event_id,
        state=json.loads(fields[STATE.name].data),
        instances=list(json.loads(instances)) if instances else [],
    )


async def test_a_proxy_upserts_once_in_its_first_and_last_tasks_and_names_each_instance_first(
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

    upserts: list[_Upsert] = []
    created: dict[int, int] = {}  # create_instance's scheduled event -> its task
    names: dict[int, str] = {}  # create_instance's scheduled event -> the instance made
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES:
            upsert = _upsert(event)
            if upsert is not None:
                upserts.append(upsert)
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            scheduled = event.activity_task_scheduled_event_attributes
            if scheduled.activity_type.name == "create_instance":
                created[event.event_id] = scheduled.workflow_task_completed_event_id
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            completed = event.activity_task_completed_event_attributes
            if completed.scheduled_event_id in created:
                result = json.loads(completed.result.payloads[0].data)
                names[completed.scheduled_event_id] = result["name"]

    per_task = Counter(u.task for u in upserts)
    # The first task: Provisioning and the first instance's name, in one upsert.
    assert per_task[upserts[0].task] == 1, upserts
    assert (upserts[0].state, upserts[0].instances) == ("Provisioning", [first.instance])
    # The last: the last instance gone and Terminated, in one.
    assert per_task[upserts[-1].task] == 1, upserts
    assert (upserts[-1].state, upserts[-1].instances) == ("Terminated", [])
    # Every state the proxy was in, in order (rotations stay Ready).
    states = [u.state for n, u in enumerate(upserts) if n == 0 or upserts[n - 1].state != u.state]
    assert states == ["Provisioning", "Ready", "Terminating", "Terminated"]

    assert sorted(names.values()) == sorted({first.instance, second.instance, third.instance})
    for scheduled, task in created.items():
        # Orphan GC's guarantee: ProxyInstances as the task that scheduled
        # the create left it already names the instance.
        shown = [u for u in upserts if u.task <= task][-1]
        assert names[scheduled] in shown.instances, (names[scheduled], shown)

    described = (await handle.describe()).typed_search_attributes
    assert described.get(STATE) == "Terminated"
    assert described.get(INSTANCES) is None
