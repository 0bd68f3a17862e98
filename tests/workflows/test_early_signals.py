"""A signal that reaches a pool as it continues as new is not lost (workflows/early_signals.py).

On a dev server that suggests continue-as-new after a few dozen events
(as test_continue_as_new's does), a pool of two members continues as new
within seconds of its start. The server then holds the new run's first
workflow task back until HELD after the old run began
(`history.workflowIdReuseMinimalInterval` on server 1.32, 1 s by default,
10 s here so that a busy machine still gets its signal in), so a signal sent as soon as the
new run exists reaches it before that task, while the run has not yet
taken over its carried state. A `terminate` sent then must not be lost
(the pool would run on). Each attempt checks in the new run's history whether its
signal came that early; the test needs one that did.

An update sent then is the same race: it must not be refused ("not taking
updates"), but wait for the takeover and apply to the carried state.

A member's `Ready` report lost the same way is test_pool_lifetimes'
`test_members_live_on_across_the_pools_continue_as_new`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from tests.helpers.stacks import Stack
from tests.helpers.temporal import start_dev_server
from tests.helpers.waiting import DEADLINE, wait_for

pytestmark = pytest.mark.slow

ATTEMPTS = 4
HELD = "10s"
# About where a two-member pool's first run has both members' first reports
# (32 events on 0.3.9, whose runs record one patch marker; 40 before): it
# continues as new then, and its next run stays under it until terminated.
SUGGESTED_AT = 30


@pytest.fixture(scope="module")
async def held_can_env() -> AsyncIterator[WorkflowEnvironment]:
    env = await start_dev_server(
        "--dynamic-config-value",
        f"limit.historyCount.suggestContinueAsNew={SUGGESTED_AT}",
        "--dynamic-config-value",
        f'history.workflowIdReuseMinimalInterval="{HELD}"',
    )
    yield env
    await env.shutdown()


REASON = "sent between runs"


async def _second_run(pool: WorkflowHandle[Any, Any]) -> None:
    """Return as soon as the pool's second run exists: polled, not waited on."""
    loop = asyncio.get_running_loop()
    until = loop.time() + DEADLINE
    while (await pool.describe()).run_id == pool.result_run_id:
        if loop.time() > until:
            raise AssertionError(f"the pool did not continue as new in {DEADLINE:.0f}s")
        await asyncio.sleep(0.01)


async def _terminated(stack: Stack, pool: WorkflowHandle[Any, Any]) -> None:
    """Terminate the pool: it ends for that reason and leaves no instance."""
    await pool.signal("terminate", {"reason": REASON})
    result = await asyncio.wait_for(pool.result(), DEADLINE)
    assert (result["state"], result["reason"]) == ("Terminated", REASON)
    await wait_for(lambda: stack.instances() == [], "the members' instances deleted")


async def _signals_before_first_task(pool: WorkflowHandle[Any, Any]) -> list[str]:
    """The signals the pool's latest run received before its first workflow task started."""
    signals: list[str] = []
    async for event in pool.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
            break
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
            signals.append(event.workflow_execution_signaled_event_attributes.signal_name)
    return signals


async def test_a_terminate_sent_as_a_pool_continues_as_new_ends_it(
    held_can_env: WorkflowEnvironment, stack_on: Any
) -> None:
    stack: Stack = await stack_on(held_can_env)
    for _ in range(ATTEMPTS):
        pool = await stack.start_pool(replicas=2)
        await _second_run(pool)
        # Lost, the terminate would leave the pool running and this would time out.
        await _terminated(stack, pool)
        if await _signals_before_first_task(pool) == ["terminate"]:
            return
    raise AssertionError(f"in {ATTEMPTS} pools, no terminate came before a new run's first task")


async def _accepted_in_first_task(pool: WorkflowHandle[Any, Any], update_id: str) -> bool:
    """Whether the pool's latest run accepted the update in its first workflow task."""
    completed = 0
    async for event in pool.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
            completed += 1
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED:
            attributes = event.workflow_execution_update_accepted_event_attributes
            if attributes.accepted_request.meta.update_id == update_id:
                return completed == 1
    return False


async def test_a_scale_sent_as_a_pool_continues_as_new_applies_to_its_members(
    held_can_env: WorkflowEnvironment, stack_on: Any
) -> None:
    stack: Stack = await stack_on(held_can_env)
    for attempt in range(ATTEMPTS):
        pool = await stack.start_pool(replicas=2)
        await _second_run(pool)
        update_id = f"scale-between-runs-{attempt}"
        # Refused before the takeover, this raised WorkflowUpdateFailedError.
        answer = await pool.execute_update("scale", {"replicas": 3}, id=update_id)
        assert answer == {"replicas": 3, "previous": 2}, "applied to the carried size"
        assert (await pool.query("status"))["replicas"] == 3
        await _terminated(stack, pool)
        if await _accepted_in_first_task(pool, update_id):
            return
    raise AssertionError(f"in {ATTEMPTS} pools, no scale came before a new run's first task")
