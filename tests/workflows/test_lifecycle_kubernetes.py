"""ProxyLifecycle with the Kubernetes provider, against the fake API server (issue 5).

Everything but the cluster is real: the Temporal dev server, the worker as
`build_worker` composes it, the `kubernetes` client talking HTTP to the fake
(tests/fakes/kubernetes.py), and the Squid behind every Pod. The test plays
the kubelet: it runs the Pod's Secret (its squid.conf and htpasswd) with a
real Squid on 127.0.0.1, on the container port the workflow asked for, then
reports the Pod Running with the IP 127.0.0.1. So "Ready" means a CONNECT
probe really tunnelled through the Squid config the provider rendered.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

import activities.provider as provider_activities
from activities.probe import probe_connect
from providers.config import Config
from providers.kubernetes import CONFIG_DIR, SQUID_CONF_KEY, KubernetesConfig, KubernetesProvider
from providers.naming import MANAGED_BY_KEY, MANAGED_BY_VALUE
from tests.fakes.kubernetes import PODS, SECRETS, FakeKubernetes
from tests.helpers.config import INSTALLATION, USERNAME, lifecycle_instance_name, proxy_config
from tests.helpers.network import free_port
from tests.helpers.squid_upstream import LocalSquid, SquidUpstreams, requires_squid, secret_files
from tests.helpers.stacks import ProviderStack, StackFactory
from tests.helpers.tls_origin import TlsOrigin
from tests.helpers.waiting import status_of, wait_for, wait_status

pytestmark = [pytest.mark.slow, requires_squid]

PROVIDER = "cluster"
NAMESPACE = "proxies"
PASSWORD = "kubernetes-workflow-password"
POD_IP = "127.0.0.1"


def cluster_config(origin_port: int, **settings: Any) -> Config:
    """The worker's config: one Kubernetes provider, `settings` added to its own."""
    return proxy_config(
        origin_port,
        {
            "name": PROVIDER,
            "type": "kubernetes",
            "kubernetes": {"namespace": NAMESPACE, "request_timeout_seconds": 5, **settings},
        },
        password=PASSWORD,
    )


@pytest.fixture
def fake() -> Iterator[FakeKubernetes]:
    with FakeKubernetes(namespaces=(NAMESPACE,)) as server:
        yield server


def provider_for(fake: FakeKubernetes, config: Config) -> KubernetesProvider:
    """The provider as `from_config` builds it, but on a client pointed at the fake."""
    settings = config.provider(PROVIDER).settings
    assert isinstance(settings, KubernetesConfig)
    configuration = fake.configuration()
    configuration.retries = 0
    return KubernetesProvider(settings, kubernetes.client.ApiClient(configuration), INSTALLATION)


@pytest.fixture
def provider(fake: FakeKubernetes, tls_origin: TlsOrigin) -> KubernetesProvider:
    return provider_for(fake, cluster_config(tls_origin.port))


async def failure_of(handle: WorkflowHandle[Any, Any]) -> ApplicationError:
    """The error a workflow failed with."""
    with pytest.raises(WorkflowFailureError) as failure:
        await handle.result()
    cause = failure.value.cause
    assert isinstance(cause, ApplicationError)
    return cause


@pytest.fixture
async def stack(
    fake: FakeKubernetes,
    provider_stack_on: StackFactory,
    provider: KubernetesProvider,
    temporal_env: WorkflowEnvironment,
    tls_origin: TlsOrigin,
) -> ProviderStack:
    return await provider_stack_on(
        temporal_env, {PROVIDER: provider}, cluster_config(tls_origin.port)
    )


