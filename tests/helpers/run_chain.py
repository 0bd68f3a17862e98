"""A workflow's runs, first to last: its history as continue-as-new split it."""

from __future__ import annotations

from collections.abc import AsyncIterator

from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client


async def run_histories(
    client: Client, workflow_id: str, first_run_id: str
) -> AsyncIterator[list[HistoryEvent]]:
    """The events of every run, following continue-as-new from the first."""
    run_id: str | None = first_run_id
    while run_id is not None:
        handle = client.get_workflow_handle(workflow_id, run_id=run_id)
        events = [e async for e in handle.fetch_history_events()]
        yield events
        last = events[-1]
        run_id = (
            last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
            if last.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW
            else None
        )


async def failed_tasks(client: Client, workflow_id: str, first_run_id: str) -> list[str]:
    """The failure of every WorkflowTaskFailed event in any run: each one a wedged handler."""
    return [
        f"{workflow_id}: {e.workflow_task_failed_event_attributes.failure.message[:300]}"
        async for events in run_histories(client, workflow_id, first_run_id)
        for e in events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
    ]
