"""OrphanGC end to end: a real dev server, real workers, and two kinds of fleet.

With the local provider, every instance is a real Squid and every owner a real
ProxyLifecycle. For scale and adversity, the in-memory stand-in provider holds
hundreds of instances whose owners are bare Temporal executions in every
state, while new owners keep appearing during the sweep.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import timedelta
from typing import Any

import pytest
from prometheus_client import REGISTRY
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from activities import gc as gc_activities
from activities.gc import GcActivities
from activities.provider import ProviderActivities
from providers.base import CreateRequest, Instance, Provider
from providers.config import Config
from providers.errors import Permanent
from providers.local import LocalProvider
from providers.memory import MemoryProvider
from providers.naming import instance_name, owner_tags
from tests.fakes.owners import start_owner
from tests.helpers.config import local_settings, stack_config
from tests.helpers.histories import record_history
from tests.helpers.stacks import Stack
from tests.helpers.waiting import status_of, wait_for, wait_status
from tests.helpers.workers import stop_worker
from worker import build_worker
from workflows.orphan_gc import MAX_PER_RUN, GcResult

pytestmark = pytest.mark.slow

StartGcWorker = Callable[[Mapping[str, Provider], Config], str]


@pytest.fixture
async def gc_worker(temporal_env: WorkflowEnvironment) -> AsyncIterator[StartGcWorker]:
    """`gc_worker(providers, config)` starts a worker serving OrphanGC; returns its queue."""
    workers = []
    activities: list[ProviderActivities] = []

    def start(providers: Mapping[str, Provider], config: Config) -> str:
        task_queue = f"gc-{uuid.uuid4().hex[:12]}"
        acts = ProviderActivities(providers, config)
        gc = GcActivities(providers, config.installation, temporal_env.client)
        worker = build_worker(temporal_env.client, acts, gc=gc, task_queue=task_queue)
        asyncio.get_running_loop().create_task(worker.run())
        workers.append(worker)
        activities.append(acts)
        return task_queue

    yield start
    for worker in workers:
        await stop_worker(worker)
    for acts in activities:
        acts.close()


async def sweep(client: Client, task_queue: str, **inp: Any) -> GcResult:
    result: GcResult = await client.execute_workflow(
        "OrphanGC",
        inp,
        id=f"orphan-gc-{uuid.uuid4().hex[:8]}",
        task_queue=task_queue,
        result_type=GcResult,
    )
    return result


def create_directly(stack: Stack, owner: str, generation: int, installation: str) -> Instance:
    """An instance made without a workflow, tagged as `owner`'s generation.

    Another installation's instance is made by that installation's provider
    over the same state_dir: the stack's provider refuses foreign tags.
    """
    provider: Provider = stack.provider
    if installation != stack.config.installation:
        provider = LocalProvider(local_settings(stack.state_dir), installation)
    return provider.create(
        CreateRequest(
            name=instance_name(owner, generation),
            proxy=stack.config.proxy_settings(),
            tags=owner_tags(installation, owner, generation, namespace=stack.client.namespace),
        )
    )


# ---- the local provider: real Squid, real lifecycles ----------------------------------


async def test_sweep_deletes_every_orphan_keeps_the_owned_and_dry_run_agrees(
    stack: Stack, gc_worker: StartGcWorker
) -> None:
    installation = stack.config.installation
    ready = await stack.start()
    current = await wait_status(ready, lambda s: s.state == "Ready", "Ready")
    ended = await stack.start()
    ended_status = await wait_status(ended, lambda s: s.state == "Ready", "Ready")
    await ended.terminate()  # `temporal workflow terminate`: no cleanup runs
    never, old_generation, foreign = await asyncio.gather(
        asyncio.to_thread(create_directly, stack, f"never-{uuid.uuid4().hex}", 0, installation),
        asyncio.to_thread(create_directly, stack, ready.id, current.generation + 5, installation),
        asyncio.to_thread(create_directly, stack, f"theirs-{uuid.uuid4().hex}", 0, "other"),
    )
    orphans = {ended_status.provider_id, never.provider_id, old_generation.provider_id}
    everything = sorted(
        [current.instance, ended_status.instance, never.name, old_generation.name, foreign.name]
    )
    task_queue = gc_worker({"local": stack.provider}, stack.config)
    found, deleted = counter("found"), counter("deleted")

    dry = await sweep(stack.client, task_queue, dry_run=True, grace_period_seconds=0)

    [local] = dry.providers
    assert set(local.orphans) == orphans
    assert "terminated" in local.orphans[ended_status.provider_id]
    assert "does not exist" in local.orphans[never.provider_id]
    assert "no longer uses generation" in local.orphans[old_generation.provider_id]
    assert (local.seen, local.owned, local.orphaned, local.deleted) == (4, 1, 3, 0)
    assert stack.instances() == everything

    handle = await stack.client.start_workflow(
        "OrphanGC",
        {"grace_period_seconds": 0},
        id=f"orphan-gc-{uuid.uuid4().hex[:8]}",
        task_queue=task_queue,
        result_type=GcResult,
    )
    real = await handle.result()

    [local] = real.providers
    assert set(local.orphans) == orphans
    assert set(local.deleted_ids) == orphans
    assert (local.seen, local.owned, local.orphaned, local.deleted) == (4, 1, 3, 3)
    assert (local.skipped, local.failed, local.error) == (0, 0, "")
    assert stack.instances() == sorted([current.instance, foreign.name])
    after = await status_of(ready)
    assert (after.state, after.provider_id) == ("Ready", current.provider_id)
    details = await _current_details(handle)
    assert "| local | 4 | 1 | 3 | 3 | 0 | 0 |" in details
    assert never.provider_id in details
    assert (counter("found"), counter("deleted")) == (found + 6, deleted + 3)
    await record_history(handle, "orphan_gc_sweep")


async def test_instances_younger_than_the_grace_period_are_kept(
    stack: Stack, gc_worker: StartGcWorker
) -> None:
    young = await asyncio.to_thread(
        create_directly, stack, f"never-{uuid.uuid4().hex}", 0, stack.config.installation
    )
    task_queue = gc_worker({"local": stack.provider}, stack.config)

    result = await sweep(stack.client, task_queue, grace_period_seconds=3600)

    [local] = result.providers
    assert (local.seen, local.skipped, local.orphaned, local.deleted) == (1, 1, 0, 0)
    assert "within the grace period" in local.skips[young.provider_id]
    assert stack.instances() == [young.name]


async def test_bad_input_fails_fast_naming_every_field(
    temporal_env: WorkflowEnvironment, gc_worker: StartGcWorker
) -> None:
    task_queue = gc_worker({"mem": MemoryProvider()}, stack_config(443, "/nonexistent"))

    with pytest.raises(WorkflowFailureError) as failure:
        await asyncio.wait_for(
            sweep(
                temporal_env.client,
                task_queue,
                dry_run="yes",
                grace_period_seconds=-1,
                providers=["mem", "nope"],
                colour="blue",
            ),
            timeout=30,
        )

    cause = failure.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "InvalidInput"
    for expected in (
        "dry_run: input should be a valid boolean",
        "grace_period_seconds: input should be greater than or equal to 0",
        "providers.1: unknown provider 'nope' (configured: mem)",
        "colour: unknown field",
    ):
        assert expected in cause.message


# ---- the stand-in provider: hundreds of instances, owners in every state --------------


async def test_adversarial_fleet_loses_no_owned_instance_and_keeps_no_old_orphan(
    temporal_env: WorkflowEnvironment, gc_worker: StartGcWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Several survey pages, each handled across continue-as-new.
    monkeypatch.setattr(gc_activities, "SURVEY_LIMIT", 120)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    client = temporal_env.client
    config = stack_config(443, "/nonexistent")
    installation = config.installation
    name = f"mem-{uuid.uuid4().hex[:8]}"
    provider = MemoryProvider()
    owned: set[str] = set()
    orphans: set[str] = set()
    # Neither: too young, another installation's, or undeletable.
    kept: set[str] = set()
    handles: list[WorkflowHandle[Any, Any]] = []
    timing_out: list[WorkflowHandle[Any, Any]] = []
    orphan_owners: set[str] = set()

    async def owner(generations: list[int], **options: Any) -> WorkflowHandle[Any, Any]:
        owner_id = f"owner-{uuid.uuid4().hex[:12]}"
        handle = await start_owner(
            client,
            owner_id,
            provider=name,
            instances=[instance_name(owner_id, g) for g in generations],
            task_queue=f"no-worker-{name}",
            **options,
        )
        handles.append(handle)
        return handle

    def orphan(owner_id: str, generation: int = 0) -> None:
        orphans.add(provider.add(installation, owner_id, generation).provider_id)
        orphan_owners.add(owner_id)

    async def live() -> None:
        owned.add(provider.add(installation, (await owner([0])).id, 0).provider_id)

    async def replaced() -> None:
        current = rng.randint(1, 3)
        owner_id = (await owner([current])).id
        owned.add(provider.add(installation, owner_id, current).provider_id)
        for generation in range(current):
            orphan(owner_id, generation)

    async def closed() -> None:
        handle = await owner([0])
        orphan(handle.id)
        await handle.terminate()

    async def timed_out() -> None:
        handle = await owner([0], execution_timeout=timedelta(seconds=1))
        timing_out.append(handle)
        orphan(handle.id)

    async def missing() -> None:
        orphan(f"gone-{uuid.uuid4().hex}")

    async def young() -> None:
        instance = provider.add(installation, f"new-{uuid.uuid4().hex}", 0, age=timedelta(0))
        kept.add(instance.provider_id)

    async def foreign() -> None:
        kept.add(provider.add("other", f"theirs-{uuid.uuid4().hex}", 0).provider_id)

    async def undeletable() -> None:
        owner_id = f"stuck-{uuid.uuid4().hex}"
        instance = provider.add(installation, owner_id, 0)
        provider.refuse_delete(instance.provider_id, Permanent("delete refused"))
        kept.add(instance.provider_id)
        orphan_owners.add(owner_id)

    kinds = [live] * 4 + [replaced] * 2 + [closed, timed_out, missing] * 2 + [young, foreign]
    makers = [rng.choice(kinds) for _ in range(400)] + [undeletable] * 3
    for start in range(0, len(makers), 50):
        await asyncio.gather(*(make() for make in makers[start : start + 50]))

    async def timed_out_owners_closed() -> bool:
        statuses = await asyncio.gather(*(h.describe() for h in timing_out))
        return all(d.status is not WorkflowExecutionStatus.RUNNING for d in statuses)

    await wait_for(timed_out_owners_closed, "owners with a 1 s execution timeout to close")
    assert len(orphans) > MAX_PER_RUN, "enough orphans to continue as new"
    before_sweep = len(handles)

    task_queue = gc_worker({name: provider}, config)
    handle = await client.start_workflow(
        "OrphanGC",
        # Most of this fleet is orphaned on purpose: let the breaker allow it.
        # Orphans are a day old, the young ones made at the start of the
        # setup; an hour's grace keeps them young however long the setup
        # takes on a busy machine (a minute's did not: two were swept).
        {"grace_period_seconds": 3600, "max_delete_share": 1},
        id=f"orphan-gc-{uuid.uuid4().hex[:8]}",
        task_queue=task_queue,
        result_type=GcResult,
    )
    done = asyncio.Event()

    async def owners_appear_during_the_sweep() -> None:
        """New lifecycles publish their instance, then create it (old, as if adopted)."""
        while not done.is_set():
            await live()
            await asyncio.sleep(0.01)

    arrivals = asyncio.create_task(owners_appear_during_the_sweep())
    try:
        # Generous: a busy CI machine runs this sweep several times slower than an idle one.
        result = await asyncio.wait_for(handle.result(), timeout=240)
    finally:
        done.set()
        await arrivals
        for h in handles:
            with contextlib.suppress(RPCError):
                await h.terminate()

    context = f"seed {seed}"
    deleted = set(provider.deleted)
    assert not deleted & owned, context
    assert deleted == orphans, context
    assert kept <= provider.ids(), context
    [swept] = result.providers
    assert swept.deleted == len(orphans), context
    assert swept.failed == 3 and set(swept.failures) <= kept, context
    assert all("delete refused" in e for e in swept.failures.values()), context
    # Describes for candidates only (orphans' owners, owners that arrived
    # during the sweep), plus one visibility page per survey: none per owned one.
    arrived = len(handles) - before_sweep
    assert swept.lookups <= len(orphan_owners) + arrived + 10, context
    latest = await client.get_workflow_handle(handle.id).describe()
    assert latest.run_id != handle.run_id, f"the sweep continued as new ({context})"
    await record_history(client.get_workflow_handle(handle.id), "orphan_gc_continued")


def counter(kind: str) -> float:
    """proxy_operator_orphans_found or _deleted for the local provider."""
    sample = REGISTRY.get_sample_value(
        f"proxy_operator_orphans_{kind}_total", {"provider": "local"}
    )
    return sample or 0.0


async def _current_details(handle: WorkflowHandle[Any, Any]) -> str:
    """What the Web UI shows as the workflow's current details."""
    metadata: WorkflowMetadata = await handle.query(
        "__temporal_workflow_metadata", result_type=WorkflowMetadata
    )
    return metadata.current_details