class Kubelet:
    """The test's stand-in for the scheduler and kubelet of the fake cluster."""

    def __init__(self, fake: FakeKubernetes, squids: SquidUpstreams, port: int) -> None:
        self.fake = fake
        self.squids = squids
        self.port = port
        self.containers: dict[str, LocalSquid] = {}

    def pod(self, name: str) -> dict[str, Any] | None:
        return self.fake.get(PODS, NAMESPACE, name)

    def secret(self, name: str) -> dict[str, Any] | None:
        return self.fake.get(SECRETS, NAMESPACE, f"{name}-squid")

    async def run_pod(self, name: str) -> LocalSquid:
        """Wait for the Pod and its Secret, start its Squid, report it Running on 127.0.0.1."""
        await wait_for(
            lambda: self.pod(name) is not None and self.secret(name) is not None,
            f"pod {name} and its secret",
        )
        pod, secret = self.pod(name), self.secret(name)
        assert pod is not None and secret is not None
        (container,) = pod["spec"]["containers"]
        assert container["ports"][0]["containerPort"] == self.port
        files = secret_files(secret, CONFIG_DIR)
        squid_conf = files.pop(f"{CONFIG_DIR}/{SQUID_CONF_KEY}")
        squid = await self.squids.start(squid_conf, files, port=self.port)
        self.containers[name] = squid
        self.fake.set_pod_status(NAMESPACE, name, "Running", POD_IP)
        return squid

    async def crash(self, name: str) -> None:
        """Squid dies; with restartPolicy Never the Pod turns Failed."""
        await self.containers[name].crash()
        self.fake.set_pod_status(NAMESPACE, name, "Failed", POD_IP)

    async def finish_deletion(self, name: str) -> None:
        """Once the Pod is marked for deletion, stop its container and confirm."""

        def marked() -> bool:
            pod = self.pod(name)
            return pod is not None and bool(pod["metadata"].get("deletionTimestamp"))

        await wait_for(marked, f"pod {name} to be marked for deletion")
        if name in self.containers:
            await self.containers[name].terminate()
        self.fake.finish_deletion(NAMESPACE, name)


@pytest.fixture
def kubelet(fake: FakeKubernetes, squid_upstreams: SquidUpstreams) -> Kubelet:
    return Kubelet(fake, squid_upstreams, free_port())


async def start_proxy(stack: ProviderStack, kubelet: Kubelet) -> WorkflowHandle[Any, Any]:
    return await stack.start(PROVIDER, port=kubelet.port)


def leftover_pods(provider: KubernetesProvider) -> list[str]:
    return [i.provider_id for i in provider.list_by_tag(MANAGED_BY_KEY, MANAGED_BY_VALUE)]


async def test_pod_becomes_ready_serves_and_is_deleted_on_terminate(
    stack: ProviderStack, kubelet: Kubelet, provider: KubernetesProvider
) -> None:
    handle = await start_proxy(stack, kubelet)
    name = lifecycle_instance_name(handle.id, 0)

    await wait_for(lambda: kubelet.pod(name) is not None, f"pod {name}")
    provisioning = await status_of(handle)
    assert provisioning.state == "Provisioning" and provisioning.endpoint == ""
    await kubelet.run_pod(name)

    status = await wait_status(handle, lambda s: s.state == "Ready", "Ready")
    assert status.endpoint == f"{POD_IP}:{kubelet.port}"
    assert (status.provider, status.provider_id) == (PROVIDER, f"{NAMESPACE}/{name}")
    assert (status.instance, status.generation) == (name, 0)
    assert status.last_probe is not None and status.last_probe.ok, status.last_probe
    tunnelled = await probe_connect(
        POD_IP,
        kubelet.port,
        USERNAME,
        PASSWORD,
        stack.origin.url,
        ssl_context=stack.origin.client_ssl_context,
    )
    assert tunnelled.ok, tunnelled

    await handle.signal("terminate", {"reason": "test done"})
    await kubelet.finish_deletion(name)
    result = await handle.result()

    assert (result["state"], result["reason"]) == ("Terminated", "test done")
    assert kubelet.pod(name) is None
    assert kubelet.secret(name) is None, "the Secret outlived its owner Pod"
    assert leftover_pods(provider) == []
    final = await status_of(handle)
    assert (final.state, final.endpoint) == ("Terminated", "")


async def test_pod_that_fails_while_ready_is_replaced_by_a_new_generation(
    stack: ProviderStack, kubelet: Kubelet, provider: KubernetesProvider
) -> None:
    handle = await start_proxy(stack, kubelet)
    first, second = lifecycle_instance_name(handle.id, 0), lifecycle_instance_name(handle.id, 1)
    await kubelet.run_pod(first)
    await wait_status(handle, lambda s: s.state == "Ready", "generation 0 Ready")

    await kubelet.crash(first)
    await kubelet.finish_deletion(first)  # the workflow deletes the failed Pod
    await kubelet.run_pod(second)

    status = await wait_status(
        handle, lambda s: s.state == "Ready" and s.generation == 1, "generation 1 Ready"
    )
    assert (status.instance, status.provider_id) == (second, f"{NAMESPACE}/{second}")
    assert status.replacements == 1
    assert status.last_probe is not None and status.last_probe.ok, status.last_probe
    assert kubelet.pod(first) is None and kubelet.secret(first) is None
    assert leftover_pods(provider) == [f"{NAMESPACE}/{second}"]

    await handle.signal("terminate")
    await kubelet.finish_deletion(second)
    result = await handle.result()

    assert result["state"] == "Terminated" and result["generation"] == 1
    assert kubelet.pod(second) is None and kubelet.secret(second) is None
    assert leftover_pods(provider) == []


