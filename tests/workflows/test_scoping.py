"""Installations and Temporal namespaces sharing a project or cluster never collide.

Instance names hash the installation and the namespace (for lifecycles
started since that change; older ones keep their names, as their recorded
histories show), every instance carries its namespace, and orphan GC in one
namespace never judges, let alone deletes, another namespace's instances.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.duration_pb2 import Duration
from temporalio.api.workflowservice.v1 import RegisterNamespaceRequest
from temporalio.client import Client, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.gc import GcActivities
from activities.models import CreateInstanceInput
from activities.provider import ProviderActivities
from contract import INSTANCES
from providers.memory import MemoryProvider
from providers.naming import INSTALLATION_KEY, NAMESPACE_KEY, OWNER_KEY, instance_name
from startup.search_attributes import ensure_search_attributes
from tests.helpers.config import build_config, lifecycle_instance_name
from tests.helpers.stacks import Stack
from tests.helpers.waiting import wait_for, wait_status
from tests.helpers.workers import stop_worker
from worker import build_worker
from workflows.orphan_gc import GcResult

pytestmark = pytest.mark.slow

# Instances 0.1.0 runs created, before installation and namespace were in names.
WRITTEN_BY_0_1_0 = Path(__file__).resolve().parent / "written_by_0_1_0.json"


def test_names_differ_per_installation_and_namespace() -> None:
    names = {
        instance_name("proxy-eu-1", 0, installation=installation, namespace=namespace)
        for installation in ("prod", "staging")
        for namespace in ("default", "proxies")
    }
    names.add(instance_name("proxy-eu-1", 0))
    assert len(names) == 5
    assert all(len(name) == 22 and name.startswith("proxy-") for name in names)


def test_lifecycles_started_before_the_change_keep_their_names() -> None:
    """The old formula still gives every instance such runs created: a lifecycle
    whose first run carried no installation keeps it across continue-as-new."""
    created = json.loads(WRITTEN_BY_0_1_0.read_text())["instances_named_unscoped"]
    assert created
    for ref in created:
        assert ref["name"] == instance_name(ref["workflow_id"], ref["generation"])


async def test_a_new_lifecycle_names_its_instance_in_its_scope(stack: Stack) -> None:
    handle = await stack.start()
    ready = await wait_status(handle, lambda s: s.state == "Ready", "Ready")

    assert ready.instance == lifecycle_instance_name(handle.id, 0)
    assert stack.instances() == [ready.instance]
    await handle.signal("terminate")
    await handle.result()
    assert stack.instances() == []


async def test_a_worker_of_another_installation_refuses_the_create() -> None:
    """Two installations on one task queue would otherwise tag one's instance as the other's."""
    provider = MemoryProvider()
    config = build_config({"name": "mem", "type": "memory"}, connect_ports=[443])
    acts = ProviderActivities({"mem": provider}, config)
    request = CreateInstanceInput(
        provider="mem", owner_id="proxy-eu-1", generation=0, installation="prod"
    )
    try:
        with pytest.raises(ApplicationError) as refused:
            await ActivityEnvironment().run(acts.create_instance, request)
    finally:
        acts.close()
    assert refused.value.type == "Permanent" and refused.value.non_retryable
    assert "installation 'prod'" in refused.value.message
    assert provider.ids() == set()


class Namespaced:
    """One worker per namespace, all on the same memory provider and installation."""

    def __init__(self, env: WorkflowEnvironment) -> None:
        self.env = env
        self.provider = MemoryProvider()
        self.config = build_config({"name": "mem", "type": "memory"}, connect_ports=[443])
        self.task_queue = f"scoped-{uuid.uuid4().hex[:12]}"
        self._stops: list[Any] = []

    async def client(self, namespace: str) -> Client:
        if namespace == self.env.client.namespace:
            return self.env.client
        await self.env.client.workflow_service.register_namespace(
            RegisterNamespaceRequest(
                namespace=namespace,
                workflow_execution_retention_period=Duration(seconds=24 * 3600),
            )
        )
        client = Client(**{**self.env.client.config(), "namespace": namespace})

        async def usable() -> bool:
            try:
                await ensure_search_attributes(client)
                await client.count_workflows()
            except RPCError:
                return False
            return True

        await wait_for(usable, f"namespace {namespace} to be usable")
        return client

    async def worker(self, client: Client) -> None:
        acts = ProviderActivities({"mem": self.provider}, self.config)
        gc = GcActivities({"mem": self.provider}, self.config.installation, client)
        worker = build_worker(client, acts, gc=gc, task_queue=self.task_queue)
        run = asyncio.get_running_loop().create_task(worker.run())
        self._stops.append((worker, run, acts))

    async def close(self) -> None:
        for worker, run, acts in self._stops:
            await stop_worker(worker)
            if run.done():
                run.result()
            acts.close()


@pytest.fixture
async def namespaced(temporal_env: WorkflowEnvironment) -> AsyncIterator[Namespaced]:
    setup = Namespaced(temporal_env)
    yield setup
    await setup.close()


async def test_same_workflow_id_in_two_namespaces_gets_two_instances_and_gc_keeps_to_its_own(
    namespaced: Namespaced,
) -> None:
    default = namespaced.env.client
    other = await namespaced.client(f"staging-{uuid.uuid4().hex[:8]}")
    for client in (default, other):
        await namespaced.worker(client)
    workflow_id = f"proxy-{uuid.uuid4().hex[:10]}"
    body = {"provider": "mem", "health": {"target": "https://127.0.0.1/"}}

    async def start(client: Client) -> WorkflowHandle[Any, Any]:
        return await client.start_workflow(
            "ProxyLifecycle", body, id=workflow_id, task_queue=namespaced.task_queue
        )

    ours, theirs = await start(default), await start(other)
    names = {
        client.namespace: lifecycle_instance_name(workflow_id, 0, namespace=client.namespace)
        for client in (default, other)
    }

    async def both_created() -> bool:
        return {i.name for i in namespaced.provider.list_by_tag(OWNER_KEY, workflow_id)} == set(
            names.values()
        )

    await wait_for(both_created, "an instance per namespace")
    assert instance_name(workflow_id, 0) not in names.values(), "not the old formula"
    for instance in namespaced.provider.list_by_tag(OWNER_KEY, workflow_id):
        namespace = instance.tags[NAMESPACE_KEY]
        assert instance.name == names[namespace]
        assert instance.tags[INSTALLATION_KEY] == namespaced.config.installation
    # The name the workflow published before the create is the one it got.
    published = (await ours.describe()).typed_search_attributes.get(INSTANCES)
    assert published == [names[default.namespace]]

    # The staging owner goes away without cleanup: its instance is an orphan,
    # there and only there.
    await theirs.terminate()
    result: GcResult = await other.execute_workflow(
        "OrphanGC",
        {"grace_period_seconds": 0},
        id=f"orphan-gc-{uuid.uuid4().hex[:8]}",
        task_queue=namespaced.task_queue,
        result_type=GcResult,
        execution_timeout=timedelta(seconds=60),
    )

    [swept] = result.providers
    assert (swept.seen, swept.deleted) == (1, 1)
    remaining = {i.name for i in namespaced.provider.list_by_tag(OWNER_KEY, workflow_id)}
    assert remaining == {names[default.namespace]}
    await ours.terminate()
