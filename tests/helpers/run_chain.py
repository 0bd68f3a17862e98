"""A workflow's runs, first to last: its history as continue-as-new split it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowHandle

from tests.helpers.temporal import STARVED_TASK
from tests.helpers.waiting import wait_for


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
    """The failure of every WorkflowTaskFailed event in any run: each one a wedged handler.

    Except those of the SDK's deadlock detector (STARVED_TASK): on a starved
    machine it fails a task that merely waited for the CPU, and the SDK
    retries it. The callers check that the workflow went on to its outcome,
    which one that really hangs never reaches.
    """
    messages = [
        e.workflow_task_failed_event_attributes.failure.message
        async for events in run_histories(client, workflow_id, first_run_id)
        for e in events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
    ]
    return [f"{workflow_id}: {m[:300]}" for m in messages if not m.startswith(STARVED_TASK)]


async def signal_until_continued(
    handle: WorkflowHandle[Any, Any],
    name: str,
    make_input: Callable[[int], Any],
    *,
    settled_under: int,
    most: int = 500,
) -> int:
    """Signal `name` in small bursts until the workflow's run continues as new; how many went.

    First waits for a run whose history is under `settled_under` events (one
    that has handed over whatever it had to), so only the signals can be
    why it hands over. Bursts stay small: every signal that reaches a run
    while its workflow task runs is applied in the next task, and a loaded
    worker given thousands at once trips the SDK's deadlock detector. Each
    burst is taken before the next goes: a signal that lands while the
    workflow hands over makes the server refuse the continue-as-new, and an
    endless stream of them on a slow worker would refuse every attempt.
    """
    settled: list[str] = []

    async def short() -> bool:
        info = (await handle.describe()).raw_description.workflow_execution_info
        settled[:] = [info.execution.run_id] if info.history_length < settled_under else []
        return bool(settled)

    await wait_for(short, f"a run of {handle.id} under {settled_under} events")
    sent = 0
    while (await handle.describe()).run_id == settled[0]:
        assert sent < most, f"no continue-as-new after {sent} {name} signals"
        sent = await _burst(handle, name, make_input, sent, settled[0])
    return sent


async def signal_until_length(
    handle: WorkflowHandle[Any, Any],
    name: str,
    make_input: Callable[[int], Any],
    *,
    length: int,
) -> str:
    """Signal `name` in small bursts until a run's history has `length` events; that run's id.

    A run already that long is first signalled on until it continues as new
    (it might otherwise never grow), so the run returned got there from the
    signals and from less than `length` events.
    """
    info = (await handle.describe()).raw_description.workflow_execution_info
    if info.history_length >= length:
        # (`settled_under`: this run, whatever few events it gains meanwhile)
        await signal_until_continued(
            handle, name, make_input, settled_under=info.history_length + 100, most=10 * length
        )
    run_id = (await handle.describe()).run_id
    sent = 0
    while True:
        info = (await handle.describe()).raw_description.workflow_execution_info
        assert info.execution.run_id == run_id, f"{handle.id} continued as new before {length}"
        if info.history_length >= length:
            return run_id
        sent = await _burst(handle, name, make_input, sent, run_id)


async def _burst(
    handle: WorkflowHandle[Any, Any],
    name: str,
    make_input: Callable[[int], Any],
    sent: int,
    run_id: str,
) -> int:
    """Ten `name` signals, once run `run_id` has taken them (or ended); how many went in all."""

    async def taken() -> bool:
        description = await handle.describe()
        return description.run_id != run_id or not description.raw_description.HasField(
            "pending_workflow_task"
        )

    await asyncio.gather(*(handle.signal(name, make_input(sent + n)) for n in range(10)))
    await wait_for(taken, f"{handle.id} to take the last {name} signals")
    return sent + 10
