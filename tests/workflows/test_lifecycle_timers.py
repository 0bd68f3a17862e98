"""Crash-loop backoff on the time-skipping test server.

The backoff timers (10 s doubling to minutes) skip ahead; activities still
run for real against real Squid. The test server cannot skip time while an
activity runs, so lifetimes (which run during the monitor) are tested on the
dev server with a short lifetime instead.
"""

from __future__ import annotations

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from tests.helpers.histories import record_history
from tests.helpers.stacks import StackOn
from tests.helpers.waiting import status_of, wait_status

pytestmark = pytest.mark.slow


async def test_proxy_that_keeps_dying_fails_with_nothing_leaked(
    time_skipping_env: WorkflowEnvironment, stack_on: StackOn
) -> None:
    stack = await stack_on(time_skipping_env)
    stack.provider.doomed = True  # every instance vanishes right after create
    handle = await stack.start()
    with pytest.raises(WorkflowFailureError) as failure:
        await handle.result()
    assert "gave up after 5 failed instances in a row" in str(failure.value.cause)
    assert stack.provider.calls["create"] == 5
    status = await status_of(handle)
    assert status.state == "Failed" and status.endpoint == ""
    assert stack.instances() == []
    await record_history(handle, "crash_loop_failed")


async def test_instances_that_never_became_ready_count_as_generations_and_replacements(
    time_skipping_env: WorkflowEnvironment, stack_on: StackOn
) -> None:
    """docs/operations.md, "Status": three instances before the first Ready."""
    stack = await stack_on(time_skipping_env)
    stack.provider.doomed_creates = 2  # two vanish right after create, the third lives
    handle = await stack.start()
    ready = await wait_status(handle, lambda s: s.state == "Ready", "the third instance Ready")
    assert (ready.generation, ready.replacements, ready.failures_in_a_row) == (2, 2, 2)
    assert stack.provider.calls["create"] == 3
    assert "vanished while provisioning" in (ready.last_error or "")
    assert ready.last_error_at is not None and ready.ready_since is not None
    assert ready.last_error_at <= ready.ready_since  # the error is history, dated
    await handle.signal("terminate")
    result = await handle.result()
    assert (result["generation"], result["replacements"]) == (2, 2)
    assert stack.instances() == []
    await record_history(handle, "ready_after_two_lost_instances")
