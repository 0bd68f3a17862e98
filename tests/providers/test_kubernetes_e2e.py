"""Opt-in: the Kubernetes provider against a real cluster, tunnelling through the Pod.

Everything the fake cannot show: the image pulls, admission accepts the Pod
under the "restricted" Pod Security Standard, Squid starts as uid 13 on a
read-only root filesystem with the Secret mounted and logs to stdout (and
nothing for the readiness probe's connections), the provider reports RUNNING
only once the kubelet reports the Pod Ready, a CONNECT through the Pod reaches
an HTTPS origin, deletion takes the Secret along, and a Pod whose image cannot
be pulled is written off with that reason. Skipped unless
PROXY_OPERATOR_E2E_KUBECONFIG names a kubeconfig; only that file is read:

    kind create cluster --name proxy-operator-e2e
    kind get kubeconfig --name proxy-operator-e2e > /tmp/e2e.kubeconfig
    PROXY_OPERATOR_E2E_KUBECONFIG=/tmp/e2e.kubeconfig \\
        pytest -m kubernetes_e2e tests/providers/test_kubernetes_e2e.py

The test works in a namespace of its own, which it deletes at the end. The
kubeconfig's user needs to create and delete namespaces, Pods and Secrets,
and to use pods/portforward and pods/log. The tunnel goes through a
port-forward, so Squid sees the client as 127.0.0.1 inside the Pod; the
origin (PROXY_OPERATOR_E2E_TARGET, default example.com:443) must be
reachable from the cluster's nodes.
"""

from __future__ import annotations

import base64
import os
import socket
import ssl
import uuid
from collections.abc import Callable, Iterator

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException
from kubernetes.stream import portforward

from providers.base import CreateRequest, Instance, InstanceState
from providers.errors import NotFound, Transient
from providers.kubernetes import KubernetesConfig, KubernetesProvider
from providers.naming import OWNER_KEY, instance_name, owner_tags
from squid.conf import ProxySettings
from tests.helpers.network import read_head
from tests.helpers.waiting import wait_until

KUBECONFIG = os.environ.get("PROXY_OPERATOR_E2E_KUBECONFIG", "")
TARGET = os.environ.get("PROXY_OPERATOR_E2E_TARGET", "example.com:443")
INSTALLATION = "e2e"
PASSWORD = "e2e-" + uuid.uuid4().hex
PORT = 3128

pytestmark = [
    pytest.mark.kubernetes_e2e,
    pytest.mark.skipif(not KUBECONFIG, reason="set PROXY_OPERATOR_E2E_KUBECONFIG to run"),
    # The first run pulls the Squid image.
    pytest.mark.timeout(600),
]


