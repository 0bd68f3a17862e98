"""A delete the provider refuses for good ends the proxy as Failed, saying which and why.

A provider refuses (Permanent) to delete an instance whose tags say it is
not ours; asking again every few minutes would never change that. The
memory provider's `refuse_delete` stands in for the tags: every delete of
that instance raises the Permanent error a provider raises on a tag
mismatch. Quota and provider trouble on a delete are still waited out for
ever (tests/workflows/test_lifecycle.py).
"""

from __future__ import annotations

import asyncio

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from contract import ErrorType
from providers.errors import Permanent
from tests.helpers.config import proxy_config
from tests.helpers.histories import record_history
from tests.helpers.stacks import StackFactory
from tests.helpers.tls_origin import TlsOrigin
from tests.helpers.waiting import (
    MONITOR_CANCEL_DEADLINE,
    QUICK_HEARTBEAT,
    status_of,
    wait_status,
)
from tests.workflows.test_pool_lifetimes import OneSquid, one_squid  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow

PROVIDER = "memory"


@pytest.mark.timeout(MONITOR_CANCEL_DEADLINE + 300)  # the wait below, and bringing it up
@pytest.mark.parametrize(
    "signal",
    [
        "terminate",  # the delete that ends the proxy
        "rotate",  # the old instance's, once the new one serves
    ],
)
async def test_refused_delete_fails_the_proxy_naming_the_instance_and_is_not_retried(
    signal: str,
    temporal_env: WorkflowEnvironment,
    provider_stack_on: StackFactory,
    one_squid: OneSquid,  # noqa: F811
    tls_origin: TlsOrigin,
) -> None:
    config = proxy_config(tls_origin.port, {"name": PROVIDER, "type": "memory"})
    stack = await provider_stack_on(temporal_env, {PROVIDER: one_squid}, config)
    health = stack.proxy_input(PROVIDER)["health"] | QUICK_HEARTBEAT
    handle = await stack.start(PROVIDER, health=health)
    ready = await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    refusal = f"delete {ready.provider_id}: refused, owner tag names proxy-someone-else"
    one_squid.refuse_delete(ready.provider_id, Permanent(refusal))

    await handle.signal(signal)
    with pytest.raises(WorkflowFailureError) as failure:
        # Before, the workflow retried the delete every 5 minutes and never ended.
        # The refused instance still serves, so the monitor ends only when its
        # next heartbeat brings the cancel.
        await asyncio.wait_for(handle.result(), MONITOR_CANCEL_DEADLINE)
    cause = failure.value.cause
    assert getattr(cause, "type", None) == ErrorType.PERMANENT, cause
    assert ready.instance in str(cause) and refusal in str(cause), cause

    status = await status_of(handle)
    assert status.state == "Failed" and status.endpoint == "", status
    assert ready.instance in (status.last_error or "") and refusal in (status.last_error or "")
    # Tried once, not again on a timer.
    timers = [
        event.user_metadata.summary.data.decode()
        async for event in handle.fetch_history_events()
        if event.event_type == EventType.EVENT_TYPE_TIMER_STARTED
    ]
    assert not [summary for summary in timers if "retry deleting" in summary], timers
    # The refused instance is left alone; whatever else the proxy made is gone.
    assert one_squid.ids() == {ready.provider_id}
    await record_history(handle, f"delete_refused_on_{signal}")
