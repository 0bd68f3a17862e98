"""Crash-loop backoff on the time-skipping test server.

The backoff timers (10 s doubling to minutes) skip ahead; activities still
run for real against real Squid. The test server cannot skip time while an
activity runs, so lifetimes (which run during the monitor) are tested on the
dev server with a short lifetime instead.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from tests.helpers.histories import record_history
from tests.helpers.stacks import Stack
from tests.helpers.waiting import status_of

pytestmark = pytest.mark.slow

StackOn = Callable[[WorkflowEnvironment], Awaitable[Stack]]


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
