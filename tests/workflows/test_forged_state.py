"""Forged continue-as-new state, as an attacker with only `workflow start` rights sends it.

Both workflows take a second argument that only their own continue-as-new
may pass. Taken from a client, it would make a ProxyLifecycle probe the
instance it named (sending the fleet's password to any address) and delete
the instances it listed, and an OrphanGC delete the candidates it listed
without surveying them. Each must fail at once as invalid input, before
any activity runs.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from activities.gc import GcActivities
from activities.provider import ProviderActivities
from contract import ErrorType
from providers.memory import MemoryProvider
from tests.helpers.config import build_config
from tests.helpers.histories import record_history
from tests.helpers.loopback_peer import LoopbackPeer, loopback_peer
from tests.helpers.stacks import Stack
from tests.helpers.waiting import wait_for, wait_status
from tests.helpers.workers import running
from worker import build_worker

pytestmark = pytest.mark.slow

# The marker the SDK records for a local activity's result (patches record
# markers too, under another name).
LOCAL_ACTIVITY_MARKER = "core_local_activity"


@pytest.fixture
def listener() -> Iterator[LoopbackPeer]:
    """Where the forged state points: it records any CONNECT the worker sends it."""
    with loopback_peer() as peer:
        yield peer


def forged_ref(name: str, port: int = 3999) -> dict[str, Any]:
    return {
        "provider": "local",
        "provider_id": f"local/{name}",
        "name": name,
        "generation": 0,
        "ip": "127.0.0.1",
        "port": port,
    }


async def invalid_input(handle: WorkflowHandle[Any, Any]) -> ApplicationError:
    """The workflow's failure, which must come at once and be InvalidInput."""
    with pytest.raises(WorkflowFailureError) as failure:
        await asyncio.wait_for(handle.result(), timeout=30)
    cause = failure.value.cause
    assert isinstance(cause, ApplicationError), cause
    assert cause.type == ErrorType.INVALID_INPUT
    return cause


async def activities_run(handle: WorkflowHandle[Any, Any]) -> list[str]:
    """Every activity and local activity the workflow ran, by type name."""
    ran: list[str] = []
    for event in (await handle.fetch_history()).events:
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            ran.append(event.activity_task_scheduled_event_attributes.activity_type.name)
        elif event.marker_recorded_event_attributes.marker_name == LOCAL_ACTIVITY_MARKER:
            ran.append("local activity")
    return ran


async def test_forged_current_instance_never_gets_the_fleet_password(
    stack: Stack, listener: LoopbackPeer
) -> None:
    """A forged instance must not make the monitor CONNECT to 127.0.0.1:<port> with auth."""
    forged = {"status": {}, "current": forged_ref("x", listener.port)}
    handle = await stack.client.start_workflow(
        "ProxyLifecycle",
        args=[stack.proxy_input(), forged],
        id=f"proxy-{uuid.uuid4().hex[:10]}",
        task_queue=stack.task_queue,
    )

    cause = await invalid_input(handle)

    assert "argument 2: carried state is accepted only from this workflow's own" in cause.message
    assert await activities_run(handle) == []
    assert listener.requests == []
    assert stack.instances() == []
    await record_history(handle, "forged_carried_state")


async def test_forged_owned_list_deletes_nobody_elses_instance(stack: Stack) -> None:
    victim = await stack.start()
    ready = await wait_status(victim, lambda s: s.state == "Ready", "the victim Ready")
    forged = {"status": {}, "owned": [forged_ref(ready.instance)]}
    handle = await stack.client.start_workflow(
        "ProxyLifecycle",
        args=[stack.proxy_input(), forged],
        id=f"proxy-{uuid.uuid4().hex[:10]}",
        task_queue=stack.task_queue,
    )

    await invalid_input(handle)

    assert await activities_run(handle) == []
    assert {"local activity", "create_instance"} <= set(await activities_run(victim))
    assert stack.instances() == [ready.instance]
    after = await wait_status(victim, lambda s: s.state == "Ready", "the victim still Ready")
    assert after.provider_id == ready.provider_id
    await victim.signal("terminate")
    await victim.result()


async def test_extra_arguments_fail_naming_each(stack: Stack) -> None:
    handle = await stack.client.start_workflow(
        "ProxyLifecycle",
        args=[stack.proxy_input(), None, "three", {"four": 4}],
        id=f"proxy-{uuid.uuid4().hex[:10]}",
        task_queue=stack.task_queue,
    )

    cause = await invalid_input(handle)

    assert "argument 3: unexpected extra argument" in cause.message
    assert "argument 4: unexpected extra argument" in cause.message
    assert await activities_run(handle) == []


async def test_a_retry_never_honours_the_carried_state_of_its_first_attempt(
    temporal_env: WorkflowEnvironment, stack_on: Any, listener: LoopbackPeer
) -> None:
    """A retry is 'continued' from the failed attempt but starts from the starter's arguments.

    The first attempt times out before any worker sees it, so the server
    retries it with the same (forged) arguments and a continued run id.
    """
    forged = {"status": {}, "current": forged_ref("x", listener.port)}
    task_queue = f"test-{uuid.uuid4().hex[:12]}"
    handle = await temporal_env.client.start_workflow(
        "ProxyLifecycle",
        args=[{"provider": "local"}, forged],
        id=f"proxy-{uuid.uuid4().hex[:10]}",
        task_queue=task_queue,
        # Each run's limit: the first, with no worker, times out and is
        # retried; the retry must fail on its input within it, which took
        # over 1 s with both cores busy.
        run_timeout=timedelta(seconds=15),
        retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=2),
    )

    async def retried() -> bool:
        return (await handle.describe()).run_id != handle.first_execution_run_id

    await wait_for(retried, "the timed-out first attempt to be retried")
    stack: Stack = await stack_on(temporal_env, task_queue=task_queue)
    retry = stack.client.get_workflow_handle(handle.id)

    cause = await invalid_input(retry)

    assert "argument 2: carried state is accepted only" in cause.message
    started = (await retry.fetch_history()).events[0].workflow_execution_started_event_attributes
    assert started.attempt == 2 and started.continued_execution_run_id
    assert await activities_run(retry) == []
    assert listener.requests == []


async def test_forged_gc_progress_deletes_nothing(temporal_env: WorkflowEnvironment) -> None:
    """Forged candidates must not go straight to confirm and delete, with no survey."""
    provider = MemoryProvider()
    config = build_config({"name": "mem", "type": "memory"}, connect_ports=[443])
    victim = provider.add(config.installation, f"owner-{uuid.uuid4().hex}", 0)
    acts = ProviderActivities({"mem": provider}, config)
    gc = GcActivities({"mem": provider}, config.installation, temporal_env.client)
    task_queue = f"gc-{uuid.uuid4().hex[:12]}"
    candidate = {
        "provider": "mem",
        "provider_id": victim.provider_id,
        "name": victim.name,
        "owner": "",
        "generation": 0,
        "created_at": victim.created_at.isoformat(),
    }
    forged = {"sweeps": [{"provider": "mem"}], "pending": [candidate]}
    async with running(build_worker(temporal_env.client, acts, gc=gc, task_queue=task_queue)):
        handle = await temporal_env.client.start_workflow(
            "OrphanGC",
            args=[{"grace_period_seconds": 0}, forged],
            id=f"orphan-gc-{uuid.uuid4().hex[:8]}",
            task_queue=task_queue,
        )
        cause = await invalid_input(handle)
    acts.close()

    assert "argument 2: carried state is accepted only" in cause.message
    assert await activities_run(handle) == []
    assert provider.ids() == {victim.provider_id}
