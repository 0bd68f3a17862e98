"""The monitor heartbeats on a clock of its own, whatever `health.interval_seconds` is.

It runs against a real dev server and real Squid with the shortest heartbeat
timeout a proxy may choose (`health.heartbeat_timeout_seconds`), and waits out
more than one timeout in real time: the time-skipping server runs at
wall-clock pace while an activity runs (tests/helpers/time_skipping.py), so
it cannot shorten this.
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowHandle

from tests.helpers.stacks import Stack
from tests.helpers.waiting import wait_for, wait_status
from workflows.inputs import MIN_HEARTBEAT_TIMEOUT_SECONDS

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT = timedelta(seconds=MIN_HEARTBEAT_TIMEOUT_SECONDS)
# Longer than the heartbeat timeout, so the monitor's second probe comes after it.
INTERVAL = HEARTBEAT_TIMEOUT + timedelta(seconds=15)


async def monitor_heartbeat(
    stack: Stack, handle: WorkflowHandle[Any, Any]
) -> dict[str, Any] | None:
    """The running monitor's last heartbeat details as the server has them, if any."""
    description = await handle.describe()
    for pending in description.raw_description.pending_activities:
        if pending.activity_type.name == "monitor" and pending.heartbeat_details.payloads:
            details = await stack.client.data_converter.decode(pending.heartbeat_details.payloads)
            beat: dict[str, Any] = details[0]
            return beat
    return None


async def test_a_probe_interval_longer_than_the_heartbeat_timeout_keeps_the_monitor_running(
    stack: Stack,
) -> None:
    handle = await stack.start(
        health={
            "target": stack.origin.url,
            "interval_seconds": INTERVAL.total_seconds(),
            "heartbeat_timeout_seconds": int(HEARTBEAT_TIMEOUT.total_seconds()),
            "failure_threshold": 3,
        }
    )
    first = await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    beats: list[dict[str, Any] | None] = []

    async def first_probe_heartbeated() -> bool:
        beats.append(await monitor_heartbeat(stack, handle))
        return beats[-1] is not None

    await wait_for(first_probe_heartbeated, "the monitor's first heartbeat")
    beat = beats[-1]
    assert beat is not None and beat["last_probe"]["ok"], beat
    assert beat["consecutive_failures"] == 0

    # The proxy dies; the monitor's next probe, one interval (more than a
    # heartbeat timeout) later, must find it, in the attempt that started.
    os.kill(stack.pid_of(first.instance), signal.SIGKILL)
    second = await wait_status(
        handle,
        lambda s: s.state == "Ready" and s.generation == 1,
        "the dead proxy replaced",
        deadline=INTERVAL.total_seconds() + 60,
    )
    assert second.replacements == 1

    events = [event async for event in handle.fetch_history_events()]
    assert not [e for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT]
    started, completed = first_monitor(events)
    assert started.activity_task_started_event_attributes.attempt == 1, "the monitor restarted"
    ran = completed.event_time.ToDatetime() - started.event_time.ToDatetime()
    assert ran > HEARTBEAT_TIMEOUT, f"the monitor ran {ran}, not past a heartbeat timeout"
    [outcome] = await stack.client.data_converter.decode(
        completed.activity_task_completed_event_attributes.result.payloads
    )
    assert outcome["reason"] == "gone", outcome

    await handle.signal("terminate")
    await handle.result()
    assert stack.instances() == []


def first_monitor(events: list[HistoryEvent]) -> tuple[HistoryEvent, HistoryEvent]:
    """The started and completed events of the workflow's first `monitor` activity."""
    scheduled = next(
        e.event_id
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == "monitor"
    )
    started = next(
        e
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
        and e.activity_task_started_event_attributes.scheduled_event_id == scheduled
    )
    completed = next(
        e
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
        and e.activity_task_completed_event_attributes.scheduled_event_id == scheduled
    )
    return started, completed
