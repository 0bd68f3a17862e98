"""Orphan GC's look-ups against the real dev server and an in-memory provider.

Owners are real ProxyLifecycle executions that no worker runs (their search
attributes are set at start), so visibility and describe answer exactly as
they would for a running fleet. Each test uses a provider name of its own,
which scopes the visibility query to its own owners.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from prometheus_client import REGISTRY
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities import gc as gc_module
from activities.gc import (
    Candidate,
    ConfirmInput,
    Decision,
    DeletedInput,
    GcActivities,
    SurveyInput,
)
from providers.gcp import PORT_METADATA_KEY, GcpConfig, GcpProvider, labels
from providers.gcp.instances import TAGS_METADATA_KEY
from providers.memory import MemoryProvider
from providers.naming import (
    INSTALLATION_KEY,
    MANAGED_BY_KEY,
    MANAGED_BY_VALUE,
    NAMESPACE_KEY,
    OWNER_KEY,
    instance_name,
    owner_tags,
)
from tests.fakes.compute import DEFAULT_PROJECT, DEFAULT_ZONES, FakeCompute
from tests.fakes.owners import start_owner
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.slow

INSTALLATION = "test"
ZONE_B, ZONE_C = DEFAULT_ZONES[:2]


@dataclass
class Fleet:
    client: Client
    provider: MemoryProvider
    name: str
    gc: GcActivities
    owners: list[WorkflowHandle[Any, Any]] = field(default_factory=list)

    async def owner(self, generations: Sequence[int] = (0,), **options: Any) -> str:
        """A running owner listing the instances of these generations."""
        owner_id = f"owner-{uuid.uuid4().hex[:10]}"
        names = [instance_name(owner_id, g) for g in generations]
        self.owners.append(
            await start_owner(
                self.client,
                owner_id,
                provider=self.name,
                instances=names,
                task_queue=f"no-worker-{self.name}",
                **options,
            )
        )
        return owner_id

    async def listed(self, count: int) -> None:
        """Wait until visibility lists `count` running owners on this provider."""
        query = f"ExecutionStatus = 'Running' AND ProxyProvider = '{self.name}'"

        async def caught_up() -> bool:
            return (await self.client.count_workflows(query)).count == count

        await wait_for(caught_up, f"visibility to list {count} owners")


@pytest.fixture
async def fleet(temporal_env: WorkflowEnvironment) -> AsyncIterator[Fleet]:
    provider = MemoryProvider()
    name = f"mem-{uuid.uuid4().hex[:8]}"
    gc = GcActivities({name: provider}, INSTALLATION, temporal_env.client)
    fleet = Fleet(temporal_env.client, provider, name, gc)
    yield fleet
    for handle in fleet.owners:
        with contextlib.suppress(RPCError):  # closed already, as some tests want
            await handle.terminate()


def run(fn: Any, *args: Any) -> Any:
    return ActivityEnvironment().run(fn, *args)


def counter(name: str, provider: str) -> float:
    return REGISTRY.get_sample_value(name, {"provider": provider}) or 0.0


async def test_survey_keeps_owned_and_young_and_returns_the_rest(fleet: Fleet) -> None:
    owner = await fleet.owner(generations=[1])
    current = fleet.provider.add(INSTALLATION, owner, 1)
    old_generation = fleet.provider.add(INSTALLATION, owner, 0)
    missing = fleet.provider.add(INSTALLATION, "never-started", 0)
    young = fleet.provider.add(INSTALLATION, "never-started-either", 0, age=timedelta(0))
    untagged = fleet.provider.add(
        INSTALLATION,
        "ignored",
        0,
        tags={
            MANAGED_BY_KEY: MANAGED_BY_VALUE,
            INSTALLATION_KEY: INSTALLATION,
            NAMESPACE_KEY: fleet.client.namespace,
        },
    )
    # Made before instances carried their namespace: kept, and said why.
    before_namespaces = fleet.provider.add(
        INSTALLATION, "old", 0, tags=owner_tags(INSTALLATION, "old", 0)
    )
    # Another installation's, another namespace's, and one this operator did
    # not make: never seen.
    fleet.provider.add("other-installation", "never-started", 7)
    fleet.provider.add(INSTALLATION, "never-started", 9, namespace="staging")
    fleet.provider.add(INSTALLATION, "x", 8, tags={INSTALLATION_KEY: INSTALLATION, OWNER_KEY: "x"})
    await fleet.listed(1)

    survey = await run(fleet.gc.survey, SurveyInput(fleet.name, grace_period_seconds=60))

    assert (survey.seen, survey.owned, survey.young, survey.untagged) == (6, 1, 1, 1)
    assert survey.unowned == 3
    assert list(survey.young_ids) == [young.provider_id]
    assert "proxy-operator/namespace" in survey.untagged_ids[before_namespaces.provider_id]
    assert {c.provider_id for c in survey.candidates} == {
        old_generation.provider_id,
        missing.provider_id,
        untagged.provider_id,
    }
    assert current.provider_id not in {c.provider_id for c in survey.candidates}
    by_id = {c.provider_id: c for c in survey.candidates}
    assert by_id[old_generation.provider_id].owner == owner
    assert by_id[old_generation.provider_id].generation == 0
    assert by_id[untagged.provider_id].owner == ""
    assert not survey.more
    assert survey.lookups == 1  # one visibility page, not a call per instance


async def test_survey_pages_candidates_after_a_cursor(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    orphans = sorted(fleet.provider.add(INSTALLATION, f"gone-{i}", 0).provider_id for i in range(5))
    for _ in range(3):
        await fleet.owner()
    await fleet.listed(3)
    monkeypatch.setattr(gc_module, "VISIBILITY_PAGE_SIZE", 2)

    pages: list[list[str]] = []
    after = ""
    while True:
        survey = await run(
            fleet.gc.survey, SurveyInput(fleet.name, grace_period_seconds=0, after=after, limit=2)
        )
        assert (survey.seen, survey.owned, survey.lookups) == (5, 0, 2)
        pages.append([c.provider_id for c in survey.candidates])
        if not survey.more:
            break
        after = pages[-1][-1]

    assert pages == [orphans[0:2], orphans[2:4], orphans[4:5]]


async def test_confirm_describes_each_owner_once_and_decides(fleet: Fleet) -> None:
    lister = await fleet.owner(generations=[0])
    replaced = await fleet.owner(generations=[3])
    terminated = await fleet.owner()
    await fleet.owners[-1].terminate()
    # A new run of a reused id, before its first task: it may adopt its
    # generation-0 instance any moment, and publishes that in the first task.
    starting = await fleet.owner(generations=[], state=None)
    impostor = f"impostor-{uuid.uuid4().hex[:8]}"
    fleet.owners.append(
        await fleet.client.start_workflow(
            "SomethingElse", id=impostor, task_queue=f"no-worker-{fleet.name}"
        )
    )
    instances = {
        # Visibility had not seen the owner list it yet: describe does.
        "lagging": fleet.provider.add(INSTALLATION, lister, 0),
        "replaced": fleet.provider.add(INSTALLATION, replaced, 1),
        "replaced-too": fleet.provider.add(INSTALLATION, replaced, 2),
        "terminated": fleet.provider.add(INSTALLATION, terminated, 0),
        "missing": fleet.provider.add(INSTALLATION, "never-started", 0),
        "untagged": fleet.provider.add(
            INSTALLATION, "ignored", 0, tags={MANAGED_BY_KEY: MANAGED_BY_VALUE}
        ),
        "starting": fleet.provider.add(INSTALLATION, starting, 0),
        "impostor": fleet.provider.add(INSTALLATION, impostor, 0),
    }
    found_before = counter("proxy_operator_orphans_found_total", fleet.name)

    confirmation = await run(
        fleet.gc.confirm, ConfirmInput([Candidate.of(fleet.name, i) for i in instances.values()])
    )

    verdicts = {
        kind: (v.verdict, v.reason)
        for kind, v in zip(instances, confirmation.verdicts, strict=True)
    }
    assert verdicts == {
        "lagging": (Decision.OWNED, f"owner {lister} lists it (visibility was behind)"),
        "replaced": (Decision.ORPHAN, f"owner {replaced} no longer uses generation 1"),
        "replaced-too": (Decision.ORPHAN, f"owner {replaced} no longer uses generation 2"),
        "terminated": (Decision.ORPHAN, f"owner {terminated} is terminated"),
        "missing": (Decision.ORPHAN, "owner never-started does not exist"),
        "untagged": (Decision.ORPHAN, "no owner tag"),
        "starting": (Decision.SKIPPED, f"owner {starting} has not started yet and may adopt it"),
        "impostor": (Decision.ORPHAN, f"{impostor} is now a SomethingElse, not a proxy"),
    }
    assert confirmation.lookups == 6  # one describe per distinct owner
    assert counter("proxy_operator_orphans_found_total", fleet.name) == found_before + 6


async def test_record_deleted_counts_per_provider(fleet: Fleet) -> None:
    before = counter("proxy_operator_orphans_deleted_total", fleet.name)
    await run(fleet.gc.record_deleted, DeletedInput(fleet.name, 3))
    assert counter("proxy_operator_orphans_deleted_total", fleet.name) == before + 3
    assert await run(fleet.gc.providers) == [fleet.name]


async def test_a_same_name_vm_in_another_zone_is_an_orphan_past_grace(
    temporal_env: WorkflowEnvironment,
) -> None:
    """Names are unique per zone: the owner's instance is the one it serves from."""
    client = temporal_env.client
    name = f"gcp-{uuid.uuid4().hex[:8]}"
    with FakeCompute() as fake:
        gcp = GcpProvider(
            GcpConfig(project=DEFAULT_PROJECT, zone=ZONE_B), INSTALLATION, **fake.clients()
        )
        gc = GcActivities({name: gcp}, INSTALLATION, client)
        serving, booting = (f"owner-{uuid.uuid4().hex[:10]}" for _ in range(2))
        for owner, ips in ((serving, ("203.0.113.10", "203.0.113.11")), (booting, ("", ""))):
            tags = owner_tags(INSTALLATION, owner, 0, namespace=client.namespace)
            metadata = {TAGS_METADATA_KEY: json.dumps(tags), PORT_METADATA_KEY: "3128"}
            for zone, ip in zip((ZONE_B, ZONE_C), ips, strict=True):
                fake.add_instance(
                    zone,
                    instance_name(owner, 0),
                    labels=labels(tags),
                    metadata=metadata,
                    status="RUNNING" if ip else "PROVISIONING",
                    nat_ip=ip or None,
                )
        # The one not Ready: nothing says which of its two is its own, so both are kept.
        published = {
            serving: {"endpoint": "203.0.113.10:3128"},
            booting: {"state": "Provisioning"},
        }
        owners = [
            await start_owner(
                client,
                owner,
                provider=name,
                instances=[instance_name(owner, 0)],
                task_queue=f"no-worker-{name}",
                **attributes,
            )
            for owner, attributes in published.items()
        ]
        try:
            query = f"ExecutionStatus = 'Running' AND ProxyProvider = '{name}'"

            async def listed() -> bool:
                return (await client.count_workflows(query)).count == 2

            await wait_for(listed, "visibility to list both owners")

            survey = await run(gc.survey, SurveyInput(name, grace_period_seconds=0))
            twin = f"{ZONE_C}/{instance_name(serving, 0)}"
            assert (survey.seen, survey.owned) == (4, 3)
            assert [c.provider_id for c in survey.candidates] == [twin]
            confirmation = await run(gc.confirm, ConfirmInput(survey.candidates))
        finally:
            for handle in owners:
                await handle.terminate()

    [verdict] = confirmation.verdicts
    assert verdict.verdict is Decision.ORPHAN
    assert verdict.reason == (
        f"owner {serving} serves {instance_name(serving, 0)} from another instance of that "
        "name, at 203.0.113.10:3128: a twin in another zone"
    )
