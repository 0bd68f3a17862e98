"""A pool whose members keep failing, on the time-skipping test server.

Each member crash-loops to Failed through its own backoffs (10 s doubling)
and the pool's replacement backoff; all of it skips ahead. Members that never
become Ready never start a monitor, so nothing holds virtual time back
(tests/helpers/time_skipping.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from tests.helpers.stacks import Stack, StackOn
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.slow


async def test_failure_budget_stops_replacing_and_says_why_until_scaled(
    time_skipping_env: WorkflowEnvironment, stack_on: StackOn
) -> None:
    stack = await stack_on(time_skipping_env)
    stack.provider.doomed = True  # every instance vanishes right after create
    pool_id = f"pool-{uuid.uuid4().hex[:8]}"
    handle = await stack.client.start_workflow(
        "ProxyPool",
        {"replicas": 1, "template": stack.proxy_input(), "failure_budget": 2},
        id=pool_id,
        task_queue=stack.task_queue,
    )
    # Member 0 crash-loops to Failed; after a backoff the pool replaces it
    # with member 1 (a new id), which fails too: the budget of 2 is spent.

    async def stopped() -> bool:
        status = await handle.query("status")
        return status["stopped_replacing"] is not None and not status["members"]

    async with _skipping_time(handle):
        await wait_for(stopped, "the pool to stop replacing", deadline=120)
    for n in range(2):
        member = await stack.client.get_workflow_handle(f"{pool_id}/{n}").describe()
        assert member.status is not None and member.status.name == "FAILED"
    status = await handle.query("status")
    assert status["state"] == "Degraded" and status["ready"] == 0
    assert "stopped replacing after 2 members in a row ended Failed" in status["waiting_for"]
    assert "gave up after 5 failed instances" in status["last_error"]
    assert stack.provider.calls["create"] == 10  # 2 members x their crash budget of 5
    assert stack.instances() == []
    # No create/destroy loop: nothing more is started while the pool waits.
    assert not await _exists(stack, f"{pool_id}/2")()

    # The cause fixed, `scale` resumes replacing.
    stack.provider.doomed = False
    await handle.execute_update("scale", {"replicas": 1})
    member = stack.client.get_workflow_handle(f"{pool_id}/2")
    await wait_for(_exists(stack, member.id), "a new member after scale")

    async def ready() -> bool:
        return bool((await handle.query("status"))["ready"] == 1)

    await wait_for(ready, "the new member Ready")
    assert (await handle.query("status"))["state"] == "Ready"
    await handle.signal("terminate")
    assert (await handle.result())["state"] == "Terminated"
    assert stack.instances() == []


@contextlib.asynccontextmanager
async def _skipping_time(handle: WorkflowHandle[Any, Any]) -> AsyncIterator[None]:
    """Let virtual time skip: the test server skips while a client awaits a result."""
    waiting = asyncio.create_task(handle.result())
    try:
        yield
    finally:
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError, WorkflowFailureError):
            await waiting


def _exists(stack: Stack, workflow_id: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        try:
            await stack.client.get_workflow_handle(workflow_id).describe()
        except Exception:
            return False
        return True

    return check
