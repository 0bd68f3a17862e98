"""A Kubernetes proxy's exit address: its node's ExternalIP, read with the optional `get nodes`."""

from __future__ import annotations

from pathlib import Path

import yaml

from providers.base import InstanceState
from providers.kubernetes import KubernetesProvider
from providers.kubernetes_nodes import NODE_RBAC_VERBS
from tests.fakes.kubernetes import FakeKubernetes
from tests.providers.test_kubernetes import NAMESPACE, request
from tests.providers.test_kubernetes import fake as fake
from tests.providers.test_kubernetes import provider as provider

POD_IP = "10.8.0.12"
NODE_IP = "198.51.100.7"
NODE_READER = (
    Path(__file__).resolve().parents[2] / "deploy/kubernetes/node-addresses/node-reader.yaml"
)


def running_pod(fake: FakeKubernetes, provider: KubernetesProvider) -> str:
    created = provider.create(request())
    fake.set_pod_status(NAMESPACE, created.name, "Running", POD_IP)
    return created.provider_id


def test_the_exit_is_the_nodes_external_ip(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    fake.add_node(external_ip=NODE_IP)
    provider_id = running_pod(fake, provider)

    instance = provider.get(provider_id)

    assert instance.state is InstanceState.RUNNING
    assert (instance.ip, instance.exit_address) == (POD_IP, NODE_IP)
    assert ("nodes", "get") in fake.verbs_used()


def test_a_node_without_an_external_ip_has_no_known_exit(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    fake.add_node()  # private nodes: the cluster's NAT decides, unseen
    assert provider.get(running_pod(fake, provider)).exit_address is None


def test_without_get_nodes_the_exit_is_unknown_and_nodes_are_not_asked_again(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    fake.add_node(external_ip=NODE_IP)
    fake.fail("GET", r"/api/v1/nodes/", 403, 'nodes "fake-node" is forbidden', times=None)
    provider_id = running_pod(fake, provider)

    first = provider.get(provider_id)
    fake.clear_failures()
    second = provider.get(provider_id)

    assert first.state is InstanceState.RUNNING  # the proxy itself is fine
    assert (first.exit_address, second.exit_address) == (None, None)


def test_a_pod_not_yet_on_a_node_reads_no_node(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    created = provider.create(request())
    assert provider.get(created.provider_id).exit_address is None
    assert ("nodes", "get") not in fake.verbs_used()


def test_the_optional_cluster_role_grants_exactly_the_node_verbs() -> None:
    role, binding = yaml.safe_load_all(NODE_READER.read_text())
    assert role["kind"] == "ClusterRole" and binding["kind"] == "ClusterRoleBinding"
    granted = {r: set(rule["verbs"]) for rule in role["rules"] for r in rule["resources"]}
    assert granted == {resource: set(verbs) for resource, verbs in NODE_RBAC_VERBS.items()}
    assert all(rule["apiGroups"] == [""] for rule in role["rules"])
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "proxy-operator", "namespace": "proxy-operator"}
    ]