async def test_evicted_pods_are_replaced_as_disruptions_without_spending_the_crash_budget(
    stack: ProviderStack, kubelet: Kubelet, provider: KubernetesProvider
) -> None:
    """Issue 46: a drain's eviction and the kubelet's node-pressure eviction are counted
    apart (`disruptions`), named in the reason, and never counted as failures, though
    the drained Pod's deletion completes before the workflow looks at it."""
    handle = await start_proxy(stack, kubelet)
    first, second, third = (lifecycle_instance_name(handle.id, g) for g in range(3))
    await kubelet.run_pod(first)
    await wait_status(handle, lambda s: s.state == "Ready", "generation 0 Ready")

    # A drain evicts it. Squid stops a second after its SIGTERM and the kubelet then
    # confirms the deletion, while the workflow looks only after a failed probe (every
    # 10 s by default): here the confirmation lands before Squid's port even closes,
    # so the workflow always looks after it. Only the provider's finalizer keeps the
    # Pod, and why it went, readable until then.
    kubelet.fake.evict(NAMESPACE, first)
    kubelet.fake.finish_deletion(NAMESPACE, first)
    await kubelet.containers[first].terminate()
    drained = await wait_status(handle, lambda s: s.disruptions == 1, "the eviction counted")
    await wait_for(lambda: kubelet.pod(first) is None, "the workflow to let the drained Pod go")
    await kubelet.run_pod(second)
    await wait_status(handle, lambda s: s.state == "Ready" and s.instance == second, "gen 1 Ready")

    # Node pressure: the kubelet kills Squid and leaves the Pod Failed, reason Evicted.
    message = "The node was low on resource: memory. Threshold quantity: 100Mi, available: 50Mi. "
    await kubelet.containers[second].crash()
    kubelet.fake.evict_for_node_pressure(NAMESPACE, second, message)
    pressed = await wait_status(handle, lambda s: s.disruptions == 2, "the eviction counted")
    await kubelet.finish_deletion(second)  # the workflow deletes the evicted Pod
    await kubelet.run_pod(third)
    ready = await wait_status(
        handle, lambda s: s.state == "Ready" and s.instance == third, "generation 2 Ready"
    )

    assert drained.failures_in_a_row == 0, drained
    assert "platform disruption, no crash counted:" in (drained.last_error or ""), drained
    assert "evicted: EvictionByEvictionAPI" in (drained.last_error or ""), drained
    assert pressed.failures_in_a_row == 0, pressed
    assert f"evicted: {message}" in (pressed.last_error or ""), pressed
    assert (ready.disruptions, ready.failures_in_a_row, ready.replacements) == (2, 0, 2)
    await handle.signal("terminate")
    await kubelet.finish_deletion(third)
    await handle.result()
    assert leftover_pods(provider) == []


async def test_an_image_pull_the_kubelet_retries_is_waited_out_on_the_same_pod(
    stack: ProviderStack, kubelet: Kubelet, provider: KubernetesProvider
) -> None:
    """A registry's rate limit passes: no replacement, no failure counted; status says why."""
    handle = await start_proxy(stack, kubelet)
    first = lifecycle_instance_name(handle.id, 0)
    await wait_for(lambda: kubelet.pod(first) is not None, f"pod {first}")
    message = "toomanyrequests: You have reached your unauthenticated pull rate limit."
    kubelet.fake.set_container_waiting(NAMESPACE, first, "ErrImagePull", message)

    waiting = await wait_status(
        handle, lambda s: "image pull failed" in (s.waiting_for or ""), "the pull wait in status"
    )
    await kubelet.run_pod(first)  # the kubelet's next pull succeeds
    ready = await wait_status(handle, lambda s: s.state == "Ready", "generation 0 Ready")

    assert "the kubelet retries (for " in (waiting.waiting_for or "")
    assert f"ErrImagePull: {message}" in (waiting.waiting_for or "")
    assert waiting.state == "Provisioning"
    assert (ready.instance, ready.generation, ready.replacements) == (first, 0, 0)
    await handle.signal("terminate")
    await kubelet.finish_deletion(first)
    await handle.result()
    assert leftover_pods(provider) == []


