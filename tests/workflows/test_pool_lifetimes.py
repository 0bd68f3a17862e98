"""Pool members' lifetimes on the dev server: rolling rotation and continue-as-new, end to end.

What the pool plans (jitter, surge, rotation order, spread) is unit-tested in
test_pool_plan.py; these two check what only real members show: rotations
that end when a member's new instance is Ready, read from the members' own
histories, and members that live on across the pool's continue-as-new.

The time-skipping server cannot skip time while an activity runs, and every
Ready member runs its monitor, so lifetimes are tested here with short ones
(as for ProxyLifecycle, tests/workflows/test_lifecycle.py).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from contract import (
    ENDPOINTS_DIGEST_MEMO,
    MEMBER_CHANGED_SIGNAL,
    ROTATE_SIGNAL,
    TERMINATE_SIGNAL,
    ProxyState,
)
from providers.base import CreateRequest, InstanceState
from providers.local import LocalProvider
from providers.memory import MemoryProvider
from providers.naming import instance_name, owner_tags
from tests.helpers.config import (
    INSTALLATION,
    build_config,
    local_settings,
)
from tests.helpers.histories import record_history
from tests.helpers.run_chain import run_histories, signal_until_continued, signal_until_length
from tests.helpers.stacks import Stack, StackFactory
from tests.helpers.temporal import start_dev_server
from tests.helpers.tls_origin import TlsOrigin
from tests.helpers.waiting import DEADLINE, wait_for
from tests.workflows.test_continue_as_new import (  # noqa: F401 (a fixture)
    SUGGESTED_AT,
    eager_can_env,
)
from workflows.pool_budget import EVENTS_PER_COMMAND, POOL_EVENT_BUDGET
from workflows.pool_plan import COMMAND_BATCH

pytestmark = pytest.mark.slow


class OneSquid(MemoryProvider):
    """Instances in memory, every one of them served by the same real Squid."""

    def __init__(self, address: tuple[str, int]) -> None:
        super().__init__()
        self._address = address

    def address(self, req: CreateRequest) -> tuple[str, int]:
        return self._address


@pytest.fixture
async def one_squid(tls_origin: TlsOrigin, state_dir: Any) -> AsyncIterator[OneSquid]:
    config = build_config(_memory_entry(), connect_ports=[443, tls_origin.port])
    local = LocalProvider(local_settings(state_dir), config.installation)
    owner = "pool-test-squid"
    squid = local.create(
        CreateRequest(
            name=instance_name(owner, 0, installation=INSTALLATION),
            proxy=config.proxy_settings(),
            tags=owner_tags(INSTALLATION, owner, 0),
        )
    )
    await wait_for(lambda: local.get(squid.provider_id).state is InstanceState.RUNNING, "Squid")
    yield OneSquid((squid.ip, squid.port))
    local.delete(squid.provider_id)


def _memory_entry() -> dict[str, Any]:
    return {"name": "memory", "type": "memory"}


async def test_twenty_members_never_rotate_together(
    temporal_env: WorkflowEnvironment,
    provider_stack_on: StackFactory,
    one_squid: OneSquid,
    tls_origin: TlsOrigin,
) -> None:
    stack, handle = await _short_lived_pool(
        temporal_env, provider_stack_on, one_squid, tls_origin, replicas=20, lifetime_jitter=0.5
    )
    members = [f"{handle.id}/{n}" for n in range(20)]

    async def all_rotated() -> bool:
        status = await handle.query("status")
        if len(status["members"]) < 20 or any(m["generation"] < 1 for m in status["members"]):
            return False
        for member in members:
            if not await _rotations(stack.client.get_workflow_handle(member)):
                return False
        return True

    await wait_for(all_rotated, "every member rotated once", deadline=180)
    rotations = [
        span
        for member in members
        for span in await _rotations(stack.client.get_workflow_handle(member))
    ]
    assert len(rotations) >= 20, await handle.query("status")
    rotations.sort()
    for (_, end), (start, _) in itertools.pairwise(rotations):
        assert end <= start, f"two members rotating at once: {rotations}"
    # Jitter spread the first rotations over the lifetime's window.
    firsts = sorted(
        [(await _rotations(stack.client.get_workflow_handle(m)))[0][0] for m in members]
    )
    assert (firsts[-1] - firsts[0]).total_seconds() >= 5
    await handle.signal("terminate")
    assert (await handle.result())["state"] == "Terminated"
    assert one_squid.ids() == set()


async def test_a_percentage_surge_rotates_that_many_members_at_once_and_no_more(
    temporal_env: WorkflowEnvironment,
    provider_stack_on: StackFactory,
    one_squid: OneSquid,
    tls_origin: TlsOrigin,
) -> None:
    """Six members falling due together, `max_surge: "50%"`: three rotate at once, never four."""
    stack, handle = await _short_lived_pool(
        temporal_env,
        provider_stack_on,
        one_squid,
        tls_origin,
        replicas=6,
        lifetime_jitter=0,
        max_surge="50%",
    )
    members = [stack.client.get_workflow_handle(f"{handle.id}/{n}") for n in range(6)]

    async def all_rotated() -> bool:
        status = await handle.query("status")  # (members exist before their histories are read)
        if len(status["members"]) < 6 or any(m["generation"] < 1 for m in status["members"]):
            return False
        return all([await _rotations(member) for member in members])

    await wait_for(all_rotated, "every member rotated once", deadline=180)
    spans = [span for member in members for span in await _rotations(member)]
    most = max(len([s for s in spans if s[0] <= at < s[1]]) for at, _ in spans)
    assert 2 <= most <= 3, f"{most} rotations at once: {sorted(spans)}"
    status = await handle.query("status")
    assert status["rotations_abandoned"] == 0
    await handle.signal("terminate")
    assert (await handle.result())["state"] == "Terminated"


async def _short_lived_pool(
    env: WorkflowEnvironment,
    provider_stack_on: StackFactory,
    squid: OneSquid,
    tls_origin: TlsOrigin,
    **pool_fields: Any,
) -> tuple[Stack, WorkflowHandle[Any, Any]]:
    """A pool of members on one Squid that live 20 s each, started with `pool_fields`."""
    config = build_config(_memory_entry(), connect_ports=[443, tls_origin.port])
    stack = await provider_stack_on(env, {"memory": squid}, config)
    template = stack.proxy_input(
        "memory",
        max_lifetime_seconds=20,
        # Many members probe one Squid: not every second on a busy machine.
        health={"target": tls_origin.url, "interval_seconds": 5, "failure_threshold": 3},
    )
    handle = await stack.client.start_workflow(
        "ProxyPool",
        {"template": template, **pool_fields},
        id=f"pool-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
    )
    stack.handles.append(handle)
    return stack, handle


async def _rotations(member: WorkflowHandle[Any, Any]) -> list[tuple[datetime, datetime]]:
    """(rotate signal received, new instance's first probe passed) from a member's history."""
    spans: list[tuple[datetime, datetime]] = []
    started: datetime | None = None
    probe_scheduled: int | None = None
    async for event in member.fetch_history_events():
        at = event.event_time.ToDatetime(tzinfo=UTC)
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
            if event.workflow_execution_signaled_event_attributes.signal_name == "rotate":
                started = started or at
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            name = event.activity_task_scheduled_event_attributes.activity_type.name
            if started is not None and name == "wait_healthy":
                probe_scheduled = event.event_id
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            attrs = event.activity_task_completed_event_attributes
            if started is not None and attrs.scheduled_event_id == probe_scheduled:
                spans.append((started, at))
                started = probe_scheduled = None
    return spans


async def continued_as_new(handle: WorkflowHandle[Any, Any]) -> str:
    """Wait until the pool's current run continues as new; return that run's id."""
    first_run = (await handle.describe()).run_id

    async def continued() -> bool:
        return (await handle.describe()).run_id != first_run

    await wait_for(continued, "the pool's continue-as-new", deadline=120)
    return first_run


async def test_members_live_on_across_the_pools_continue_as_new(
    eager_can_env: WorkflowEnvironment,  # noqa: F811 (the fixture imported above)
    stack_on: Callable[[WorkflowEnvironment], Awaitable[Stack]],
) -> None:
    stack = await stack_on(eager_can_env)
    pool_id = f"pool-{uuid.uuid4().hex[:8]}"
    handle = await stack.client.start_workflow(
        "ProxyPool",
        # No drain: each old instance goes as soon as its successor is Ready,
        # so "one instance per member" is a moment this test can see.
        {"replicas": 2, "template": stack.proxy_input(max_lifetime_seconds=10, drain_seconds=0)},
        id=pool_id,
        task_queue=stack.task_queue,
    )
    await continued_as_new(handle)
    members = [stack.client.get_workflow_handle(f"{pool_id}/{n}") for n in range(2)]
    for member in members:
        described = await member.describe()
        assert described.status is not None and described.status.name == "RUNNING"

    async def two_ready_rotated() -> bool:
        status = await handle.query("status")
        return bool(
            status["ready"] == 2
            and [m["member"] for m in status["members"]] == [m.id for m in members]
            and all(m["generation"] >= 2 for m in status["members"])
        )

    # The new run keeps the same members, and keeps rotating them.
    await wait_for(two_ready_rotated, "the same two members Ready and rotating", deadline=90)
    await wait_for(lambda: len(stack.instances()) == 2, "one instance per member")
    await handle.signal("terminate")
    try:
        result = await asyncio.wait_for(handle.result(), DEADLINE)
    except TimeoutError:
        # Seen once with both cores loaded: say where the pool was stuck.
        statuses = [await handle.query("status")]
        statuses += [await m.query("status") for m in members]
        raise AssertionError(f"the pool did not end in {DEADLINE}s: {statuses}") from None
    assert result["state"] == "Terminated"
    assert stack.instances() == []


async def test_a_pool_hands_over_only_once_the_members_it_started_have_reported_ready(
    stack_on: Callable[[WorkflowEnvironment], Awaitable[Stack]],
) -> None:
    """A continue-as-new crossed by a member's report is refused by the server
    (UnhandledCommand) and the worker replays the whole run: seconds at 1,000
    members. So a pool holding to hand over waits for the reports it knows
    are coming. Continue-as-new is suggested here after 10 events, long
    before 3 new Squids are Ready: without the wait the first run hands over
    while they still provision.
    """
    env = await start_dev_server(
        "--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=10"
    )
    try:
        stack = await stack_on(env)
        pool_id = f"pool-{uuid.uuid4().hex[:8]}"
        handle = await stack.client.start_workflow(
            "ProxyPool",
            {"replicas": 3, "template": stack.proxy_input()},
            id=pool_id,
            task_queue=stack.task_queue,
        )
        first_run = await continued_as_new(handle)
        first = stack.client.get_workflow_handle(pool_id, run_id=first_run)
        ready: set[str] = set()
        async for event in first.fetch_history_events():
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
                break
            signaled = event.workflow_execution_signaled_event_attributes
            if signaled.signal_name == MEMBER_CHANGED_SIGNAL:
                report = json.loads(signaled.input.payloads[0].data)
                if report["state"] == ProxyState.READY:
                    ready.add(report["member"])
        assert ready == {f"{pool_id}/{n}" for n in range(3)}
        await record_history(first, "pool_quiet_handover")
        await handle.signal("terminate")
        result = await asyncio.wait_for(handle.result(), DEADLINE)
        assert result["state"] == "Terminated"
        assert stack.instances() == []
    finally:
        await env.shutdown()


async def test_an_update_retried_after_the_pools_continue_as_new_applies_once(
    eager_can_env: WorkflowEnvironment,  # noqa: F811 (the fixture imported above)
    stack_on: Callable[[WorkflowEnvironment], Awaitable[Stack]],
) -> None:
    """Temporal refuses a repeated update id within a run only; the pool remembers across runs.

    A client that retries `scale` (or `rotate`, `report_ban`) with the same
    update id after the pool continued as new gets the first result back,
    and the pool does not apply it again.
    """
    stack = await stack_on(eager_can_env)
    handle = await stack.client.start_workflow(
        "ProxyPool",
        {"replicas": 1, "template": stack.proxy_input(max_lifetime_seconds=10, drain_seconds=0)},
        id=f"pool-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
    )

    async def ready() -> bool:
        return bool((await handle.query("status"))["ready"] == 1)

    await wait_for(ready, "the member Ready")
    first = await handle.execute_update("scale", {"replicas": 2}, id="scale-to-two")
    assert first == {"replicas": 2, "previous": 1}
    await continued_as_new(handle)
    assert await handle.execute_update("scale", {"replicas": 1}, id="scale-back") == {
        "replicas": 1,
        "previous": 2,
    }
    retried = await handle.execute_update("scale", {"replicas": 2}, id="scale-to-two")
    assert retried == first
    assert (await handle.query("status"))["replicas"] == 1, "the retry was applied again"
    await handle.signal("terminate")
    assert (await asyncio.wait_for(handle.result(), DEADLINE))["state"] == "Terminated"
    assert stack.instances() == []


async def test_a_pool_flooded_with_reports_it_ignores_hands_over_to_a_new_run(
    eager_can_env: WorkflowEnvironment,  # noqa: F811 (the fixture imported above)
    stack_on: Callable[[WorkflowEnvironment], Awaitable[Stack]],
) -> None:
    """Reports about members the pool does not have (anyone may send them) are
    ignored, but each is an event: a run they lengthen past its budget (its own
    POOL_EVENT_BUDGET, or here the server's suggestion) hands over at once,
    not at the pool's next timer, an hour away in a calm pool.
    """
    stack = await stack_on(eager_can_env)
    handle = await _pool_of_one_ready(stack)
    await signal_until_continued(
        handle, MEMBER_CHANGED_SIGNAL, _stranger, settled_under=SUGGESTED_AT
    )
    # The next run keeps the member, and ignored what was no report of one.
    await wait_for(functools.partial(_one_ready, handle), "the member Ready in the next run")
    status = await handle.query("status")
    assert [m["member"] for m in status["members"]] == [f"{handle.id}/0"]
    assert status["rejected_reports"] == 0
    # Its endpoints' digest came with it: no upsert, and a gateway sees no change.
    started, upserts = await _digest_at_start_and_upserts(handle)
    assert started is not None and upserts == 0
    await _terminated(stack, handle)


async def _digest_at_start_and_upserts(handle: WorkflowHandle[Any, Any]) -> tuple[Any, int]:
    """The endpoints' digest in the pool's current run's memo at its start, and the
    run's memo upserts since (workflows/pool_feed.py)."""
    started, upserts = None, 0
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
            memo = event.workflow_execution_started_event_attributes.memo.fields
            if ENDPOINTS_DIGEST_MEMO in memo:
                started = json.loads(memo[ENDPOINTS_DIGEST_MEMO].data)
        upserts += event.event_type == EventType.EVENT_TYPE_WORKFLOW_PROPERTIES_MODIFIED
    return started, upserts


async def test_a_pool_hands_over_past_its_own_event_budget(stack: Stack) -> None:
    """The dev server suggests a continue-as-new only near 4,000 events; a pool
    hands over soon after POOL_EVENT_BUDGET, so a worker that must replay its
    run (after a restart) replays at most that many events and a few more."""
    handle = await _pool_of_one_ready(stack)
    first_run = (await handle.describe()).run_id
    await signal_until_continued(
        handle, MEMBER_CHANGED_SIGNAL, _stranger, settled_under=POOL_EVENT_BUDGET, most=1_000
    )
    handed_over = await stack.client.get_workflow_handle(handle.id, run_id=first_run).describe()
    length = handed_over.raw_description.workflow_execution_info.history_length
    # The signals come in bursts of 10, each taken in a task of its own (3
    # events), and the continue-as-new is the run's last event.
    assert POOL_EVENT_BUDGET <= length <= POOL_EVENT_BUDGET + 20, length
    await wait_for(functools.partial(_one_ready, handle), "the member Ready in the next run")
    await _terminated(stack, handle)


async def test_a_surge_started_near_the_budget_fits_the_events_left(
    temporal_env: WorkflowEnvironment,
    provider_stack_on: StackFactory,
    one_squid: OneSquid,
    tls_origin: TlsOrigin,
) -> None:
    """`rotate {"all": true}` at a 100% surge, when the run has room for about 10
    rotations before its budget: the run starts about those (more as the
    first ones end, each in fewer events than the estimate), the next run the
    rest, so the run stays near POOL_EVENT_BUDGET and a worker replaying it
    replays no more. Before 0.3.8 all 60 went at once, and the run held until
    every one had reported: about 60 x 4 events past the room it had."""
    config = build_config(_memory_entry(), connect_ports=[443, tls_origin.port])
    stack = await provider_stack_on(temporal_env, {"memory": one_squid}, config)
    replicas, room = COMMAND_BATCH + 10, 10
    # Many members probe one Squid: not every second on a busy machine.
    health = {"target": tls_origin.url, "interval_seconds": 5, "failure_threshold": 3}
    handle = await stack.client.start_workflow(
        "ProxyPool",
        {
            "replicas": replicas,
            "max_surge": "100%",
            "template": stack.proxy_input("memory", health=health),
        },
        id=f"pool-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
    )
    stack.handles.append(handle)

    async def generations_at_least(least: int) -> bool:
        status = await handle.query("status", {"limit": replicas})
        members = [m for m in status["members"] if m["state"] == "Ready"]
        return len(members) == replicas and all(m["generation"] >= least for m in members)

    await wait_for(functools.partial(generations_at_least, 0), "every member Ready", deadline=180)
    near = POOL_EVENT_BUDGET - room * EVENTS_PER_COMMAND
    run_id = await signal_until_length(handle, MEMBER_CHANGED_SIGNAL, _stranger, length=near)
    await handle.execute_update("rotate", {"all": True})
    await wait_for(functools.partial(generations_at_least, 1), "every member rotated", deadline=180)
    runs = [events async for events in run_histories(stack.client, handle.id, run_id)]
    told = [len(_sent(events, ROTATE_SIGNAL)) for events in runs]
    assert sum(told) == replicas and told[0] < replicas, told
    # The few events a rotation writes beyond the estimate, and the handover's.
    assert len(runs[0]) <= POOL_EVENT_BUDGET + 4 * EVENTS_PER_COMMAND, (len(runs[0]), told)
    surge_run = stack.client.get_workflow_handle(handle.id, run_id=run_id)
    await record_history(surge_run, "pool_surge_within_budget")
    await handle.signal("terminate")
    assert (await asyncio.wait_for(handle.result(), DEADLINE))["state"] == "Terminated"
    assert one_squid.ids() == set()


async def _pool_of_one_ready(stack: Stack) -> WorkflowHandle[Any, Any]:
    """A pool of one member, once that member is Ready."""
    handle = await stack.client.start_workflow(
        "ProxyPool",
        {"replicas": 1, "template": stack.proxy_input()},
        id=f"pool-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
    )
    await wait_for(functools.partial(_one_ready, handle), "the member Ready")
    return handle


async def _one_ready(handle: WorkflowHandle[Any, Any]) -> bool:
    return bool((await handle.query("status"))["ready"] == 1)


async def _terminated(stack: Stack, handle: WorkflowHandle[Any, Any]) -> None:
    """Terminate the pool; it ends Terminated, and no instance is left."""
    await handle.signal("terminate")
    assert (await asyncio.wait_for(handle.result(), DEADLINE))["state"] == "Terminated"
    assert stack.instances() == []


async def test_an_ending_pool_past_its_budget_hands_over_and_ends_every_member_once(
    eager_can_env: WorkflowEnvironment,  # noqa: F811 (the fixture imported above)
    provider_stack_on: StackFactory,
    one_squid: OneSquid,
    tls_origin: TlsOrigin,
) -> None:
    """Ending 1,000 members writes thousands of events; past its budget (here the
    server's suggestion, at 40) an ending pool stops telling members, waits for
    those told to end and continues as new, its reason carried; the next run
    tells the rest. More members than one batch of signals, so the telling
    spans runs: each member is told once, all end, and no handover is refused
    for a report crossing it (a failed task).
    """
    config = build_config(_memory_entry(), connect_ports=[443, tls_origin.port])
    stack = await provider_stack_on(eager_can_env, {"memory": one_squid}, config)
    replicas = COMMAND_BATCH + 10
    # The shortest heartbeat timeout: a handover waits for the monitor's
    # shards to end, which they do at their next heartbeat.
    health = {"target": tls_origin.url, "interval_seconds": 5, "heartbeat_timeout_seconds": 30}
    template = stack.proxy_input("memory", health=health)
    handle = await stack.client.start_workflow(
        "ProxyPool",
        {"replicas": replicas, "template": template},
        id=f"pool-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
    )
    stack.handles.append(handle)

    async def ready() -> bool:
        return bool((await handle.query("status"))["ready"] == replicas)

    await wait_for(ready, "every member Ready", deadline=180)
    await handle.signal(TERMINATE_SIGNAL, {"reason": "end of the crawl"})
    # What the pool tells its members; a later run may also tell one that has
    # just ended "not a member", as visibility still lists it running: harmless.
    why = "pool: end of the crawl"
    result = await asyncio.wait_for(handle.result(), 180)
    assert (result["state"], result["reason"]) == ("Terminated", "end of the crawl")
    assert one_squid.ids() == set()
    told_by_run: list[list[str]] = []
    refused: list[str] = []
    ending = False
    handed_over: str | None = None  # the first run that told members and handed over
    run_id = handle.first_execution_run_id
    assert run_id is not None
    async for events in run_histories(stack.client, handle.id, run_id):
        ending = ending or any(
            e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
            and e.workflow_execution_signaled_event_attributes.signal_name == TERMINATE_SIGNAL
            for e in events
        )
        continued = events[-1].workflow_execution_continued_as_new_event_attributes
        if ending:
            # A bring-up's handover may be refused once its hold ran out; an end's never.
            refused += [
                e.workflow_task_failed_event_attributes.failure.message
                for e in events
                if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
            ]
            sent = _sent(events, TERMINATE_SIGNAL)
            told_by_run.append([member for member, body in sent if body["reason"] == why])
            if told_by_run[-1] and continued.new_execution_run_id and handed_over is None:
                handed_over = run_id
        run_id = continued.new_execution_run_id
    assert len([told for told in told_by_run if told]) > 1, f"told in one run: {told_by_run}"
    told_all = sorted(member for told in told_by_run for member in told)
    assert told_all == sorted(f"{handle.id}/{n}" for n in range(replicas)), told_by_run
    assert refused == []
    await record_history(handle, "pool_ended_across_runs")
    assert handed_over is not None
    handover = stack.client.get_workflow_handle(handle.id, run_id=handed_over)
    await record_history(handover, "pool_ending_handed_over")


def _sent(events: list[HistoryEvent], signal: str) -> list[tuple[str, Any]]:
    """The `signal` signals a run sent: (workflow id, input)."""
    sent = []
    for event in events:
        attributes = event.signal_external_workflow_execution_initiated_event_attributes
        if (
            event.event_type == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED
            and attributes.signal_name == signal
        ):
            body = json.loads(attributes.input.payloads[0].data)
            sent.append((attributes.workflow_execution.workflow_id, body))
    return sent


def _stranger(n: int) -> dict[str, Any]:
    """A well-formed report of a member no pool has."""
    return {
        "member": f"nobody/{n}",
        "state": ProxyState.READY,
        "endpoint": "127.0.0.1:9",
        "provider": "local",
        "generation": 0,
        "ready_since": None,
        "at": datetime.now(UTC).isoformat(),
        "seq": n,
    }