def eventually(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll the real cluster once a second."""
    wait_until(check, timeout, what, interval=1)


@pytest.fixture(scope="module")
def api_client() -> kubernetes.client.ApiClient:
    # Exactly this file, into a Configuration of its own. The suite's guard
    # replaces the package-level loaders, which this does not go through.
    client: kubernetes.client.ApiClient = kubernetes.config.new_client_from_config(  # type: ignore[no-untyped-call]
        config_file=KUBECONFIG
    )
    return client


@pytest.fixture(scope="module")
def namespace(api_client: kubernetes.client.ApiClient) -> Iterator[str]:
    core = kubernetes.client.CoreV1Api(api_client)
    name = f"proxy-operator-e2e-{uuid.uuid4().hex[:8]}"
    # Admission rejects a proxy Pod that does not meet the "restricted" standard.
    labels = {"pod-security.kubernetes.io/enforce": "restricted"}
    core.create_namespace(
        kubernetes.client.V1Namespace(
            metadata=kubernetes.client.V1ObjectMeta(name=name, labels=labels)
        )
    )
    try:
        yield name
    finally:
        core.delete_namespace(name)


def connect_through(
    api_client: kubernetes.client.ApiClient, instance: Instance, username: str, password: str
) -> tuple[str, str]:
    """CONNECT to TARGET through a port-forward to the Pod.

    Returns the proxy's status line and, after a 200, the origin's status line
    read over TLS through the tunnel (else "").
    """
    namespace, name = instance.provider_id.split("/")
    core = kubernetes.client.CoreV1Api(api_client)
    forward = portforward(
        core.connect_get_namespaced_pod_portforward, name, namespace, ports=str(instance.port)
    )
    sock = forward.socket(instance.port)
    sock.settimeout(30)
    try:
        credentials = base64.b64encode(f"{username}:{password}".encode()).decode()
        sock.sendall(
            f"CONNECT {TARGET} HTTP/1.1\r\nHost: {TARGET}\r\n"
            f"Proxy-Authorization: Basic {credentials}\r\n\r\n".encode()
        )
        proxy_reply = status_line(sock)
        if not proxy_reply.startswith("HTTP/1.1 200"):
            return proxy_reply, ""
        host = TARGET.rsplit(":", 1)[0]
        with ssl.create_default_context().wrap_socket(sock, server_hostname=host) as tls:
            tls.sendall(f"HEAD / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            return proxy_reply, status_line(tls)
    finally:
        sock.close()
        forward.close()


def status_line(sock: socket.socket) -> str:
    """The first line of an HTTP response head."""
    return read_head(sock).decode(errors="replace").split("\r\n", 1)[0]


def proxy_request(owner: str) -> CreateRequest:
    return CreateRequest(
        name=instance_name(owner, 1),
        proxy=ProxySettings(
            port=PORT,
            username="proxy",
            password=PASSWORD,
            allowed_cidrs=("127.0.0.1/32",),
            allowed_connect_ports=(int(TARGET.rsplit(":", 1)[1]),),
        ),
        tags=owner_tags(INSTALLATION, owner, 1),
    )


def pod_is_ready(core: kubernetes.client.CoreV1Api, provider_id: str) -> bool:
    namespace, name = provider_id.split("/")
    pod = core.read_namespaced_pod(name, namespace)
    conditions = (pod.status.conditions if pod.status else None) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def test_a_proxy_pod_runs_tunnels_and_goes_away(
    api_client: kubernetes.client.ApiClient, namespace: str
) -> None:
    provider = KubernetesProvider(KubernetesConfig(namespace=namespace), api_client, INSTALLATION)
    owner = f"e2e-{uuid.uuid4().hex[:8]}"
    req = proxy_request(owner)
    created = provider.create(req)
    core = kubernetes.client.CoreV1Api(api_client)

    def running() -> bool:
        instance = provider.get(created.provider_id)
        assert instance.state is not InstanceState.TERMINATED, instance
        if instance.state is InstanceState.RUNNING:
            # RUNNING only once the kubelet's readiness probe passed.
            assert pod_is_ready(core, created.provider_id), instance
            return True
        return False

    eventually(running, 300, f"{created.provider_id} to run")
    instance = provider.get(created.provider_id)
    assert instance.ip and instance.port == PORT
    assert provider.list_by_tag(OWNER_KEY, owner) == [instance]

    refused, _ = connect_through(api_client, instance, "proxy", "wrong-password")
    assert refused.startswith("HTTP/1.1 407"), refused
    tunnelled, origin = connect_through(api_client, instance, "proxy", PASSWORD)
    assert tunnelled.startswith("HTTP/1.1 200"), tunnelled
    assert origin.startswith("HTTP/1.1 "), origin
    pod_name = instance.provider_id.split("/")[1]
    # Squid, as uid 13 on a read-only root, logs to the container's stdout.
    eventually(
        lambda: "TCP_DENIED/407" in core.read_namespaced_pod_log(pod_name, namespace),
        30,
        "the access log in the Pod's log",
    )
    # The readiness probe connects every 5 seconds; none of that is logged.
    assert "transaction-end-before-headers" not in core.read_namespaced_pod_log(pod_name, namespace)

    provider.delete(instance.provider_id)

    def gone() -> bool:
        try:
            provider.get(instance.provider_id)
        except NotFound:
            return True
        return False

    eventually(gone, 120, f"{instance.provider_id} to be deleted")

    def secret_collected() -> bool:
        try:
            core.read_namespaced_secret(f"{req.name}-squid", namespace)
        except ApiException as exc:
            return bool(exc.status == 404)
        return False

    eventually(secret_collected, 120, "the garbage collector to delete the Secret")


def test_a_pod_whose_image_cannot_be_pulled_is_written_off_with_the_reason(
    api_client: kubernetes.client.ApiClient, namespace: str
) -> None:
    image = "ubuntu/squid:proxy-operator-e2e-no-such-tag"
    # The kubelet retries the pull; a short window writes it off within the test.
    settings = KubernetesConfig(namespace=namespace, image=image, image_pull_timeout_seconds=30)
    provider = KubernetesProvider(settings, api_client, INSTALLATION)
    created = provider.create(proxy_request(f"e2e-{uuid.uuid4().hex[:8]}"))

    retried: list[str] = []

    def written_off() -> bool:
        try:
            return provider.get(created.provider_id).state is InstanceState.TERMINATED
        except Transient as retrying:  # the kubelet's retries, within the window
            retried.append(retrying.message)
            return False

    eventually(written_off, 180, f"{created.provider_id} to be written off")

    assert any("the kubelet retries" in message for message in retried), retried

    assert provider.get(created.provider_id).reason.startswith(
        f"image pull failed for image {image} for "
    )
    provider.delete(created.provider_id)
