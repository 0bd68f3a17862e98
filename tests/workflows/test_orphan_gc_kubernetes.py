"""OrphanGC on the Kubernetes provider: a Pod held by the provider's finalizer is let go.

A real dev server and worker, the provider on the fake API server
(tests/fakes/kubernetes.py). Every Pod carries the provider's finalizer, so a
Pod a drain evicted after its owner's workflow ended stays, Terminating,
until someone removes it: orphan GC's delete does, and the Pod leaves the API.
An owned Pod (a running owner listing it) is kept.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import kubernetes
import pytest
from temporalio.testing import WorkflowEnvironment

from providers.base import CreateRequest
from providers.kubernetes import KubernetesConfig, KubernetesProvider
from providers.naming import instance_name, owner_tags
from tests.fakes.kubernetes import PODS, FakeKubernetes
from tests.fakes.owners import start_owner
from tests.helpers.config import proxy_config
from tests.workflows.test_orphan_gc import StartGcWorker, sweep
from tests.workflows.test_orphan_gc import gc_worker as gc_worker

pytestmark = pytest.mark.slow

PROVIDER = "cluster-gc"
NAMESPACE = "proxies"
# Far below GC's own 30-minute give-up: a Pod the sweep cannot let go fails here.
SWEEP_DEADLINE_SECONDS = 120


@pytest.fixture
def fake() -> Iterator[FakeKubernetes]:
    with FakeKubernetes(namespaces=(NAMESPACE,)) as server:
        yield server


async def test_an_evicted_orphan_pod_held_by_the_finalizer_is_let_go(
    fake: FakeKubernetes, temporal_env: WorkflowEnvironment, gc_worker: StartGcWorker
) -> None:
    config = proxy_config(443, {"name": PROVIDER, "type": "kubernetes", "kubernetes": {}})
    settings = config.provider(PROVIDER).settings
    assert isinstance(settings, KubernetesConfig)
    configuration = fake.configuration()
    configuration.retries = 0
    provider = KubernetesProvider(
        settings, kubernetes.client.ApiClient(configuration), config.installation
    )
    namespace = temporal_env.client.namespace

    def running_pod(owner: str) -> str:
        name = instance_name(owner, 0, installation=config.installation, namespace=namespace)
        provider.create(
            CreateRequest(
                name=name,
                proxy=config.proxy_settings(),
                tags=owner_tags(config.installation, owner, 0, namespace=namespace),
            )
        )
        fake.set_pod_status(NAMESPACE, name, "Running", "10.244.1.7")
        return name

    owned_by = f"owner-{uuid.uuid4().hex[:8]}"
    orphan, owned = await asyncio.gather(
        asyncio.to_thread(running_pod, f"ended-{uuid.uuid4().hex}"),
        asyncio.to_thread(running_pod, owned_by),
    )
    owner = await start_owner(
        temporal_env.client,
        owned_by,
        provider=PROVIDER,
        instances=[owned],
        task_queue=f"nobody-{uuid.uuid4().hex[:8]}",
    )
    # A drain evicts the orphan after its workflow ended: the kubelet confirms,
    # and only the finalizer keeps the Pod.
    fake.evict(NAMESPACE, orphan)
    fake.finish_deletion(NAMESPACE, orphan)
    assert fake.get(PODS, NAMESPACE, orphan) is not None
    task_queue = gc_worker({PROVIDER: provider}, config)

    result = await asyncio.wait_for(
        sweep(temporal_env.client, task_queue, grace_period_seconds=0), SWEEP_DEADLINE_SECONDS
    )

    [cluster] = result.providers
    assert (cluster.seen, cluster.orphaned, cluster.deleted, cluster.failed) == (2, 1, 1, 0)
    assert cluster.deleted_ids == [f"{NAMESPACE}/{orphan}"]
    assert fake.get(PODS, NAMESPACE, orphan) is None
    assert fake.get(PODS, NAMESPACE, owned) is not None
    await owner.terminate()
