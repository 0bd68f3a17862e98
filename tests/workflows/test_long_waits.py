"""Long waits for quota: history stays small, and what serves meanwhile stays watched.

Also a terminate whose delete waits out quota for a month: the Terminating
runs hand over the same way, and the proxy ends Terminated once quota returns.

On the time-skipping test server: the provider answers every create with
QuotaExceeded for 30 simulated days, asking for a retry every hour (720
calls, about 8,000 history events in all, twice the lifecycle's own budget
per run). The workflow hands over to a new run in the middle of the wait, and
the wait goes on where it was: the same generation, the same "since".
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from providers.errors import QuotaExceeded
from tests.helpers.histories import record_history
from tests.helpers.run_chain import run_histories
from tests.helpers.stacks import Stack, StackOn
from tests.helpers.time_skipping import skip_past_pending_timer
from tests.helpers.waiting import (
    MONITOR_CANCEL_DEADLINE,
    QUICK_HEARTBEAT,
    pending_activities,
    status_of,
    wait_for,
    wait_status,
)
from workflows.lifecycle_carried import ProxyStatus
from workflows.lifecycle_handover import EVENT_BUDGET

pytestmark = pytest.mark.slow

WAIT = timedelta(days=30)
# An hour: 720 quota calls, about 8,000 events, so the history passes the
# lifecycle's 4,000-event budget once (runs of about 4,000 and 3,900 events).
RETRY_AFTER = timedelta(hours=1)
# Virtual time skipped per step: its 6 quota calls run within the client's
# 30 s deadline for one skip.
STEP = timedelta(hours=6)
MAX_EVENTS_PER_RUN = 10_000


async def pending_activities_none(handle: WorkflowHandle[Any, Any]) -> bool:
    return await pending_activities(handle) == []


def quota_every_hour(stack: Stack, operation: str) -> None:
    """Every `operation` refused for quota (retry after RETRY_AFTER) until recovered."""
    retry_after = int(RETRY_AFTER.total_seconds())
    error = QuotaExceeded("Quota 'CPUS' exceeded in europe-west1", retry_after_seconds=retry_after)
    stack.provider.fail_until_recovered(operation, error)


async def through_the_month(
    env: WorkflowEnvironment, handle: WorkflowHandle[Any, Any], check: Callable[[ProxyStatus], None]
) -> None:
    """Skip WAIT in STEPs, checking the status after each."""
    wait_ends = await env.get_current_time() + WAIT
    while (now := await env.get_current_time()) < wait_ends:
        await env.sleep(min(STEP, wait_ends - now))
        check(await status_of(handle))


async def handed_over_then_recovered(
    env: WorkflowEnvironment,
    stack: Stack,
    handle: WorkflowHandle[Any, Any],
    first_run_id: str,
    operation: str,
) -> None:
    """The wait took several runs, each under MAX_EVENTS_PER_RUN and each but the last
    past EVENT_BUDGET (a run hands over for its length, not for every few calls);
    then quota returns."""
    lengths = [len(run) async for run in run_histories(stack.client, handle.id, first_run_id)]
    assert len(lengths) > 1, f"never continued as new: {lengths} events"
    assert max(lengths) < MAX_EVENTS_PER_RUN, lengths
    assert min(lengths[:-1]) >= EVENT_BUDGET, lengths
    assert stack.provider.calls[operation] >= WAIT / RETRY_AFTER
    stack.provider.recover(operation)
    await skip_past_pending_timer(env, handle)


async def test_a_month_of_quota_continues_as_new_and_ends_ready(
    time_skipping_env: WorkflowEnvironment, stack_on: StackOn
) -> None:
    env = time_skipping_env
    stack = await stack_on(env)
    quota_every_hour(stack, "create")
    handle = await stack.start()
    first_run_id = handle.first_execution_run_id or handle.result_run_id
    assert first_run_id is not None
    first = await wait_status(
        handle, lambda s: (s.waiting_for or "").startswith("waiting for quota"), "quota wait"
    )
    since = (first.waiting_for or "").split("(since ")[1].split(",")[0]

    def still_waiting(status: ProxyStatus) -> None:
        assert status.state == "Provisioning" and status.generation == 0, status
        assert status.failures_in_a_row == 0, "waiting for quota spent the crash budget"
        # The same wait, however many runs it took.
        assert f"(since {since}," in (status.waiting_for or ""), status

    await through_the_month(env, handle, still_waiting)
    await handed_over_then_recovered(env, stack, handle, first_run_id, "create")
    ready = await wait_status(handle, lambda s: s.state == "Ready", "Ready once quota returns")
    assert (ready.generation, ready.replacements, ready.waiting_for) == (0, 0, None), ready
    assert stack.instances() == [ready.instance]

    await handle.signal("terminate")
    result: dict[str, Any] = await handle.result()
    assert result["state"] == "Terminated", result
    assert stack.instances() == []
    await record_history(handle, "month_of_quota_then_ready")


async def test_a_month_of_quota_on_terminate_continues_as_new_and_ends_terminated(
    time_skipping_env: WorkflowEnvironment, stack_on: StackOn
) -> None:
    """Terminating, its delete refused for quota for a month: still Terminating, history bounded."""
    env = time_skipping_env
    stack = await stack_on(env)
    handle = await stack.start(health=stack.proxy_input()["health"] | QUICK_HEARTBEAT)
    first_run_id = handle.first_execution_run_id or handle.result_run_id
    assert first_run_id is not None
    ready = await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    quota_every_hour(stack, "delete")
    await handle.signal("terminate", "a month of quota")
    await wait_status(
        handle,
        lambda s: s.state == "Terminating" and "waiting for quota" in (s.waiting_for or ""),
        "the delete's quota wait",
    )
    # The monitor ends at its next heartbeat (it learns of the cancel then);
    # until it has, virtual time runs at wall-clock pace
    # (tests/helpers/time_skipping.py).
    await wait_for(
        lambda: pending_activities_none(handle),
        "the monitor's end",
        deadline=MONITOR_CANCEL_DEADLINE,
    )

    def still_terminating(status: ProxyStatus) -> None:
        assert status.state == "Terminating", status
        assert status.terminate_reason == "a month of quota", status
        # Still owned, still being deleted, however many runs it took.
        assert stack.instances() == [ready.instance]

    await through_the_month(env, handle, still_terminating)
    await handed_over_then_recovered(env, stack, handle, first_run_id, "delete")
    result: dict[str, Any] = await handle.result()
    assert (result["state"], result["reason"]) == ("Terminated", "a month of quota"), result
    assert stack.instances() == []
    await record_history(handle, "month_of_quota_on_terminate")


async def test_old_instance_stays_monitored_while_its_rotation_waits_for_quota(
    stack: Stack,
) -> None:
    """The old instance serves (and is advertised) until its replacement is Ready: watched too."""
    handle = await stack.start()
    old = await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    stack.provider.fail_until_recovered(
        "create", QuotaExceeded("Quota 'CPUS' exceeded in europe-west1", retry_after_seconds=1)
    )
    await handle.signal("rotate")
    rotating = await wait_status(
        handle, lambda s: (s.waiting_for or "").startswith("waiting for quota"), "rotation's wait"
    )
    assert rotating.state == "Ready" and rotating.endpoint == old.endpoint, rotating
    # Calls 15 s apart from the next one on, so the next quota error (each
    # is the newest last_error) comes after the check below, even on a busy
    # machine; the replacement then starts up to 15 s after the recovery.
    calls = stack.provider.calls["create"]
    stack.provider.fail_until_recovered(
        "create", QuotaExceeded("Quota 'CPUS' exceeded in europe-west1", retry_after_seconds=15)
    )
    await wait_for(lambda: stack.provider.calls["create"] > calls, "the longer wait begun")

    # The old instance dies while its replacement waits for quota: it is
    # withdrawn at once, not advertised until the quota comes back.
    os.kill(stack.pid_of(old.instance), signal.SIGKILL)
    withdrawn = await wait_status(
        handle, lambda s: s.state == "Replacing", "the failed old instance withdrawn"
    )
    assert withdrawn.endpoint == "" and old.instance in (withdrawn.last_error or ""), withdrawn
    assert (withdrawn.waiting_for or "").startswith("waiting for quota"), withdrawn

    stack.provider.recover("create")
    ready = await wait_status(
        handle, lambda s: s.state == "Ready" and s.generation == 1, "the replacement Ready"
    )
    assert ready.instance != old.instance
    await wait_for(lambda: stack.instances() == [ready.instance], "only the replacement left")
    await handle.signal("terminate")
    assert (await handle.result())["state"] == "Terminated"
    assert stack.instances() == []
