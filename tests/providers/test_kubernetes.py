"""The Kubernetes provider against an HTTP-level fake API server.

The provider runs unmodified with the real `kubernetes` client, which talks
HTTP to tests/fakes/kubernetes.py (kmock plus the API-server behaviour the
provider relies on). The fake validates every created object against the
Kubernetes schema, as the API server does, so a create that succeeds here
produced a schema-valid Pod and Secret. The tests play the scheduler and the
kubelet by setting Pod status on the fake.

What a fake cannot show is covered two other ways. Here, the local Squid
runs the Secret's squid.conf the way the Pod runs it: as uid 13, with only
its spool directory writable, logging to an inherited stdout, stopped by
SIGTERM. And tests/providers/test_kubernetes_e2e.py (opt-in) runs a proxy
Pod in a real cluster and tunnels through it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

import providers.kubernetes as kubernetes_provider
from activities.probe import PROXY_AUTH_REQUIRED, probe_connect
from providers.base import CreateRequest, Disruption, Instance, InstanceState
from providers.config import Config, ConfigError, parse_config
from providers.errors import NotFound, Permanent, ProviderError, QuotaExceeded, Transient
from providers.kubernetes import (
    CONFIG_DIR,
    DELETED_BY_ANOTHER_CLIENT,
    FINALIZER,
    RBAC_VERBS,
    SPOOL_DIR,
    SQUID_PATHS,
    TAGS_ANNOTATION,
    KubernetesConfig,
    KubernetesProvider,
    label_key,
    label_value,
    labels,
)
from providers.naming import INSTALLATION_KEY, OWNER_KEY, instance_name, owner_tags, short_hash
from squid.conf import ProxySettings, render
from squid.htpasswd import sha512_crypt
from tests.fakes.kubernetes import (
    DELETION_BY_TAINT_MANAGER,
    MERGE_PATCH,
    PODS,
    PREEMPTION_BY_SCHEDULER,
    SECRETS,
    STRATEGIC_MERGE_PATCH,
    FakeKubernetes,
)
from tests.helpers.config import LOOPBACK_ORIGIN_DENIED
from tests.helpers.network import accepts_connections, free_port
from tests.helpers.squid_upstream import SQUID, requires_squid
from tests.helpers.tls_origin import TlsOrigin
from tests.helpers.waiting import wait_until

INSTALLATION = "test-installation"
NAMESPACE = "proxies"
PASSWORD = "kubernetes-test-password"
OTHER_NAMESPACES = ("team-a", "team-b")
SETTINGS = KubernetesConfig(
    namespace=NAMESPACE,
    allowed_namespaces=[NAMESPACE, *OTHER_NAMESPACES],
    image="ubuntu/squid:6.6-24.04_beta",
    cpu_request="100m",
    cpu_limit="100m",
    memory_request="128Mi",
    memory_limit="128Mi",
    # The provider's default, 10 s: the fake answers in milliseconds on an
    # idle machine, but took over 2 s with both cores busy.
    request_timeout_seconds=10.0,
)
# The `proxy` user of Debian/Ubuntu's base-passwd: run_as_user's default.
SQUID_UID = 13
QUOTA_MESSAGE = (
    'pods "proxy-x" is forbidden: exceeded quota: compute, requested: pods=1, '
    "used: pods=10, limited: pods=10"
)
RBAC_MESSAGE = (
    'pods is forbidden: User "system:serviceaccount:proxy-operator:proxy-operator" '
    'cannot create resource "pods" in API group "" in the namespace "proxies"'
)
# Label keys and values as the API server accepts them.
LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


@pytest.fixture
def fake() -> Iterator[FakeKubernetes]:
    with FakeKubernetes(namespaces=(NAMESPACE, *OTHER_NAMESPACES)) as server:
        yield server


def provider_for(
    configuration: kubernetes.client.Configuration,
    installation: str = INSTALLATION,
    settings: KubernetesConfig = SETTINGS,
) -> KubernetesProvider:
    # As in production (from_config): Temporal retries, the client does not.
    configuration.retries = 0
    return KubernetesProvider(settings, kubernetes.client.ApiClient(configuration), installation)


@pytest.fixture
def provider(fake: FakeKubernetes) -> KubernetesProvider:
    return provider_for(fake.configuration())


def proxy_settings(**changes: Any) -> ProxySettings:
    settings = ProxySettings(
        port=3128,
        username="proxy",
        password=PASSWORD,
        allowed_cidrs=("10.244.0.0/16",),
        allowed_connect_ports=(443,),
    )
    return replace(settings, **changes)


def request(
    owner: str = "proxy-eu-1",
    *,
    user_labels: dict[str, str] | None = None,
    placement: dict[str, str] | None = None,
    installation: str = INSTALLATION,
    **proxy_changes: Any,
) -> CreateRequest:
    return CreateRequest(
        name=instance_name(owner, 1),
        proxy=proxy_settings(**proxy_changes),
        tags=owner_tags(installation, owner, 1, user_labels),
        placement=placement or {},
    )


def stored_pod(fake: FakeKubernetes, name: str, namespace: str = NAMESPACE) -> dict[str, Any]:
    pod = fake.get(PODS, namespace, name)
    assert pod is not None, f"no pod {namespace}/{name}"
    return pod


def stored_secret(
    fake: FakeKubernetes, pod_name: str, namespace: str = NAMESPACE
) -> dict[str, Any]:
    secret = fake.get(SECRETS, namespace, f"{pod_name}-squid")
    assert secret is not None, f"no secret for pod {namespace}/{pod_name}"
    return secret


def secret_files(secret: dict[str, Any]) -> dict[str, str]:
    return {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}


def raises_from(error: type[ProviderError], fn: Callable[[], object]) -> ProviderError:
    with pytest.raises(error) as info:
        fn()
    return info.value


# --- create: the objects ---------------------------------------------------


def test_create_makes_a_pod_that_runs_squid_as_pid_1_locked_down(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    req = request(user_labels={"team": "crawl"})

    instance = provider.create(req)

    assert instance.provider_id == f"{NAMESPACE}/{req.name}"
    assert (instance.name, instance.state, instance.ip, instance.port) == (
        req.name,
        InstanceState.PROVISIONING,
        "",
        3128,
    )
    pod = stored_pod(fake, req.name)
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert container["image"] == SETTINGS.image
    # Squid itself is the entrypoint, in the foreground: no shell to swallow SIGTERM.
    assert container["command"] == ["/usr/sbin/squid"]
    assert container["args"] == ["-N", "-f", f"{CONFIG_DIR}/squid.conf"]
    assert container["ports"] == [{"name": "proxy", "containerPort": 3128, "protocol": "TCP"}]
    assert container["readinessProbe"]["tcpSocket"] == {"port": "proxy"}
    assert container["resources"] == {
        "requests": {"cpu": "100m", "memory": "128Mi"},
        "limits": {"cpu": "100m", "memory": "128Mi"},
    }
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": SQUID_UID,
        "runAsGroup": SQUID_UID,
        "fsGroup": SQUID_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    # The Cluster Autoscaler may evict it (drain ignores this): the workflow replaces it.
    assert pod["metadata"]["annotations"]["cluster-autoscaler.kubernetes.io/safe-to-evict"] == (
        "true"
    )
    assert spec["automountServiceAccountToken"] is False
    assert spec["restartPolicy"] == "Never"
    assert "hostNetwork" not in spec
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert mounts["config"] == {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}
    assert volumes["config"]["secret"] == {"secretName": f"{req.name}-squid", "defaultMode": 0o440}
    # The only writable path on a read-only root: Squid's working directory.
    assert mounts["spool"]["mountPath"] == SPOOL_DIR
    assert "emptyDir" in volumes["spool"]


def test_proxy_pods_are_guaranteed_qos_by_default_so_memory_pressure_evicts_them_last(
    fake: FakeKubernetes,
) -> None:
    provider = provider_for(fake.configuration(), settings=KubernetesConfig(namespace=NAMESPACE))
    req = request()

    provider.create(req)

    pod = stored_pod(fake, req.name)
    assert pod["status"]["qosClass"] == "Guaranteed"
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["requests"] == container["resources"]["limits"]


def test_a_request_below_its_limit_makes_the_pod_burstable(fake: FakeKubernetes) -> None:
    settings = SETTINGS.model_copy(update={"memory_request": "64Mi"})
    req = request()

    provider_for(fake.configuration(), settings=settings).create(req)

    assert stored_pod(fake, req.name)["status"]["qosClass"] == "Burstable"


def test_the_priority_class_goes_on_the_pod_and_the_cluster_gives_its_priority(
    fake: FakeKubernetes,
) -> None:
    fake.add_priority_class("proxies-high", 1000000)
    settings = SETTINGS.model_copy(update={"priority_class_name": "proxies-high"})
    req = request()

    provider_for(fake.configuration(), settings=settings).create(req)

    spec = stored_pod(fake, req.name)["spec"]
    assert (spec["priorityClassName"], spec["priority"]) == ("proxies-high", 1000000)


def test_without_a_priority_class_the_pod_has_the_default_priority(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    req = request()

    provider.create(req)

    spec = stored_pod(fake, req.name)["spec"]
    assert "priorityClassName" not in spec and spec["priority"] == 0


def test_a_priority_class_the_cluster_lacks_is_permanent_naming_it(fake: FakeKubernetes) -> None:
    settings = SETTINGS.model_copy(update={"priority_class_name": "proxies-hihg"})
    provider = provider_for(fake.configuration(), settings=settings)

    error = raises_from(Permanent, lambda: provider.create(request()))

    assert "no PriorityClass with name proxies-hihg" in str(error)
    assert fake.get(PODS, NAMESPACE, request().name) is None


def test_create_labels_every_tag_and_keeps_the_exact_tags_in_an_annotation(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    req = request("tenant:eu/Proxy #1", user_labels={"team": "crawl", "Cost Centre": "R&D 42"})

    instance = provider.create(req)

    assert instance.tags == req.tags
    meta = stored_pod(fake, req.name)["metadata"]
    assert json.loads(meta["annotations"][TAGS_ANNOTATION]) == req.tags
    assert meta["labels"] == labels(req.tags)
    assert meta["labels"]["managed-by"] == "proxy-operator"
    assert meta["labels"][INSTALLATION_KEY] == INSTALLATION
    assert meta["labels"]["proxy-operator/generation"] == "1"
    assert meta["labels"][OWNER_KEY] == short_hash("tenant:eu/Proxy #1")
    assert meta["labels"]["label/team"] == "crawl"
    for key, value in meta["labels"].items():
        assert LABEL_KEY.fullmatch(key), key
        assert LABEL_VALUE.fullmatch(value), value


def test_create_mounts_the_rendered_config_from_a_secret_owned_by_the_pod(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    req = request()

    provider.create(req)

    pod = stored_pod(fake, req.name)
    secret = stored_secret(fake, req.name)
    assert secret["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": req.name, "uid": pod["metadata"]["uid"]}
    ]
    assert secret["metadata"]["labels"] == pod["metadata"]["labels"]
    assert secret["immutable"] is True
    files = secret_files(secret)
    assert files["squid.conf"] == render(req.proxy, SQUID_PATHS).squid_conf
    # Squid finds the htpasswd in the mounted directory, and it holds the password's hash.
    assert f"basic_ncsa_auth {CONFIG_DIR}/passwords" in files["squid.conf"]
    user, hashed = files["passwords"].strip().split(":", 1)
    assert (user, hashed) == ("proxy", sha512_crypt(PASSWORD, hashed))
    assert PASSWORD not in json.dumps(pod) + files["squid.conf"]


def test_create_uses_the_placement_namespace(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    req = request(placement={"namespace": "team-a"})

    instance = provider.create(req)

    assert instance.provider_id == f"team-a/{req.name}"
    assert fake.get(PODS, NAMESPACE, req.name) is None
    assert stored_secret(fake, req.name, "team-a")["metadata"]["namespace"] == "team-a"


@pytest.mark.parametrize(
    ("req", "complaint"),
    [
        (request(placement={"namespace": "Not_A_Namespace"}), "namespace"),
        (request(placement={"namespace": "kube-system"}), "allowed_namespaces"),
        (request(installation="someone-else"), INSTALLATION_KEY),
        (request(allowed_cidrs=()), "allowed_cidrs"),
    ],
    ids=["bad-namespace", "not-allowed-namespace", "other-installation", "open-proxy"],
)
def test_create_refuses_requests_it_must_not_carry_out(
    fake: FakeKubernetes, provider: KubernetesProvider, req: CreateRequest, complaint: str
) -> None:
    error = raises_from(Permanent, lambda: provider.create(req))

    assert complaint in str(error)
    assert fake.verbs_used() == set()


def test_a_port_below_1024_is_made_bindable_by_the_safe_sysctl(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    low, high = request("proxy-low", port=80), request("proxy-high", port=1024)

    provider.create(low)
    provider.create(high)

    assert stored_pod(fake, low.name)["spec"]["securityContext"]["sysctls"] == [
        {"name": "net.ipv4.ip_unprivileged_port_start", "value": "80"}
    ]
    assert "sysctls" not in stored_pod(fake, high.name)["spec"]["securityContext"]


def test_an_unset_uid_is_left_to_the_platform(fake: FakeKubernetes) -> None:
    """OpenShift's restricted SCC assigns the uid, gid and fsGroup from the namespace's range."""
    settings = SETTINGS.model_copy(update={"run_as_user": None})
    req = request()

    provider_for(fake.configuration(), settings=settings).create(req)

    assert stored_pod(fake, req.name)["spec"]["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def test_a_create_into_a_namespace_that_does_not_exist_is_permanent(
    fake: FakeKubernetes,
) -> None:
    settings = SETTINGS.model_copy(update={"allowed_namespaces": [NAMESPACE, "not-created-yet"]})
    provider = provider_for(fake.configuration(), settings=settings)

    error = raises_from(
        Permanent, lambda: provider.create(request(placement={"namespace": "not-created-yet"}))
    )

    assert "namespace 'not-created-yet' does not exist" in error.message


# --- create: adopting ------------------------------------------------------


def test_create_again_adopts_the_pod_and_its_secret(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    req = request()
    first = provider.create(req)
    uid = stored_pod(fake, req.name)["metadata"]["uid"]

    again = provider.create(req)

    assert again == first
    assert stored_pod(fake, req.name)["metadata"]["uid"] == uid


@pytest.mark.parametrize(
    ("tags", "mismatch"),
    [
        (None, "managed-by=None"),
        (owner_tags(INSTALLATION, "someone-else", 1), "proxy-operator/owner='someone-else'"),
        (owner_tags(INSTALLATION, "proxy-eu-1", 7), "proxy-operator/generation='7'"),
        (owner_tags("other", "proxy-eu-1", 1), "proxy-operator/installation='other'"),
    ],
    ids=["made-by-hand", "other-owner", "other-generation", "other-installation"],
)
def test_create_never_adopts_a_pod_of_the_same_name_that_is_not_this_proxys(
    fake: FakeKubernetes,
    provider: KubernetesProvider,
    tags: dict[str, str] | None,
    mismatch: str,
) -> None:
    req = request()
    annotations = {TAGS_ANNOTATION: json.dumps(tags)} if tags else {}
    fake.add(PODS, foreign_pod(NAMESPACE, req.name, annotations=annotations))

    error = raises_from(Permanent, lambda: provider.create(req))

    assert mismatch in error.message
    assert fake.get(SECRETS, NAMESPACE, f"{req.name}-squid") is None


def test_create_after_the_secret_failed_adopts_the_pod_and_creates_the_secret(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    req = request()
    fake.fail("POST", f"/namespaces/{NAMESPACE}/secrets$", 503, "etcd leader changed")
    raises_from(Transient, lambda: provider.create(req))
    assert fake.get(SECRETS, NAMESPACE, f"{req.name}-squid") is None

    instance = provider.create(req)

    assert instance.name == req.name
    pod_uid = stored_pod(fake, req.name)["metadata"]["uid"]
    assert stored_secret(fake, req.name)["metadata"]["ownerReferences"][0]["uid"] == pod_uid


# --- get: phases -----------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "pod_ip", "state", "ip"),
    [
        ("Pending", "", InstanceState.PROVISIONING, ""),
        ("Running", "", InstanceState.PROVISIONING, ""),
        ("Running", "10.244.1.7", InstanceState.RUNNING, "10.244.1.7"),
        ("Succeeded", "10.244.1.7", InstanceState.TERMINATED, ""),
        ("Failed", "10.244.1.7", InstanceState.TERMINATED, ""),
        ("Unknown", "10.244.1.7", InstanceState.TERMINATED, ""),
    ],
)
def test_get_maps_the_pod_phase(
    fake: FakeKubernetes,
    provider: KubernetesProvider,
    phase: str,
    pod_ip: str,
    state: InstanceState,
    ip: str,
) -> None:
    created = provider.create(request())
    fake.set_pod_status(NAMESPACE, created.name, phase, pod_ip)

    instance = provider.get(created.provider_id)

    assert (instance.state, instance.ip, instance.endpoint) == (
        state,
        ip,
        f"{ip}:3128" if ip else "",
    )
    assert instance.tags == created.tags
    assert instance.created_at == created.created_at


@pytest.mark.parametrize(
    ("waiting_reason", "shown"),
    [
        ("InvalidImageName", "invalid image name"),
        ("CreateContainerConfigError", "container config error"),
    ],
)
def test_a_pod_that_can_never_start_is_written_off_at_once_with_the_reason(
    fake: FakeKubernetes, provider: KubernetesProvider, waiting_reason: str, shown: str
) -> None:
    created = provider.create(request())
    message = 'couldn\'t parse image name "ubuntu/squid:BAD TAG"'
    fake.set_container_waiting(NAMESPACE, created.name, waiting_reason, message)

    instance = provider.get(created.provider_id)

    assert instance.state is InstanceState.TERMINATED
    assert instance.reason == f"{shown}: {waiting_reason}: {message}"


@pytest.mark.parametrize(
    ("waiting_reason", "shown"),
    [
        ("ErrImagePull", "image pull failed"),
        ("ImagePullBackOff", "image pull failed"),
        ("CreateContainerError", "container could not be created"),
    ],
)
def test_a_pull_the_kubelet_retries_is_transient_then_written_off_naming_the_image(
    fake: FakeKubernetes, waiting_reason: str, shown: str
) -> None:
    """A registry's 5xx or 429 passes, and the kubelet pulls again: no crash at first sight."""
    provider = provider_for(
        fake.configuration(),
        settings=SETTINGS.model_copy(update={"image_pull_timeout_seconds": 300}),
    )
    created = provider.create(request())
    message = "toomanyrequests: You have reached your unauthenticated pull rate limit."
    fake.set_container_waiting(NAMESPACE, created.name, waiting_reason, message)

    retrying = raises_from(Transient, lambda: provider.get(created.provider_id))
    listed = provider.list_by_tag(OWNER_KEY, "proxy-eu-1")
    fake.move_back(NAMESPACE, created.name, "creationTimestamp", 301)
    given_up = provider.get(created.provider_id)

    image = SETTINGS.image
    assert retrying.message.startswith(
        f"pod {created.provider_id}: {shown} for image {image}, the kubelet retries"
    )
    assert retrying.message.endswith(f"{waiting_reason}: {message}")
    assert [i.state for i in listed] == [InstanceState.PROVISIONING]
    assert given_up.state is InstanceState.TERMINATED
    assert re.match(rf"{re.escape(f'{shown} for image {image} for ')}3\d\ds", given_up.reason)
    assert given_up.reason.endswith(f"{waiting_reason}: {message}")


