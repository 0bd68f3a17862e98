"""Continue-as-new carries the proxy across runs without a gap or a leak.

A dev server of its own suggests continue-as-new after a few dozen events
(`limit.historyCount.suggestContinueAsNew`), so a proxy that rotates every
10 s reaches it within one rotation instead of after weeks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from temporalio.testing import WorkflowEnvironment

from tests.helpers.histories import record_history
from tests.helpers.stacks import Stack
from tests.helpers.temporal import start_dev_server
from tests.helpers.waiting import wait_for, wait_status

pytestmark = pytest.mark.slow


# Where `eager_can_env` suggests continue-as-new: a run's 40th event.
SUGGESTED_AT = 40


@pytest.fixture(scope="module")
async def eager_can_env() -> AsyncIterator[WorkflowEnvironment]:
    env = await start_dev_server(
        "--dynamic-config-value", f"limit.historyCount.suggestContinueAsNew={SUGGESTED_AT}"
    )
    yield env
    await env.shutdown()


async def test_rotation_continues_as_new_carrying_state(
    eager_can_env: WorkflowEnvironment,
    stack_on: Callable[[WorkflowEnvironment], Awaitable[Stack]],
) -> None:
    stack = await stack_on(eager_can_env)
    handle = await stack.start(max_lifetime_seconds=10)
    first = await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    first_run = (await handle.describe()).run_id

    async def continued() -> bool:
        return (await handle.describe()).run_id != first_run

    await wait_for(continued, "a new run after continue-as-new", deadline=60)
    status = await wait_status(
        handle, lambda s: s.state == "Ready" and s.generation >= 1, "Ready in the new run"
    )
    # The new run knows the history of the proxy: generations and replacements
    # go on from where the old run left them, and the old instance is gone.
    assert status.replacements >= 1 and status.instance != first.instance
    await wait_for(lambda: stack.instances() == [status.instance], "one instance, the current")
    old_runs = [w async for w in eager_can_env.client.list_workflows(f"WorkflowId = '{handle.id}'")]
    assert any(w.status is not None and w.status.name == "CONTINUED_AS_NEW" for w in old_runs)

    await handle.signal("terminate")
    result = await handle.result()
    assert result["state"] == "Terminated"
    assert stack.instances() == []
    await record_history(handle, "continued_as_new_then_terminated")
