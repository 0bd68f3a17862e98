"""ProxyLifecycle against a real dev server and real Squid processes."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from temporalio.client import WorkflowFailureError

from activities.probe import probe_connect
from providers.errors import Permanent, QuotaExceeded, Transient
from squid.procfs import running
from tests.helpers.config import PASSWORD, USERNAME
from tests.helpers.histories import record_history
from tests.helpers.stacks import Stack
from tests.helpers.waiting import DEADLINE, pending_activities, status_of, wait_for, wait_status
from workflows.lifecycle import ProxyStatus

pytestmark = pytest.mark.slow


async def test_ready_serves_then_terminate_deletes(stack: Stack) -> None:
    handle = await stack.start()
    status = await wait_status(handle, lambda s: s.state == "Ready", "Ready")

    host, port = status.endpoint.rsplit(":", 1)
    assert status.provider == "local" and status.provider_id == f"local/{status.instance}"
    assert status.last_probe is not None and status.last_probe.ok
    probe = await probe_connect(
        host,
        int(port),
        USERNAME,
        PASSWORD,
        stack.origin.url,
        ssl_context=stack.origin.client_ssl_context,
    )
    assert probe.ok, probe
    assert stack.instances() == [status.instance]

    async def listed_as_ready() -> bool:
        query = f"WorkflowId = '{handle.id}' AND ProxyState = 'Ready'"
        return [w.id async for w in stack.client.list_workflows(query)] == [handle.id]

    await wait_for(listed_as_ready, "visibility to list the proxy as Ready")

    await handle.signal("terminate", {"reason": "test done"})
    result = await handle.result()
    assert result["state"] == "Terminated" and result["reason"] == "test done"
    assert result["replacements"] == 0
    assert stack.instances() == []
    final = await status_of(handle)
    assert final.state == "Terminated" and final.endpoint == ""
    await record_history(handle, "ready_then_terminate_clean_stop")


async def test_transient_errors_are_retried_until_ready(stack: Stack) -> None:
    stack.provider.fail("create", Transient("503 from the API"), Transient("connection reset"))
    stack.provider.fail("get", Transient("timeout"))
    handle = await stack.start()
    await wait_status(handle, lambda s: s.state == "Ready", "Ready after transient errors")
    assert stack.provider.calls["create"] == 3
    assert len(stack.instances()) == 1
    await handle.signal("terminate")
    await handle.result()
    assert stack.instances() == []


async def test_permanent_error_fails_fast_with_the_providers_message(stack: Stack) -> None:
    stack.provider.fail("create", Permanent("invalid machine type 'e2-huge'"))
    handle = await stack.start()
    with pytest.raises(WorkflowFailureError) as failure:
        await asyncio.wait_for(handle.result(), timeout=30)
    assert "invalid machine type 'e2-huge'" in str(failure.value.cause)
    assert stack.provider.calls["create"] == 1
    assert (await status_of(handle)).state == "Failed"
    assert stack.instances() == []


async def test_instance_that_dies_while_ready_is_replaced(stack: Stack) -> None:
    handle = await stack.start()
    first = await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    pid = stack.pid_of(first.instance)
    os.kill(pid, signal.SIGKILL)
    second = await wait_status(
        handle,
        lambda s: s.state == "Ready" and s.generation == 1,
        "a replacement to become Ready",
    )
    assert second.instance != first.instance and second.replacements == 1
    await wait_for(lambda: stack.instances() == [second.instance], "the dead instance deleted")
    assert not running(pid)
    await handle.signal("terminate")
    await handle.result()
    assert stack.instances() == []
    await record_history(handle, "replaced_after_death")


async def test_terminate_during_provisioning_leaves_nothing(stack: Stack) -> None:
    stack.provider.create_gate.clear()
    handle = await stack.start()
    await wait_for(stack.provider.create_entered.is_set, "create to start")
    await handle.signal("terminate")
    await wait_status(handle, lambda s: s.state == "Terminating", "Terminating")
    stack.provider.create_gate.set()  # the slow create finishes after terminate
    result = await handle.result()
    assert result["state"] == "Terminated"
    assert stack.instances() == []
    await record_history(handle, "terminated_while_provisioning")


async def test_terminate_during_replacement_leaves_nothing(stack: Stack) -> None:
    handle = await stack.start()
    first = await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    stack.provider.create_gate.clear()
    stack.provider.create_entered.clear()
    os.kill(stack.pid_of(first.instance), signal.SIGKILL)
    await wait_for(stack.provider.create_entered.is_set, "the replacement's create to start")
    await handle.signal("terminate")
    stack.provider.create_gate.set()
    await handle.result()
    assert stack.instances() == []


async def test_cancel_deletes_the_instance(stack: Stack) -> None:
    handle = await stack.start()
    await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    await handle.cancel()
    with pytest.raises(WorkflowFailureError):
        await handle.result()
    assert stack.instances() == []
    assert (await status_of(handle)).state == "Terminated"
    await record_history(handle, "cancelled_clean_stop")


async def test_quota_waits_on_a_timer_and_says_so(stack: Stack) -> None:
    # The provider's own Retry-After is honoured; without one the wait is minutes.
    stack.provider.fail(
        "create", QuotaExceeded("Quota 'CPUS' exceeded in europe-west1", retry_after_seconds=3)
    )
    handle = await stack.start()
    waiting = await wait_status(
        handle, lambda s: (s.waiting_for or "").startswith("waiting for quota"), "quota wait"
    )
    assert waiting.state == "Provisioning" and "CPUS" in (waiting.waiting_for or "")
    assert stack.provider.calls["create"] == 1  # no hammering while quota is short
    ready = await wait_status(handle, lambda s: s.state == "Ready", "Ready once quota frees")
    assert ready.waiting_for is None and stack.provider.calls["create"] == 2
    await handle.signal("terminate")
    await handle.result()
    assert stack.instances() == []
    await record_history(handle, "quota_wait")


async def test_max_lifetime_rotates_make_before_break(stack: Stack) -> None:
    lifetime = 10
    handle = await stack.start(max_lifetime_seconds=lifetime)
    first = await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    seen_states: set[str] = set()

    def rotated(s: ProxyStatus) -> bool:
        seen_states.add(s.state)
        # Another instance serving, whatever its generation: on a busy machine
        # a rotation attempt can miss its first probe and be retried, which
        # is make-before-break working, not failing.
        return s.state == "Ready" and s.instance != first.instance

    # Nothing happens until the lifetime is up; from then on bringing up the
    # new Squid gets the same deadline as any other wait for Ready.
    second = await wait_status(
        handle, rotated, "the rotated instance Ready", deadline=lifetime + DEADLINE
    )
    # Every instance after the first counts as a replacement, a retried
    # rotation attempt included (docs/operations.md, status fields).
    assert second.generation >= 1 and second.replacements == second.generation
    # Make before break: the proxy never left Ready while rotating.
    assert seen_states == {"Ready"}
    await wait_for(lambda: stack.instances() == [second.instance], "the old instance deleted")
    await handle.signal("terminate")
    await handle.result()
    assert stack.instances() == []
    await record_history(handle, "rotated_clean_stop")


async def test_instance_lost_before_its_first_probe_is_replaced_without_waiting(
    stack: Stack,
) -> None:
    # Nothing listens on 127.0.0.2, so first probes keep failing (503 from Squid).
    unreachable = f"https://127.0.0.2:{stack.origin.port}/"
    handle = await stack.start(health={"target": unreachable, "interval_seconds": 1})
    first = await wait_status(handle, lambda s: bool(s.endpoint), "a running instance")

    # The endpoint shows as soon as the instance is created; on a busy machine
    # wait_running may still be polling it, and a kill then is a loss while
    # provisioning, another path. Kill only once the first probe is under way.
    async def probing() -> bool:
        return "wait_healthy" in await pending_activities(handle)

    await wait_for(probing, "the first probe under way")
    os.kill(stack.pid_of(first.instance), signal.SIGKILL)
    # Well inside the two minutes a first probe is given before the instance
    # is written off: the provider says it is gone, so it is replaced now.
    status = await wait_status(handle, lambda s: s.generation == 1, "a replacement", deadline=30)
    assert "while waiting for its first probe" in (status.last_error or "")
    assert stack.provider.calls["create"] == 2
    # Terminate lands while the replacement waits for its first probe: the
    # cancelled activity ends the lifecycle instead of counting as a failure.
    await handle.signal("terminate")
    await handle.result()
    assert stack.instances() == []
    await record_history(handle, "lost_before_first_probe_then_terminated")


async def test_terminate_while_rotation_deletes_the_old_instance(stack: Stack) -> None:
    handle = await stack.start(max_lifetime_seconds=10)
    await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    stack.provider.delete_gate.clear()  # the old instance's delete hangs
    await wait_for(stack.provider.delete_entered.is_set, "rotation to delete the old instance")
    await handle.signal("terminate")
    await wait_status(handle, lambda s: s.state == "Terminating", "Terminating")
    stack.provider.delete_gate.set()
    result = await asyncio.wait_for(handle.result(), timeout=60)
    assert result["state"] == "Terminated"
    assert stack.instances() == []


async def test_a_failing_first_probe_shows_in_status_until_it_is_written_off(
    stack: Stack,
) -> None:
    # Nothing listens on 127.0.0.2: Squid answers every CONNECT with 503.
    unreachable = f"https://127.0.0.2:{stack.origin.port}/"
    handle = await stack.start(health={"target": unreachable, "interval_seconds": 1})
    waiting = await wait_status(
        handle,
        lambda s: "attempts failed" in (s.waiting_for or ""),
        "the failing first probe in status",
    )
    assert waiting.state == "Provisioning" and waiting.endpoint
    assert waiting.last_probe is not None and not waiting.last_probe.ok
    assert (waiting.last_probe.attempts or 0) >= 1
    assert "written off in" in (waiting.waiting_for or "")
    assert str(waiting.last_probe.failure) in (waiting.waiting_for or "")
    seen = waiting.last_probe.attempts or 0

    def more_attempts(s: ProxyStatus) -> bool:
        return s.last_probe is not None and (s.last_probe.attempts or 0) > seen

    later = await wait_status(handle, more_attempts, "the attempts counting up")
    assert later.generation == 0 and later.failures_in_a_row == 0
    # Terminate interrupts the wait for the first probe.
    await handle.signal("terminate")
    await handle.result()
    assert stack.instances() == []
    await record_history(handle, "terminated_while_first_probe_failing")


async def test_a_replacements_quota_wait_shows_and_terminate_ends_it_at_once(
    stack: Stack,
) -> None:
    handle = await stack.start()
    first = await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    # No Retry-After: the quota wait is QUOTA_RETRY_DELAY, minutes.
    stack.provider.fail("create", QuotaExceeded("Quota 'CPUS' exceeded in europe-west1"))
    os.kill(stack.pid_of(first.instance), signal.SIGKILL)
    waiting = await wait_status(
        handle, lambda s: (s.waiting_for or "").startswith("waiting for quota"), "quota wait"
    )
    assert waiting.state == "Replacing" and waiting.last_error_at is not None
    # The dead instance's deletion finishes meanwhile; the quota wait still shows.
    await wait_for(lambda: stack.instances() == [], "the dead instance deleted")
    assert ((await status_of(handle)).waiting_for or "").startswith("waiting for quota")
    await handle.signal("terminate")
    # Well before the quota timer (3 minutes) would fire.
    result = await asyncio.wait_for(handle.result(), timeout=60)
    assert result["state"] == "Terminated"
    assert stack.provider.calls["create"] == 2  # nothing retried after terminate
    assert stack.instances() == []
    await record_history(handle, "terminated_during_replacement_quota_wait")