async def test_a_pod_whose_image_cannot_be_pulled_for_the_window_is_replaced_naming_it(
    stack: ProviderStack, kubelet: Kubelet, provider: KubernetesProvider
) -> None:
    """Past `image_pull_timeout_seconds` the Pod is written off, and status names the image."""
    handle = await start_proxy(stack, kubelet)
    first, second = lifecycle_instance_name(handle.id, 0), lifecycle_instance_name(handle.id, 1)
    await wait_for(lambda: kubelet.pod(first) is not None, f"pod {first}")
    message = 'failed to pull image "ubuntu/squid:no-such-tag": not found'
    kubelet.fake.set_container_waiting(NAMESPACE, first, "ErrImagePull", message)
    kubelet.fake.move_back(NAMESPACE, first, "creationTimestamp", 3600)

    replacing = await wait_status(
        handle, lambda s: "image pull failed" in (s.last_error or ""), "the reason in status"
    )
    await kubelet.finish_deletion(first)
    await kubelet.run_pod(second)
    ready = await wait_status(handle, lambda s: s.state == "Ready", "generation 1 Ready")

    image = KubernetesConfig().image
    assert f"image pull failed for image {image} for 36" in (replacing.last_error or "")
    assert f"ErrImagePull: {message}" in (replacing.last_error or "")
    assert (ready.instance, ready.generation) == (second, 1)
    assert kubelet.pod(first) is None
    await handle.signal("terminate")
    await kubelet.finish_deletion(second)
    await handle.result()
    assert leftover_pods(provider) == []


async def test_a_placement_outside_the_allowed_namespaces_is_invalid_input(
    stack: ProviderStack, kubelet: Kubelet, fake: FakeKubernetes
) -> None:
    handle = await stack.start(PROVIDER, placement={"namespace": "kube-system"})

    cause = await failure_of(handle)
    assert cause.type == "InvalidInput"
    assert "placement.namespace: 'kube-system' is not one of" in cause.message
    assert fake.verbs_used() == set(), "nothing was created"


async def test_a_pod_pending_past_the_wait_running_deadline_is_replaced_with_the_reason(
    stack: ProviderStack,
    kubelet: Kubelet,
    provider: KubernetesProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pending for no reason the provider can name still ends: wait_running has a deadline.

    The deadline (10 minutes in production) is shortened here instead of waited out.
    """
    monkeypatch.setattr(provider_activities, "WAIT_RUNNING_DEADLINE_SECONDS", 1.0)
    handle = await start_proxy(stack, kubelet)
    first, second = lifecycle_instance_name(handle.id, 0), lifecycle_instance_name(handle.id, 1)
    await wait_for(lambda: kubelet.pod(first) is not None, f"pod {first}")

    replacing = await wait_status(
        handle, lambda s: "not running after" in (s.last_error or ""), "the deadline in status"
    )
    await wait_for(lambda: kubelet.pod(second) is not None, f"pod {second}")

    assert f"{first} not running after 1s (PROVISIONING" in (replacing.last_error or "")
    await handle.signal("terminate")
    await handle.result()
    assert leftover_pods(provider) == []


async def test_a_create_into_a_namespace_that_does_not_exist_fails_at_once_saying_so(
    fake: FakeKubernetes,
    provider_stack_on: StackFactory,
    temporal_env: WorkflowEnvironment,
    tls_origin: TlsOrigin,
) -> None:
    """Allowed by the config, missing in the cluster: Permanent, not a retried NotFound."""
    config = cluster_config(tls_origin.port, allowed_namespaces=[NAMESPACE, "not-created-yet"])
    provider = provider_for(fake, config)
    stack = await provider_stack_on(temporal_env, {PROVIDER: provider}, config)
    handle = await stack.start(PROVIDER, placement={"namespace": "not-created-yet"})

    cause = await failure_of(handle)
    assert cause.type == "Permanent"
    assert "namespace 'not-created-yet' does not exist" in cause.message
    status = await status_of(handle)
    assert status.state == "Failed" and status.waiting_for is None
    assert leftover_pods(provider) == []