def test_a_pod_waiting_for_a_reason_that_passes_stays_provisioning(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    created = provider.create(request())
    fake.set_container_waiting(NAMESPACE, created.name, "ContainerCreating", "")

    assert provider.get(created.provider_id).state is InstanceState.PROVISIONING


def test_an_unschedulable_pod_is_a_capacity_wait_after_the_configured_time_never_a_loss(
    fake: FakeKubernetes,
) -> None:
    """A full cluster frees capacity later; the scheduler keeps the Pod queued meanwhile."""
    provider = provider_for(
        fake.configuration(),
        settings=SETTINGS.model_copy(update={"unschedulable_timeout_seconds": 120}),
    )
    created = provider.create(request())
    message = "0/3 nodes are available: 3 Insufficient memory."
    fake.set_unschedulable(NAMESPACE, created.name, message)

    waiting = provider.get(created.provider_id)
    fake.move_back(NAMESPACE, created.name, "creationTimestamp", 3600)
    capacity = raises_from(QuotaExceeded, lambda: provider.get(created.provider_id))
    listed = provider.list_by_tag(OWNER_KEY, "proxy-eu-1")
    fake.set_pod_status(NAMESPACE, created.name, "Running", "10.244.1.7")
    placed = provider.get(created.provider_id)

    assert (waiting.state, waiting.reason) == (
        InstanceState.PROVISIONING,
        f"unschedulable: {message}",
    )
    shown = f"waiting for capacity, unschedulable: {message} (for 360"
    assert capacity.message.startswith(f"pod {created.provider_id}: {shown}")
    assert [i.state for i in listed] == [InstanceState.PROVISIONING]
    assert listed[0].reason.startswith(shown)
    assert (placed.state, placed.endpoint) == (InstanceState.RUNNING, "10.244.1.7:3128")


def test_running_needs_the_ready_condition(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    """Until Squid's port answers the readiness probe there is no endpoint to hand out."""
    created = provider.create(request())
    fake.set_pod_status(NAMESPACE, created.name, "Running", "10.244.1.7", ready=False)
    starting = provider.get(created.provider_id)
    fake.set_pod_status(NAMESPACE, created.name, "Running", "10.244.1.7", ready=True)
    ready = provider.get(created.provider_id)

    assert (starting.state, starting.endpoint) == (InstanceState.PROVISIONING, "")
    assert (ready.state, ready.endpoint) == (InstanceState.RUNNING, "10.244.1.7:3128")


def test_an_ipv6_pod_ip_gives_a_bracketed_endpoint(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    created = provider.create(request())
    fake.set_pod_status(NAMESPACE, created.name, "Running", "fd00:10:244::7")

    instance = provider.get(created.provider_id)

    assert (instance.ip, instance.endpoint) == ("fd00:10:244::7", "[fd00:10:244::7]:3128")


# --- disruptions: Kubernetes takes the Pod away -----------------------------

POD_IP = "10.244.1.7"


def running_pod(fake: FakeKubernetes, provider: KubernetesProvider) -> Instance:
    created = provider.create(request())
    fake.set_pod_status(NAMESPACE, created.name, "Running", POD_IP)
    assert provider.get(created.provider_id).state is InstanceState.RUNNING
    return created


def test_a_pod_evicted_through_the_eviction_api_is_a_disruption_not_a_failure(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    """A drain: the Eviction API marks the Pod DisruptionTarget, then deletes it.

    The kubelet confirms a second later, long before the workflow's next
    probe: the provider's finalizer keeps the Pod readable until its delete.
    """
    created = running_pod(fake, provider)

    fake.evict(NAMESPACE, created.name)
    fake.finish_deletion(NAMESPACE, created.name)

    evicted = provider.get(created.provider_id)
    assert (evicted.state, evicted.ip) == (InstanceState.TERMINATED, "")
    assert evicted.disruption is Disruption.EVICTED
    assert evicted.reason == "evicted: EvictionByEvictionAPI: Eviction API: evicting"
    assert stored_pod(fake, created.name)["metadata"]["deletionTimestamp"]
    assert ("pods/eviction", "create") in fake.verbs_used()

    provider.delete(created.provider_id)  # the workflow's delete lets it go
    raises_from(NotFound, lambda: provider.get(created.provider_id))
    assert fake.get(SECRETS, NAMESPACE, f"{created.name}-squid") is None


@pytest.mark.parametrize(
    ("reason", "message"),
    [
        (
            PREEMPTION_BY_SCHEDULER,
            "default-scheduler: preempting to accommodate a higher priority pod",
        ),
        (DELETION_BY_TAINT_MANAGER, "Taint manager: deleting due to NoExecute taint"),
    ],
    ids=["preempted", "tainted-node"],
)
def test_a_pod_the_control_plane_deletes_for_a_disruption_is_one_naming_why(
    fake: FakeKubernetes, provider: KubernetesProvider, reason: str, message: str
) -> None:
    created = running_pod(fake, provider)

    fake.disrupt(NAMESPACE, created.name, reason, message)
    fake.finish_deletion(NAMESPACE, created.name)  # Squid stopped within a second

    disrupted = provider.get(created.provider_id)
    assert (disrupted.state, disrupted.disruption) == (
        InstanceState.TERMINATED,
        Disruption.EVICTED,
    )
    assert disrupted.reason == f"evicted: {reason}: {message}"


def test_a_pod_the_kubelet_evicts_under_node_pressure_is_a_disruption_naming_it(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    """The Pod stays in the API, Failed with reason Evicted, until someone deletes it."""
    created = running_pod(fake, provider)
    message = (
        "The node was low on resource: memory. Threshold quantity: 100Mi, available: 51200Ki. "
    )

    fake.evict_for_node_pressure(NAMESPACE, created.name, message)

    evicted = provider.get(created.provider_id)
    assert (evicted.state, evicted.ip) == (InstanceState.TERMINATED, "")
    assert (evicted.disruption, evicted.reason) == (Disruption.EVICTED, f"evicted: {message}")
    (listed,) = provider.list_by_tag(OWNER_KEY, "proxy-eu-1")
    assert listed.disruption is Disruption.EVICTED


def test_an_interrupted_disruption_leaves_a_ready_pod_running(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    """The condition was set but the Pod never deleted: it still serves, nothing to replace."""
    created = running_pod(fake, provider)

    fake.start_disruption(
        NAMESPACE, created.name, PREEMPTION_BY_SCHEDULER, "default-scheduler: preempting"
    )

    instance = provider.get(created.provider_id)
    assert (instance.state, instance.ip, instance.disruption) == (
        InstanceState.RUNNING,
        POD_IP,
        None,
    )


def test_a_pod_whose_squid_exits_is_no_disruption(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    """Squid's own end is the proxy's loss: it spends the crash budget."""
    created = running_pod(fake, provider)
    fake.set_pod_status(NAMESPACE, created.name, "Failed", POD_IP)

    ended = provider.get(created.provider_id)

    assert (ended.state, ended.disruption) == (InstanceState.TERMINATED, None)
    assert "evicted" not in ended.reason


def core_api(fake: FakeKubernetes) -> kubernetes.client.CoreV1Api:
    """Another client of the cluster: kubectl, a controller, an admin."""
    return kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(fake.configuration()))


def test_a_pod_deleted_by_hand_stays_until_its_workflow_deletes_it_as_a_disruption(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    """`kubectl delete pod` (or a drain with --disable-eviction) sets no condition, but
    the finalizer says proxy-operator did not delete it: no failure of Squid's."""
    created = running_pod(fake, provider)

    core_api(fake).delete_namespaced_pod(created.name, NAMESPACE)
    fake.finish_deletion(NAMESPACE, created.name)

    deleted = provider.get(created.provider_id)
    assert (deleted.state, deleted.disruption) == (InstanceState.TERMINATED, Disruption.EVICTED)
    assert deleted.reason == DELETED_BY_ANOTHER_CLIENT
    provider.delete(created.provider_id)
    assert fake.get(PODS, NAMESPACE, created.name) is None


def test_a_pod_made_before_the_finalizer_and_deleted_by_hand_is_no_disruption(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    """Without the finalizer nothing says who deleted it: taken as the proxy's loss."""
    created = running_pod(fake, provider)
    core_api(fake).patch_namespaced_pod(
        created.name, NAMESPACE, {"metadata": {"finalizers": None}}, _content_type=MERGE_PATCH
    )

    core_api(fake).delete_namespaced_pod(created.name, NAMESPACE)

    ended = provider.get(created.provider_id)
    assert (ended.state, ended.disruption, ended.reason) == (
        InstanceState.TERMINATED,
        None,
        "being deleted",
    )
    fake.finish_deletion(NAMESPACE, created.name)
    raises_from(NotFound, lambda: provider.get(created.provider_id))


def test_get_of_a_missing_pod_is_not_found(provider: KubernetesProvider) -> None:
    raises_from(NotFound, lambda: provider.get(f"{NAMESPACE}/proxy-gone"))


@pytest.mark.parametrize(
    "provider_id", ["", "proxies", "proxies/", "/proxy-x", "Proxies/proxy-x", "a/b/c", "ns/UPPER"]
)
def test_malformed_provider_ids_are_permanent(
    fake: FakeKubernetes, provider: KubernetesProvider, provider_id: str
) -> None:
    raises_from(Permanent, lambda: provider.get(provider_id))
    raises_from(Permanent, lambda: provider.delete(provider_id))
    assert fake.verbs_used() == set()


# --- delete ----------------------------------------------------------------


def test_delete_is_graceful_then_not_found_and_takes_the_secret_along(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    created = provider.create(request())
    assert stored_pod(fake, created.name)["metadata"]["finalizers"] == [FINALIZER]
    fake.set_pod_status(NAMESPACE, created.name, "Running", "10.244.1.7")
    assert provider.get(created.provider_id).state is InstanceState.RUNNING

    provider.delete(created.provider_id)

    # Still there while Squid drains, but no longer an endpoint to hand out.
    terminating = provider.get(created.provider_id)
    assert (terminating.state, terminating.ip) == (InstanceState.TERMINATED, "")
    provider.delete(created.provider_id)  # again, while terminating: still fine

    fake.finish_deletion(NAMESPACE, created.name)

    raises_from(NotFound, lambda: provider.get(created.provider_id))
    assert fake.get(SECRETS, NAMESPACE, f"{created.name}-squid") is None
    provider.delete(created.provider_id)  # gone: deleting is still success


def test_a_pod_stuck_terminating_is_deleted_again_with_grace_period_zero(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    """Its node stopped reporting, so no kubelet will ever confirm the graceful delete."""
    created = provider.create(request())
    fake.set_pod_status(NAMESPACE, created.name, "Running", "10.244.1.7")
    provider.delete(created.provider_id)
    provider.delete(created.provider_id)  # within the grace period: left alone
    assert fake.get(PODS, NAMESPACE, created.name) is not None

    # The deletionTimestamp is the end of the 10 s grace period; 60 s past it is stuck.
    fake.move_back(NAMESPACE, created.name, "deletionTimestamp", 10 + 61)
    stuck = provider.get(created.provider_id)
    provider.delete(created.provider_id)

    assert stuck.state is InstanceState.TERMINATED
    assert "stuck terminating" in stuck.reason and "grace period 0" in stuck.reason
    assert fake.get(PODS, NAMESPACE, created.name) is None
    assert fake.get(SECRETS, NAMESPACE, f"{created.name}-squid") is None


@pytest.mark.parametrize(
    ("annotations", "mismatch"),
    [
        ({}, "managed-by=None"),
        (
            {TAGS_ANNOTATION: json.dumps(owner_tags("other-installation", "proxy-eu-1", 1))},
            "proxy-operator/installation='other-installation'",
        ),
    ],
    ids=["made-by-hand", "other-installation"],
)
def test_delete_refuses_a_pod_that_is_not_ours(
    fake: FakeKubernetes, provider: KubernetesProvider, annotations: dict[str, str], mismatch: str
) -> None:
    fake.add(PODS, foreign_pod(NAMESPACE, "proxy-not-ours", annotations=annotations))

    raised = raises_from(Permanent, lambda: provider.delete(f"{NAMESPACE}/proxy-not-ours"))

    assert mismatch in raised.message
    assert fake.get(PODS, NAMESPACE, "proxy-not-ours") is not None


def test_the_fake_refuses_a_delete_whose_uid_precondition_does_not_match(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    """What the provider's UID precondition guards against: a same-named successor."""
    created = provider.create(request())
    core = kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(fake.configuration()))
    stale = kubernetes.client.V1DeleteOptions(
        preconditions=kubernetes.client.V1Preconditions(uid=str(uuid.uuid4()))
    )

    with pytest.raises(ApiException) as raised:
        core.delete_namespaced_pod(created.name, NAMESPACE, body=stale)

    assert raised.value.status == 409
    assert "Precondition failed" in str(raised.value.body)
    assert fake.get(PODS, NAMESPACE, created.name) is not None


def test_delete_of_a_pod_that_never_existed_is_success(provider: KubernetesProvider) -> None:
    provider.delete(f"{NAMESPACE}/proxy-never-was")


def test_delete_of_a_pod_never_scheduled_removes_it_at_once(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    """No kubelet to wait for, and the provider's finalizer removed first."""
    created = provider.create(request())

    provider.delete(created.provider_id)

    raises_from(NotFound, lambda: provider.get(created.provider_id))


def test_delete_removes_only_the_providers_finalizer(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    """Another controller's finalizer is its own to remove: the Pod waits for it."""
    created = provider.create(request())
    other = "example.com/audit"
    core_api(fake).patch_namespaced_pod(
        created.name,
        NAMESPACE,
        {"metadata": {"finalizers": [other]}},
        _content_type=STRATEGIC_MERGE_PATCH,
    )
    assert stored_pod(fake, created.name)["metadata"]["finalizers"] == [FINALIZER, other]

    provider.delete(created.provider_id)

    held = stored_pod(fake, created.name)["metadata"]
    assert held["finalizers"] == [other] and held["deletionTimestamp"]
    core_api(fake).patch_namespaced_pod(
        created.name, NAMESPACE, {"metadata": {"finalizers": []}}, _content_type=MERGE_PATCH
    )
    raises_from(NotFound, lambda: provider.get(created.provider_id))


def test_the_fake_keeps_a_pod_with_finalizers_as_the_api_server_does(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    """kubernetes.io/docs/concepts/overview/working-with-objects/finalizers/: marked,
    202 Accepted, no new finalizer while deleting, gone with the last one."""
    created = provider.create(request())
    core = core_api(fake)

    _, status, _ = core.delete_namespaced_pod_with_http_info(created.name, NAMESPACE)
    with pytest.raises(ApiException) as added:
        core.patch_namespaced_pod(
            created.name,
            NAMESPACE,
            {"metadata": {"finalizers": ["example.com/late"]}},
            _content_type=STRATEGIC_MERGE_PATCH,
        )
    held = stored_pod(fake, created.name)["metadata"]
    core.patch_namespaced_pod(
        created.name,
        NAMESPACE,
        {"metadata": {"$deleteFromPrimitiveList/finalizers": [FINALIZER]}},
        _content_type=STRATEGIC_MERGE_PATCH,
    )

    assert status == 202
    assert added.value.status == 422 and "no new finalizers" in str(added.value.body)
    assert held["deletionTimestamp"] and held["finalizers"] == [FINALIZER]
    assert fake.get(PODS, NAMESPACE, created.name) is None
    assert fake.get(SECRETS, NAMESPACE, f"{created.name}-squid") is None


# --- list_by_tag -----------------------------------------------------------


def foreign_pod(namespace: str, name: str, **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, **meta},
        "spec": {"containers": [{"name": "app", "image": "nginx:1.27"}]},
    }


def provider_ids(instances: list[Instance]) -> set[str]:
    return {instance.provider_id for instance in instances}


def test_list_by_tag_finds_tagged_pods_in_every_allowed_namespace_and_nothing_else(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    ours = provider.create(request("proxy-a", user_labels={"team": "crawl"}))
    other_ns = provider.create(request("proxy-b", placement={"namespace": "team-b"}))
    theirs = provider_for(fake.configuration(), installation="other").create(
        request("proxy-c", installation="other", user_labels={"team": "crawl"})
    )
    fake.add(PODS, foreign_pod("default", "web"))
    # Ours by its tags, but in a namespace this provider is not allowed into.
    outside = request("proxy-a", user_labels={"team": "crawl"})
    fake.add(
        PODS,
        foreign_pod(
            "kube-system",
            outside.name,
            labels=labels(outside.tags),
            annotations={TAGS_ANNOTATION: json.dumps(outside.tags)},
        ),
    )
    # Labelled like ours, hash collision included, but not carrying the tag.
    fake.add(
        PODS,
        foreign_pod(
            "default",
            "impostor",
            labels={"managed-by": "proxy-operator", OWNER_KEY: short_hash("proxy-a")},
            annotations={TAGS_ANNOTATION: json.dumps({OWNER_KEY: "not-proxy-a"})},
        ),
    )

    assert provider_ids(provider.list_by_tag(INSTALLATION_KEY, INSTALLATION)) == {
        ours.provider_id,
        other_ns.provider_id,
    }
    assert provider_ids(provider.list_by_tag(OWNER_KEY, "proxy-a")) == {ours.provider_id}
    assert provider_ids(provider.list_by_tag("label/team", "crawl")) == {
        ours.provider_id,
        theirs.provider_id,
    }
    assert provider.list_by_tag(OWNER_KEY, "nobody") == []


def test_list_by_tag_returns_instances_with_their_state(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    created = provider.create(request("proxy-a"))
    fake.set_pod_status(NAMESPACE, created.name, "Running", "10.244.3.9")

    (listed,) = provider.list_by_tag(OWNER_KEY, "proxy-a")

    assert listed == provider.get(created.provider_id)
    assert listed.endpoint == "10.244.3.9:3128"


def test_list_by_tag_reads_every_page(
    fake: FakeKubernetes, provider: KubernetesProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kubernetes_provider, "LIST_PAGE_SIZE", 2)
    created = {provider.create(request(f"proxy-{i}")).provider_id for i in range(5)}

    assert provider_ids(provider.list_by_tag(INSTALLATION_KEY, INSTALLATION)) == created


def test_tags_that_labels_cannot_hold_still_round_trip_through_list_by_tag(
    provider: KubernetesProvider,
) -> None:
    req = request("tenant:eu/Proxy #1", user_labels={"Cost Centre": "R&D 42"})
    created = provider.create(req)

    assert provider.list_by_tag(OWNER_KEY, "tenant:eu/Proxy #1") == [created]
    assert provider.list_by_tag("label/Cost Centre", "R&D 42") == [created]


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("managed-by", "managed-by"),
        ("proxy-operator/installation", "proxy-operator/installation"),
        ("label/team", "label/team"),
        ("label/Team.Name_1", "label/Team.Name_1"),
    ],
)
def test_valid_tag_keys_are_their_own_label_keys(key: str, expected: str) -> None:
    assert label_key(key) == expected


def test_invalid_tag_keys_become_distinct_valid_label_keys() -> None:
    keys = ["label/Cost Centre", "label/Cost-Centre!", "label/a/b", "label/" + "x" * 80, "/"]

    converted = [label_key(key) for key in keys]

    assert all(LABEL_KEY.fullmatch(key) for key in converted), converted
    assert len(set(converted)) == len(keys)
    assert converted[0].startswith("proxy-operator/label-Cost-Centre-")


def test_label_values_are_kept_when_valid_else_hashed_and_owners_always_hashed() -> None:
    assert label_value("label/team", "crawl") == "crawl"
    assert label_value("label/team", "") == ""
    assert label_value("label/team", "R&D 42") == short_hash("R&D 42")
    assert label_value(OWNER_KEY, "proxy-eu-1") == short_hash("proxy-eu-1")


# --- errors at the edge ----------------------------------------------------


@pytest.mark.parametrize(
    ("status", "message", "headers", "error", "retry_after"),
    [
        (403, QUOTA_MESSAGE, {}, QuotaExceeded, None),
        (403, RBAC_MESSAGE, {}, Permanent, None),
        (400, "the body of the request was in an unknown format", {}, Permanent, None),
        (401, "Unauthorized", {}, Permanent, None),
        (
            422,
            'Pod "proxy-x" is invalid: spec.containers[0].image: Required value',
            {},
            Permanent,
            None,
        ),
        (429, "too many requests, please try again later", {"Retry-After": "7"}, Transient, 7.0),
        (500, "Internal error occurred: etcdserver: request timed out", {}, Transient, None),
        (
            503,
            "the server is currently unable to handle the request",
            {"Retry-After": "3"},
            Transient,
            3.0,
        ),
    ],
)
def test_api_errors_on_create_map_to_the_taxonomy(
    fake: FakeKubernetes,
    provider: KubernetesProvider,
    status: int,
    message: str,
    headers: dict[str, str],
    error: type[ProviderError],
    retry_after: float | None,
) -> None:
    req = request()
    fake.fail("POST", f"/namespaces/{NAMESPACE}/pods$", status, message, headers=headers)

    raised = raises_from(error, lambda: provider.create(req))

    assert type(raised) is error
    assert message in raised.message
    assert raised.retry_after_seconds == retry_after
    assert isinstance(raised.cause, ApiException)
    assert raised.cause.status == status
    assert fake.get(PODS, NAMESPACE, req.name) is None


def list_owner_x(p: KubernetesProvider, _: str) -> object:
    return p.list_by_tag(OWNER_KEY, "x")


@pytest.mark.parametrize(
    ("method", "path", "status", "error", "call"),
    [
        ("GET", "/pods/{name}$", 404, NotFound, lambda p, pid: p.get(pid)),
        ("GET", "/pods/{name}$", 500, Transient, lambda p, pid: p.get(pid)),
        ("DELETE", "/pods/{name}$", 403, Permanent, lambda p, pid: p.delete(pid)),
        ("DELETE", "/pods/{name}$", 409, Transient, lambda p, pid: p.delete(pid)),
        ("GET", "/pods/{name}$", 403, Permanent, lambda p, pid: p.delete(pid)),
        ("GET", f"^/api/v1/namespaces/{NAMESPACE}/pods$", 429, Transient, list_owner_x),
        ("GET", f"^/api/v1/namespaces/{NAMESPACE}/pods$", 403, Permanent, list_owner_x),
    ],
    ids=[
        "get-404",
        "get-500",
        "delete-403",
        "delete-409",
        "delete-read-403",
        "list-429",
        "list-403",
    ],
)
def test_every_operation_translates_api_errors(
    fake: FakeKubernetes,
    provider: KubernetesProvider,
    method: str,
    path: str,
    status: int,
    error: type[ProviderError],
    call: Callable[[KubernetesProvider, str], object],
) -> None:
    created = provider.create(request())
    fake.fail(method, path.format(name=created.name), status, "injected")

    raised = raises_from(error, lambda: call(provider, created.provider_id))

    assert type(raised) is error


def test_a_manifest_the_client_rejects_is_permanent(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    """A value of the wrong type fails the client's own validation, on every retry."""
    req = request(port=3128.5)

    raised = raises_from(Permanent, lambda: provider.create(req))

    assert "containerPort" in raised.message or "container_port" in raised.message
    assert fake.verbs_used() == set()


def test_a_conflict_is_only_adopted_by_create(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    """409 on create means "already there"; elsewhere it is a race worth retrying."""
    created = provider.create(request())
    fake.fail("GET", f"/pods/{created.name}$", 409, "the object has been modified")

    raises_from(Transient, lambda: provider.get(created.provider_id))


OPERATIONS: list[Callable[[KubernetesProvider], object]] = [
    lambda p: p.create(request()),
    lambda p: p.get(f"{NAMESPACE}/proxy-x"),
    lambda p: p.delete(f"{NAMESPACE}/proxy-x"),
    lambda p: p.list_by_tag(OWNER_KEY, "x"),
]


@pytest.mark.parametrize("call", OPERATIONS, ids=["create", "get", "delete", "list"])
def test_a_refused_connection_is_transient(call: Callable[[KubernetesProvider], object]) -> None:
    configuration = kubernetes.client.Configuration(host=f"http://127.0.0.1:{free_port()}")

    raised = raises_from(Transient, lambda: call(provider_for(configuration)))

    assert "127.0.0.1" in raised.message


def test_a_request_that_outlives_the_timeout_is_transient(fake: FakeKubernetes) -> None:
    provider = provider_for(
        fake.configuration(), settings=SETTINGS.model_copy(update={"request_timeout_seconds": 0.3})
    )
    fake.fail("GET", "/pods/proxy-x$", 504, "too late", delay=1.5)

    raised = raises_from(Transient, lambda: provider.get(f"{NAMESPACE}/proxy-x"))

    assert "timeout" in raised.message.lower()


# --- RBAC ------------------------------------------------------------------


def test_rbac_verbs_are_exactly_the_calls_the_provider_makes(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    """deploy/kubernetes grants RBAC_VERBS; this keeps the constant honest."""
    req = request()
    created = provider.create(req)
    provider.create(req)  # adopt: reads the existing Pod, keeps the existing Secret
    provider.get(created.provider_id)
    provider.list_by_tag(OWNER_KEY, "proxy-eu-1")
    provider.delete(created.provider_id)

    assert fake.verbs_used() == {
        (resource, verb) for resource, verbs in RBAC_VERBS.items() for verb in verbs
    }


# --- from_config: in-cluster first, then the kubeconfig ---------------------


def config_with_kubernetes_provider() -> tuple[Config, Any]:
    config = parse_config(
        {
            "installation": INSTALLATION,
            "proxy": {"auth": {"password_env": "PW"}, "allowed_cidrs": ["10.0.0.0/8"]},
            "providers": [{"name": "cluster", "type": "kubernetes", "kubernetes": {}}],
        },
        environ={"PW": PASSWORD},
    )
    return config, config.provider("cluster")


def test_from_config_prefers_the_in_cluster_service_account(
    fake: FakeKubernetes, monkeypatch: pytest.MonkeyPatch
) -> None:
    def in_cluster(client_configuration: kubernetes.client.Configuration) -> None:
        client_configuration.host = fake.url

    def kubeconfig(**_: Any) -> None:
        raise AssertionError("the kubeconfig must not be read inside a cluster")

    monkeypatch.setattr(kubernetes.config, "load_incluster_config", in_cluster)
    monkeypatch.setattr(kubernetes.config, "load_kube_config", kubeconfig)
    config, entry = config_with_kubernetes_provider()

    provider = KubernetesProvider.from_config(entry, config)

    assert provider.list_by_tag(INSTALLATION_KEY, INSTALLATION) == []
    assert ("pods", "list") in fake.verbs_used()


def test_from_config_falls_back_to_the_kubeconfig_outside_a_cluster(
    fake: FakeKubernetes, monkeypatch: pytest.MonkeyPatch
) -> None:
    def in_cluster(**_: Any) -> None:
        raise kubernetes.config.ConfigException("Service host/port is not set.")

    def kubeconfig(client_configuration: kubernetes.client.Configuration) -> None:
        client_configuration.host = fake.url

    monkeypatch.setattr(kubernetes.config, "load_incluster_config", in_cluster)
    monkeypatch.setattr(kubernetes.config, "load_kube_config", kubeconfig)
    config, entry = config_with_kubernetes_provider()

    provider = KubernetesProvider.from_config(entry, config)

    assert provider.create(request()).state is InstanceState.PROVISIONING


def test_from_config_without_a_cluster_or_kubeconfig_is_permanent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def missing(**_: Any) -> None:
        raise kubernetes.config.ConfigException("Invalid kube-config file. No configuration found.")

    monkeypatch.setattr(kubernetes.config, "load_incluster_config", missing)
    monkeypatch.setattr(kubernetes.config, "load_kube_config", missing)
    config, entry = config_with_kubernetes_provider()

    error = raises_from(Permanent, lambda: KubernetesProvider.from_config(entry, config))

    assert "kubeconfig" in str(error)


# --- the container's squid.conf, run by a real Squid ------------------------


def container_files(fake: FakeKubernetes, req: CreateRequest, root: Path) -> Path:
    """The Secret's files, with the container's paths moved under `root`; returns squid.conf."""
    files = secret_files(stored_secret(fake, req.name))
    for directory in ("config", "spool"):
        (root / directory).mkdir()
    (root / "config" / "passwords").write_text(files["passwords"])
    conf = root / "config" / "squid.conf"
    localised = files["squid.conf"].replace(CONFIG_DIR, str(root / "config"))
    conf.write_text(localised.replace(SPOOL_DIR, str(root / "spool")))
    return conf


@pytest.fixture
def container_root() -> Iterator[Path]:
    """A directory an unprivileged Squid can traverse (mkdtemp makes it 0700)."""
    root = Path(tempfile.mkdtemp(prefix="k8s-squid-"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@requires_squid
def test_the_secrets_squid_conf_passes_squid_parse(
    fake: FakeKubernetes, provider: KubernetesProvider, container_root: Path
) -> None:
    req = request()
    provider.create(req)
    conf = container_files(fake, req, container_root)

    parsed = subprocess.run(
        [SQUID, "-k", "parse", "-f", str(conf)], capture_output=True, text=True, timeout=60
    )

    assert parsed.returncode == 0, parsed.stderr
    assert "FATAL" not in parsed.stderr and "ERROR" not in parsed.stderr, parsed.stderr


@dataclass
class SquidRun:
    returncode: int | None = None
    output: list[bytes] = field(default_factory=list)

    @property
    def log(self) -> str:
        return b"".join(self.output).decode(errors="replace")


@contextlib.contextmanager
def run_like_the_pod(args: list[str], root: Path, port: int) -> Iterator[SquidRun]:
    """Squid as the Pod runs it: the container's args, as uid 13 (or this non-root
    user), the config read-only and group-readable, the spool dir the only writable
    one, stdout/stderr an inherited pipe owned by that user (runc does the same).
    Leaving the block sends SIGTERM, as a Pod deletion does, and waits for the exit.

    Only addition: a service name of its own (`-n`), because on this machine, unlike
    in a Pod, /dev/shm is shared with every other Squid, named `squid` by default.
    """
    conf = root / "config" / "squid.conf"
    as_root = os.geteuid() == 0
    uid = SQUID_UID if as_root else os.geteuid()
    os.chown(root / "spool", uid, uid)
    for path in (conf, root / "config" / "passwords"):
        os.chown(path, os.geteuid(), uid)
        path.chmod(0o440)
    run = SquidRun()
    read_end, write_end = os.pipe()
    os.fchown(write_end, uid, uid)
    reader = threading.Thread(
        target=lambda: run.output.extend(iter(lambda: os.read(read_end, 65536), b""))
    )
    reader.start()
    squid = subprocess.Popen(
        [SQUID, *args, "-n", f"k8stest{uuid.uuid4().hex[:12]}"],
        stdout=write_end,
        stderr=write_end,
        cwd=root,
        user=uid if as_root else None,
        group=uid if as_root else None,
        extra_groups=[] if as_root else None,
    )
    os.close(write_end)
    try:
        wait_until(lambda: accepts_connections(port), 30, "Squid to listen")
        yield run
    finally:
        squid.send_signal(signal.SIGTERM)
        run.returncode = squid.wait(timeout=30)
        reader.join(timeout=10)
        os.close(read_end)


@requires_squid
@pytest.mark.slow
async def test_the_container_config_serves_unprivileged_and_logs_to_stdio(
    fake: FakeKubernetes, provider: KubernetesProvider, container_root: Path, tls_origin: TlsOrigin
) -> None:
    """What the Pod does, minus Kubernetes: tunnel, refuse a wrong password, log, stop."""
    port = free_port()
    req = request(
        port=port,
        allowed_cidrs=("127.0.0.1/32",),
        allowed_connect_ports=(tls_origin.port,),
        denied_destinations=LOOPBACK_ORIGIN_DENIED,
    )
    provider.create(req)
    conf = container_files(fake, req, container_root)
    (container,) = stored_pod(fake, req.name)["spec"]["containers"]
    args = [arg.replace(CONFIG_DIR, str(conf.parent)) for arg in container["args"]]

    with run_like_the_pod(args, container_root, port) as run:
        # What the kubelet's tcpSocket readiness probe does every few seconds.
        assert accepts_connections(port)
        tunnelled = await probe_connect(
            "127.0.0.1",
            port,
            "proxy",
            PASSWORD,
            tls_origin.url,
            ssl_context=tls_origin.client_ssl_context,
        )
        refused = await probe_connect(
            "127.0.0.1",
            port,
            "proxy",
            "wrong-password",
            tls_origin.url,
            ssl_context=tls_origin.client_ssl_context,
        )

    assert tunnelled.ok, tunnelled
    assert refused.failure == PROXY_AUTH_REQUIRED
    assert run.returncode == 0, run.log
    assert f"CONNECT 127.0.0.1:{tls_origin.port}" in run.log
    assert "TCP_DENIED/407" in run.log
    # Connections that end before a request (readiness probes) log nothing.
    assert "transaction-end-before-headers" not in run.log


# --- config: allowed_namespaces --------------------------------------------


def kubernetes_block(**settings: Any) -> dict[str, Any]:
    return {
        "installation": INSTALLATION,
        "proxy": {"auth": {"password_env": "PW"}, "allowed_cidrs": ["10.0.0.0/8"]},
        "providers": [{"name": "cluster", "type": "kubernetes", "kubernetes": settings}],
    }


def test_placement_is_allowed_only_in_the_allowed_namespaces() -> None:
    default = KubernetesConfig(namespace="proxies")
    wider = KubernetesConfig(namespace="proxies", allowed_namespaces=["proxies", "team-a"])

    assert default.namespaces == ("proxies",)
    assert default.placement_problems({}) == []
    assert default.placement_problems({"namespace": "proxies"}) == []
    assert default.placement_problems({"namespace": "kube-system"}) == [
        "placement.namespace: 'kube-system' is not one of this provider's "
        "allowed_namespaces (proxies)"
    ]
    assert wider.placement_problems({"namespace": "team-a"}) == []


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        (
            {"namespace": "proxies", "allowed_namespaces": ["team-a"]},
            "providers[0].kubernetes: namespace 'proxies' must be one of allowed_namespaces",
        ),
        ({"allowed_namespaces": []}, "providers[0].kubernetes.allowed_namespaces: list should"),
        (
            {"allowed_namespaces": ["proxies", "Kube_System"]},
            "providers[0].kubernetes.allowed_namespaces[1]: string should match pattern",
        ),
        (
            {"allowed_namespaces": ["proxies", "proxies"]},
            "providers[0].kubernetes: allowed_namespaces has duplicates",
        ),
        ({"run_as_user": 0}, "providers[0].kubernetes.run_as_user: input should be greater"),
        (
            {"unschedulable_timeout_seconds": 1e9},
            "providers[0].kubernetes.unschedulable_timeout_seconds: input should be less",
        ),
        (
            {"priority_class_name": "Proxies_High"},
            "providers[0].kubernetes.priority_class_name: string should match pattern",
        ),
        (
            {"priority_class_name": "p" * 254},
            "providers[0].kubernetes.priority_class_name: string should have at most 253",
        ),
        (
            {"cpu_request": "500m", "cpu_limit": "250m"},
            "providers[0].kubernetes: cpu_request 500m is above cpu_limit 250m",
        ),
        (
            {"memory_limit": "256MB of RAM"},
            "providers[0].kubernetes.memory_limit: '256MB of RAM' is not a Kubernetes quantity",
        ),
        ({"cpu_limit": "-1"}, "providers[0].kubernetes.cpu_limit: '-1' is negative"),
    ],
    ids=[
        "namespace-not-allowed",
        "empty",
        "not-a-dns-label",
        "duplicate",
        "root",
        "huge-timeout",
        "priority-class-not-a-dns-subdomain",
        "priority-class-too-long",
        "request-above-limit",
        "not-a-quantity",
        "negative-quantity",
    ],
)
def test_bad_kubernetes_settings_are_config_errors_naming_the_field(
    settings: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(kubernetes_block(**settings), environ={"PW": PASSWORD})

    assert any(p.startswith(problem) for p in raised.value.problems), raised.value.problems


# What the API server's `ParseQuantity` (k8s.io/apimachinery pkg/api/resource)
# takes: a signed decimal number, then one binary-SI, decimal-SI or exponent suffix.
QUANTITIES_THE_API_SERVER_TAKES = [
    "0", "1", "+1", "1.5", "1.", ".5", "250m", "0.1m", "100n", "5u", "2k", "1M",
    "1G", "1T", "1P", "1E", "1e3", "1E-2", "5e+2", "64Ki", "256Mi", "1Gi", "1Ti",
    "1Pi", "1Ei",
]  # fmt: skip
# ... and what it refuses, though Python's number parsing would take some of them.
QUANTITIES_THE_API_SERVER_REFUSES = [
    "", "1K", "1mi", "1ki", "1Kib", "1e", "1e+", "1e1.5", "1e3Mi", "1Mi3", ".", "+",
    "--1", "1..5", "e3", "Mi", "1_000", " 1", "1 ", "\uff11", "\u0661", "NaN",
    "Infinity", "0x10", "256MB", "1e99999999999999999999999",
]  # fmt: skip


@pytest.mark.parametrize("quantity", QUANTITIES_THE_API_SERVER_TAKES)
def test_resource_quantities_the_api_server_takes_are_accepted(quantity: str) -> None:
    config = parse_config(
        kubernetes_block(memory_request=quantity, memory_limit=quantity),
        environ={"PW": PASSWORD},
    )

    settings = config.provider("cluster").settings
    assert isinstance(settings, KubernetesConfig)
    assert (settings.memory_request, settings.memory_limit) == (quantity, quantity)


@pytest.mark.parametrize("quantity", QUANTITIES_THE_API_SERVER_REFUSES)
def test_resource_quantities_the_api_server_refuses_are_config_errors_naming_the_field(
    quantity: str,
) -> None:
    """A Pod with such a quantity would be refused (422) on every create: caught at start."""
    with pytest.raises(ConfigError) as raised:
        parse_config(kubernetes_block(cpu_request=quantity), environ={"PW": PASSWORD})

    assert any(
        p.startswith(f"providers[0].kubernetes.cpu_request: {quantity!r} is ")
        for p in raised.value.problems
    ), raised.value.problems


def test_a_yaml_number_is_a_quantity_as_in_a_pod_manifest() -> None:
    config = parse_config(kubernetes_block(cpu_request=0.5, cpu_limit=1), environ={"PW": PASSWORD})

    settings = config.provider("cluster").settings
    assert isinstance(settings, KubernetesConfig)
    assert (settings.cpu_request, settings.cpu_limit) == ("0.5", "1")
    with pytest.raises(ConfigError) as raised:
        parse_config(kubernetes_block(cpu_limit=True), environ={"PW": PASSWORD})
    assert any(
        p.startswith("providers[0].kubernetes.cpu_limit: input should be a valid string")
        for p in raised.value.problems
    ), raised.value.problems


def test_quantities_compare_by_value_across_suffixes() -> None:
    """1Gi is 1024Mi, and 1G (10^9) is below it: the request/limit check reads values."""
    assert KubernetesConfig(memory_request="1024Mi", memory_limit="1Gi").memory_limit == "1Gi"
    assert KubernetesConfig(cpu_request="0.5", cpu_limit="500m").cpu_request == "0.5"
    assert KubernetesConfig(cpu_request="5e-1", cpu_limit="500m").cpu_request == "5e-1"
    with pytest.raises(ValueError, match="memory_request 1Gi is above memory_limit 1G"):
        KubernetesConfig(memory_request="1Gi", memory_limit="1G")


def test_run_as_user_null_is_accepted_for_openshift() -> None:
    config = parse_config(kubernetes_block(run_as_user=None), environ={"PW": PASSWORD})

    settings = config.provider("cluster").settings
    assert isinstance(settings, KubernetesConfig) and settings.run_as_user is None
