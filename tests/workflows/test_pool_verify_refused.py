"""A member's endpoint its provider refuses to check, for good: refused once, not asked again;
one it cannot check for now (a quota or rate limit): asked again once that passes.

The pool lists a reported endpoint only once `verify_endpoint` confirms it
with the member's provider. When that check fails non-retryably (the
provider denies the listing for good, or the worker has no such provider),
asking again cannot help: the report is refused and counted in `status`
(`rejected_reports`, `last_rejected`), and the pool's next steps do not
schedule the check again (they did, at once, on every workflow task).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle

from providers.errors import Permanent, QuotaExceeded
from tests.helpers.stacks import Stack
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.slow

FORGED_ENDPOINT = "127.0.0.1:9"
REFUSAL = "permission denied: compute.instances.list"


async def pool_status(handle: WorkflowHandle[Any, Any]) -> dict[str, Any]:
    status: dict[str, Any] = await handle.query("status")
    return status


async def checks_of(handle: WorkflowHandle[Any, Any], endpoint: str | None) -> int:
    """How many `verify_endpoint` activities the pool scheduled for `endpoint` (any: None)."""
    count = 0
    async for event in handle.fetch_history_events():
        if event.event_type != EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            continue
        scheduled = event.activity_task_scheduled_event_attributes
        if scheduled.activity_type.name != "verify_endpoint":
            continue
        claim = json.loads(scheduled.input.payloads[0].data)
        count += endpoint in (None, claim["endpoint"])
    return count


async def settled(handle: WorkflowHandle[Any, Any]) -> bool:
    """No workflow task pending: every step the pool had to take, it took."""
    description = await handle.describe()
    assert description.status == WorkflowExecutionStatus.RUNNING
    return not description.raw_description.HasField("pending_workflow_task")


async def test_an_endpoint_check_refused_for_good_is_counted_and_not_asked_again(
    stack: Stack,
) -> None:
    handle = await stack.start_pool(1)

    async def serving() -> bool:
        return bool((await pool_status(handle))["ready"] == 1)

    await wait_for(serving, "the member Ready and confirmed", deadline=120)
    [member] = (await pool_status(handle))["members"]
    served_on = member["endpoint"]

    # The provider now refuses every listing for good; the member reports a
    # new endpoint (as after a rotation: forged here, which changes nothing).
    stack.provider.fail_until_recovered("list_by_tag", Permanent(REFUSAL))
    report = {
        "member": member["member"],
        "state": "Ready",
        "endpoint": FORGED_ENDPOINT,
        "provider": "local",
        "generation": member["generation"],
        "ready_since": member["ready_since"],
        "at": datetime.now(UTC).isoformat(),
        "seq": 1_000_000,
        "last_error": None,
    }
    await handle.signal("member_changed", report)

    async def refused() -> bool:
        return bool((await pool_status(handle))["rejected_reports"] == 1)

    await wait_for(refused, "the report refused", deadline=120)
    status = await pool_status(handle)
    assert REFUSAL in status["last_rejected"], status
    assert member["member"] in status["last_rejected"], status

    # More steps of the pool (each update is one): none asks again.
    for _ in range(3):
        await handle.execute_update("scale", {"replicas": 1})
    await wait_for(lambda: settled(handle), "the pool's steps taken")
    assert await checks_of(handle, FORGED_ENDPOINT) == 1
    status = await pool_status(handle)
    assert status["rejected_reports"] == 1, status
    # The refused endpoint never reached `endpoints`; the confirmed one stays.
    assert [e["endpoint"] for e in await handle.query("endpoints")] == [served_on]

    stack.provider.recover("list_by_tag")
    await handle.signal("terminate")
    assert (await handle.result())["state"] == "Terminated"
    await wait_for(lambda: stack.instances() == [], "the member's instance deleted")


async def test_an_endpoint_check_that_meets_a_quota_is_asked_again_not_refused(
    stack: Stack,
) -> None:
    """A rate limit passes: the Ready member is listed once its check gets through."""
    stack.provider.fail_until_recovered(
        "list_by_tag", QuotaExceeded("Rate Limit Exceeded", retry_after_seconds=1)
    )
    handle = await stack.start_pool(1)

    async def checked_twice() -> bool:
        return await checks_of(handle, None) >= 2

    await wait_for(checked_twice, "the member's endpoint checked against the limit", deadline=120)
    stack.provider.recover("list_by_tag")

    async def serving() -> bool:
        return bool((await pool_status(handle))["ready"] == 1)

    await wait_for(serving, "the member confirmed once the limit passed", deadline=120)
    status = await pool_status(handle)
    assert status["rejected_reports"] == 0, status
    [member] = status["members"]
    assert [e["endpoint"] for e in await handle.query("endpoints")] == [member["endpoint"]]
    assert await checks_of(handle, member["endpoint"]) >= 3

    await handle.signal("terminate")
    assert (await handle.result())["state"] == "Terminated"
    await wait_for(lambda: stack.instances() == [], "the member's instance deleted")