# ---- the circuit breaker --------------------------------------------------------------


async def test_circuit_breaker_refuses_to_wipe_a_provider_and_says_why(
    temporal_env: WorkflowEnvironment, gc_worker: StartGcWorker
) -> None:
    """A sweep that would delete most of what it saw deletes nothing there, and fails loudly.

    This is what a worker pointed at the wrong namespace looks like: every
    instance of the installation seems to have no owner.
    """
    client = temporal_env.client
    config = stack_config(443, "/nonexistent")
    big, small, one = MemoryProvider(), MemoryProvider(), MemoryProvider()
    wiped = {
        big.add(config.installation, f"gone-{i}-{uuid.uuid4().hex}", 0).provider_id
        for i in range(12)
    }
    small_orphans = {
        small.add(config.installation, f"gone-{uuid.uuid4().hex}", 0).provider_id for _ in range(2)
    }
    single = one.add(config.installation, f"gone-{uuid.uuid4().hex}", 0).provider_id
    providers = {"big": big, "small": small, "one": one}
    task_queue = gc_worker(providers, config)

    dry = await sweep(client, task_queue, dry_run=True, grace_period_seconds=0)

    by_name = {s.provider: s for s in dry.providers}
    assert "12 of the 12 instances seen would be deleted (100%)" in by_name["big"].circuit_open
    assert set(by_name["big"].orphans) == wiped, "a dry run still lists what it would delete"
    assert by_name["small"].circuit_open == by_name["one"].circuit_open == ""

    handle = await client.start_workflow(
        "OrphanGC",
        {"grace_period_seconds": 0},
        id=f"orphan-gc-{uuid.uuid4().hex[:8]}",
        task_queue=task_queue,
    )
    with pytest.raises(WorkflowFailureError) as failure:
        await handle.result()

    cause = failure.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "GcCircuitOpen"
    assert "`big`: 12 of the 12 instances seen would be deleted (100%)" in cause.message
    assert "max_delete_share 50%" in cause.message and "max_delete_unchecked 10" in cause.message
    assert big.ids() == wiped and big.deleted == []
    assert small.ids() == set() and set(small.deleted) == small_orphans
    assert one.deleted == [single]
    details = await _current_details(handle)
    assert "(finished)" in details and "deleting orphans" not in details
    assert "circuit breaker open on `big`" in details
    summaries = [
        event.user_metadata.summary.data.decode()
        for event in (await handle.fetch_history()).events
        if event.activity_task_scheduled_event_attributes.activity_type.name == "gc_confirm"
    ]
    assert '"confirm 1 candidate on one"' in summaries
    assert '"confirm 2 candidates on small"' in summaries

    await record_history(handle, "orphan_gc_circuit_open")

    allowed = await sweep(client, task_queue, grace_period_seconds=0, max_delete_share=1)

    assert {s.provider: s.deleted for s in allowed.providers} == {"big": 12, "small": 0, "one": 0}
    assert big.ids() == set()
