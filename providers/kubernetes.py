"""Squid Pods in a Kubernetes cluster: the `kubernetes` provider.

One proxy is one bare Pod. There is no Deployment or ReplicaSet on purpose:
the proxy's workflow is its controller, and a second controller recreating
Pods behind its back would fight it. For the same reason the Pod never
restarts (`restartPolicy: Never`): a Squid that dies turns the Pod `Failed`,
which the workflow sees as TERMINATED and replaces with a new generation,
instead of a crash-looping container that keeps its Pod `Running` with an IP.

Squid runs as PID 1 in the foreground (`squid -N`, no shell in between), so
the SIGTERM of a deletion reaches it and it stops within `shutdown_lifetime`.
Its squid.conf and htpasswd come from a per-proxy Secret whose owner is the
Pod: deleting the Pod is the only cleanup, the garbage collector removes the
Secret, and an orphaned Pod found by tag takes its Secret with it.

The API client comes from in-cluster config when the worker runs in a Pod and
from the local kubeconfig otherwise (a kind cluster on a laptop): one code
path for both. Every API error is translated into the provider taxonomy at one
edge (`_edge`); nothing from the kubernetes client escapes.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import re
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Annotated, Any, TypeVar

import pydantic
import urllib3
from kubernetes import client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from pydantic import Field

from providers.base import CreateRequest, Instance, InstanceState
from providers.catalog import ProviderType
from providers.config import LABEL_VALUE, Config, ProviderEntry, StrictModel
from providers.errors import NotFound, Permanent, ProviderError, QuotaExceeded, Transient
from providers.naming import (
    INSTALLATION_KEY,
    MANAGED_BY_KEY,
    MANAGED_BY_VALUE,
    OWNER_KEY,
    short_hash,
)
from providers.squid import RenderedSquid, SquidPaths, render


class KubernetesConfig(StrictModel):
    """Squid Pods in the cluster the worker runs in (or the kubeconfig's)."""

    namespace: Annotated[str, Field(pattern=LABEL_VALUE)] = "proxies"
    # Canonical's Squid on Ubuntu 24.04 LTS. The tag is a channel Canonical
    # rebuilds for security fixes; pin `@sha256:<digest>` for reproducible pulls.
    image: str = "ubuntu/squid:6.6-24.04_beta"
    # Every API call gives up after this long; Temporal's retry policy retries.
    request_timeout_seconds: Annotated[float, Field(gt=0, le=120)] = 10.0
    service_account: str | None = None
    cpu_request: str = "50m"
    cpu_limit: str = "500m"
    memory_request: str = "64Mi"
    memory_limit: str = "256Mi"
    node_selector: dict[str, str] = Field(default_factory=dict)


PROVIDER_TYPE = ProviderType(
    name="kubernetes",
    settings=KubernetesConfig,
    placement_keys=frozenset({"namespace"}),
    build=lambda entry, config: KubernetesProvider.from_config(entry, config),
)
T = TypeVar("T")

CONTAINER_NAME = "squid"
PORT_NAME = "proxy"
CONFIG_DIR = "/etc/squid-proxy"
SQUID_CONF_KEY = "squid.conf"
HTPASSWD_KEY = "passwords"
SPOOL_DIR = "/var/spool/squid"
# The `proxy` user and group of Debian/Ubuntu's base-passwd, which the image's
# Squid package uses. As that user Squid needs no capability at all: the proxy
# port is unprivileged, and it writes only to stdout/stderr, /dev/shm (the
# runtime's tmpfs) and its spool directory (an emptyDir).
SQUID_UID = 13
# Label values are capped at 63 characters, so the exact tags live here as JSON.
TAGS_ANNOTATION = "proxy-operator/tags"
# Where a tag key that is not a valid label key gets its label.
FALLBACK_LABEL_PREFIX = "proxy-operator"
# Orphan GC lists every instance of an installation; pages keep each response small.
LIST_PAGE_SIZE = 500

SQUID_PATHS = SquidPaths(
    htpasswd=f"{CONFIG_DIR}/{HTPASSWD_KEY}",
    pid_file="none",
    access_log="stdio:/dev/stdout",
    cache_log="/dev/stderr",
    coredump_dir=SPOOL_DIR,
    effective_user=None,
)

# Every API verb this provider uses, per resource. deploy/kubernetes grants the
# worker's ClusterRole exactly these, and tests check both directions. Secrets
# are create-only on purpose: `get` on Secrets cluster-wide would let the
# worker read every credential in the cluster.
RBAC_VERBS: dict[str, tuple[str, ...]] = {
    "pods": ("create", "delete", "get", "list"),
    "secrets": ("create",),
}

# Pod phase -> instance state. A Pod never restarts, so Succeeded and Failed
# mean Squid is gone for good; Unknown means its node stopped reporting, and
# the workflow should replace the proxy rather than wait for the node.
INSTANCE_STATES: dict[str, InstanceState] = {
    "Pending": InstanceState.PROVISIONING,
    "Running": InstanceState.RUNNING,
    "Succeeded": InstanceState.TERMINATED,
    "Failed": InstanceState.TERMINATED,
    "Unknown": InstanceState.TERMINATED,
}

# HTTP status -> error class; anything else (409 outside create, 429, 5xx) is Transient.
STATUS_ERRORS: dict[int, type[ProviderError]] = {
    400: Permanent,
    401: Permanent,
    403: Permanent,
    404: NotFound,
    422: Permanent,
}
QUOTA_MESSAGE = "exceeded quota"
CONFLICT = 409

_DNS_LABEL = re.compile(LABEL_VALUE)
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_NAME_INVALID = re.compile(r"[^-A-Za-z0-9_.]+")
_LABEL_MAX = 63
_HASH_CHARS = 16


class KubernetesProvider:
    """Proxies as Squid Pods; provider_id is `<namespace>/<pod name>`."""

    def __init__(
        self, settings: KubernetesConfig, api_client: client.ApiClient, installation: str
    ) -> None:
        self._settings = settings
        self._core = client.CoreV1Api(api_client)
        self._installation = installation
        self._timeout = settings.request_timeout_seconds

    @classmethod
    def from_config(cls, entry: ProviderEntry, config: Config) -> KubernetesProvider:
        """Connect with the in-cluster service account, or else the local kubeconfig.

        Under test both loaders are replaced (the suite's guard makes the real
        ones raise), so this never reaches the developer's cluster.
        """
        settings = PROVIDER_TYPE.settings_of(entry)
        configuration = client.Configuration()
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except k8s_config.ConfigException:
            try:
                k8s_config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            except (k8s_config.ConfigException, OSError) as exc:
                raise Permanent(
                    f"provider {entry.name!r}: not running in a cluster and no usable "
                    f"kubeconfig (KUBECONFIG or ~/.kube/config): {exc}",
                    cause=exc,
                ) from exc
        # No hidden retries inside a call: Temporal's retry policy owns retrying,
        # and client retries would multiply the request timeout.
        configuration.retries = 0
        return cls(settings, client.ApiClient(configuration), config.installation)

    def create(self, req: CreateRequest) -> Instance:
        """Create the Pod, then its Secret; adopt either if it already exists.

        The Pod comes first so the Secret can name it as owner; the kubelet
        waits for the Secret before it starts the container. A retry after a
        failure in between adopts the Pod and creates the Secret.
        """
        if req.tags.get(INSTALLATION_KEY) != self._installation:
            # This installation's orphan GC could never find such a Pod.
            raise Permanent(
                f"create {req.name}: tag {INSTALLATION_KEY} must be {self._installation!r}, "
                f"got {req.tags.get(INSTALLATION_KEY)!r}"
            )
        namespace = req.placement.get("namespace", self._settings.namespace)
        if not _DNS_LABEL.fullmatch(namespace):
            raise Permanent(
                f"create {req.name}: placement namespace {namespace!r} is not a DNS label"
            )
        try:
            rendered = render(req.proxy, SQUID_PATHS)
        except ValueError as exc:  # settings that would open the proxy
            raise Permanent(f"create {req.name}: {exc}", cause=exc) from exc
        what = f"pod {namespace}/{req.name}"
        pod = _create_unless_exists(
            lambda: self._core.create_namespaced_pod(
                namespace,
                client.V1Pod.model_validate(self._pod_manifest(req, namespace)),
                _request_timeout=self._timeout,
            ),
            what,
        )
        if pod is None:
            with _edge(f"read existing {what}"):
                pod = self._read_pod(namespace, req.name)
        self._ensure_secret(pod, rendered)
        return _instance(pod)

    def get(self, provider_id: str) -> Instance:
        namespace, name = _parse_provider_id(provider_id)
        with _edge(f"get pod {provider_id}"):
            return _instance(self._read_pod(namespace, name))

    def delete(self, provider_id: str) -> None:
        """Delete the Pod with its grace period; the Secret goes with it (ownerReference)."""
        namespace, name = _parse_provider_id(provider_id)
        try:
            with _edge(f"delete pod {provider_id}"):
                self._core.delete_namespaced_pod(name, namespace, _request_timeout=self._timeout)
        except NotFound:
            return

    def list_by_tag(self, key: str, value: str) -> list[Instance]:
        """Every Pod carrying the tag, in all namespaces (hence the ClusterRole).

        The API selects on labels; the exact tags in the annotation then drop
        anything a hashed label value matched by coincidence.
        """
        selector = {MANAGED_BY_KEY: MANAGED_BY_VALUE} | labels({key: value})
        label_selector = ",".join(f"{k}={v}" for k, v in selector.items())
        instances = (_instance(pod) for pod in self._pods(label_selector))
        return [instance for instance in instances if instance.tags.get(key) == value]

    def _read_pod(self, namespace: str, name: str) -> client.V1Pod:
        return self._core.read_namespaced_pod(name, namespace, _request_timeout=self._timeout)

    def _pods(self, label_selector: str) -> Iterator[client.V1Pod]:
        token: str | None = None
        while True:
            with _edge(f"list pods {label_selector}"):
                page = self._core.list_pod_for_all_namespaces(
                    label_selector=label_selector,
                    limit=LIST_PAGE_SIZE,
                    _continue=token,
                    _request_timeout=self._timeout,
                )
            yield from page.items
            token = page.metadata.var_continue if page.metadata else None
            if not token:
                return

    def _ensure_secret(self, pod: client.V1Pod, rendered: RenderedSquid) -> None:
        """Create the Pod's Secret, owned by the Pod; one that exists already is kept.

        Without `get` on Secrets the existing one cannot be inspected. It was
        made for this name, so for this owner and generation: the same config.
        (Only if a Pod of the same name was deleted and re-created within the
        garbage collector's delay could it still belong to the old Pod; the
        new Pod would then stay Pending and be replaced by its workflow.)
        """
        meta = pod.metadata or client.V1ObjectMeta()
        namespace, name = meta.namespace or "", meta.name or ""
        secret_name = _secret_name(name)
        manifest = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": secret_name,
                "namespace": namespace,
                "labels": dict(meta.labels or {}),
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": meta.uid}
                ],
            },
            "type": "Opaque",
            "data": {
                SQUID_CONF_KEY: _b64(rendered.squid_conf),
                HTPASSWD_KEY: _b64(rendered.htpasswd),
            },
        }
        _create_unless_exists(
            lambda: self._core.create_namespaced_secret(
                namespace, client.V1Secret.model_validate(manifest), _request_timeout=self._timeout
            ),
            f"secret {namespace}/{secret_name}",
        )

    def _pod_manifest(self, req: CreateRequest, namespace: str) -> dict[str, Any]:
        settings = self._settings
        spec: dict[str, Any] = {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 10,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": SQUID_UID,
                "runAsGroup": SQUID_UID,
                "fsGroup": SQUID_UID,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": CONTAINER_NAME,
                    "image": settings.image,
                    "command": ["/usr/sbin/squid"],
                    "args": ["-N", "-f", f"{CONFIG_DIR}/{SQUID_CONF_KEY}"],
                    "ports": [
                        {"name": PORT_NAME, "containerPort": req.proxy.port, "protocol": "TCP"}
                    ],
                    "readinessProbe": {"tcpSocket": {"port": PORT_NAME}, "periodSeconds": 5},
                    "resources": {
                        "requests": {
                            "cpu": settings.cpu_request,
                            "memory": settings.memory_request,
                        },
                        "limits": {"cpu": settings.cpu_limit, "memory": settings.memory_limit},
                    },
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "privileged": False,
                        "readOnlyRootFilesystem": True,
                        "runAsNonRoot": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                    "volumeMounts": [
                        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                        {"name": "spool", "mountPath": SPOOL_DIR},
                    ],
                }
            ],
            "volumes": [
                # Readable by Squid's group only (fsGroup); the htpasswd is in here.
                {
                    "name": "config",
                    "secret": {"secretName": _secret_name(req.name), "defaultMode": 0o440},
                },
                {"name": "spool", "emptyDir": {"sizeLimit": "64Mi"}},
            ],
        }
        if settings.service_account:
            spec["serviceAccountName"] = settings.service_account
        if settings.node_selector:
            spec["nodeSelector"] = dict(settings.node_selector)
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": req.name,
                "namespace": namespace,
                "labels": labels(req.tags),
                "annotations": {TAGS_ANNOTATION: json.dumps(req.tags, sort_keys=True)},
            },
            "spec": spec,
        }


def labels(tags: dict[str, str]) -> dict[str, str]:
    """Pod labels for `tags`: what `list_by_tag` selects on."""
    return {label_key(k): label_value(k, v) for k, v in tags.items()}


def label_key(key: str) -> str:
    """A tag key as a label key: itself when valid (`label/team`, `proxy-operator/owner`).

    Otherwise `proxy-operator/` + a readable part + a hash of the original, so
    two invalid keys never share a label.
    """
    prefix, slash, name = key.rpartition("/")
    if _LABEL_NAME.fullmatch(name) and (
        not slash or (len(prefix) <= 253 and _DNS_SUBDOMAIN.fullmatch(prefix))
    ):
        return key
    suffix = short_hash(key, _HASH_CHARS)
    readable = _LABEL_NAME_INVALID.sub("-", key)[: _LABEL_MAX - _HASH_CHARS - 1].strip("-_.")
    return (
        f"{FALLBACK_LABEL_PREFIX}/{readable}-{suffix}"
        if readable
        else f"{FALLBACK_LABEL_PREFIX}/{suffix}"
    )


def label_value(key: str, value: str) -> str:
    """A tag value as a label value: itself when valid, else its short hash.

    The owner (a user-chosen workflow id) is always hashed, as on GCP, so its
    label has one predictable form; the exact value is in the annotation.
    """
    if key != OWNER_KEY and (value == "" or _LABEL_NAME.fullmatch(value)):
        return value
    return short_hash(value, _HASH_CHARS)


def _instance(pod: client.V1Pod) -> Instance:
    meta = pod.metadata or client.V1ObjectMeta()
    status = pod.status or client.V1PodStatus()
    state = _state(pod)
    namespace, name = meta.namespace or "", meta.name or ""
    return Instance(
        provider_id=f"{namespace}/{name}",
        name=name,
        state=state,
        ip=(status.pod_ip or "") if state is InstanceState.RUNNING else "",
        port=_proxy_port(pod),
        tags=_tags(meta),
        # The API server always sets it; "now" keeps GC's grace period safe if not.
        created_at=meta.creation_timestamp or datetime.now(UTC),
    )


def _state(pod: client.V1Pod) -> InstanceState:
    """The phase table, except that a Pod being deleted, or without an IP, is not RUNNING.

    A deletionTimestamp means the Pod is going away for good, not pausing:
    TERMINATED, like the phases after it, rather than STOPPED.
    """
    if pod.metadata and pod.metadata.deletion_timestamp:
        return InstanceState.TERMINATED
    status = pod.status or client.V1PodStatus()
    state = INSTANCE_STATES.get(status.phase or "", InstanceState.PROVISIONING)
    if state is InstanceState.RUNNING and not status.pod_ip:
        return InstanceState.PROVISIONING
    return state


def _proxy_port(pod: client.V1Pod) -> int:
    containers = pod.spec.containers if pod.spec else []
    ports = (
        port.container_port
        for container in containers
        if container.name == CONTAINER_NAME
        for port in container.ports or []
        if port.name == PORT_NAME
    )
    return next(ports, 0)


def _tags(meta: client.V1ObjectMeta) -> dict[str, str]:
    raw = (meta.annotations or {}).get(TAGS_ANNOTATION, "")
    try:
        tags = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(tags, dict):
        return {}
    return {str(k): str(v) for k, v in tags.items()}


def _parse_provider_id(provider_id: str) -> tuple[str, str]:
    namespace, slash, name = provider_id.partition("/")
    if not (slash and _DNS_LABEL.fullmatch(namespace) and _DNS_SUBDOMAIN.fullmatch(name)):
        raise Permanent(
            f"malformed Kubernetes provider_id {provider_id!r}: expected <namespace>/<pod>"
        )
    return namespace, name


def _secret_name(pod_name: str) -> str:
    return f"{pod_name}-squid"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode("ascii")


def _create_unless_exists(create: Callable[[], T], what: str) -> T | None:
    """The created object, or None when one of that name exists (409 Conflict)."""
    try:
        with _edge(f"create {what}"):
            return create()
    except Transient as exc:
        if isinstance(exc.cause, ApiException) and exc.cause.status == CONFLICT:
            return None
        raise


@contextlib.contextmanager
def _edge(what: str) -> Iterator[None]:
    """The edge: whatever the client raises leaves as one of the taxonomy's errors."""
    try:
        yield
    except ApiException as exc:
        raise _from_api_exception(exc, what) from exc
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        # Timeouts, refused or reset connections, TLS and DNS failures.
        raise Transient(f"{what}: {type(exc).__name__}: {exc}", cause=exc) from exc
    except pydantic.ValidationError as exc:
        # The client's models rejected a manifest before sending it: the same
        # values would be rejected on every retry.
        raise Permanent(f"{what}: {exc}", cause=exc) from exc


def _from_api_exception(exc: ApiException, what: str) -> ProviderError:
    status = exc.status or 0
    message = _status_message(exc)
    kind = STATUS_ERRORS.get(status, Transient)
    if status == 403 and QUOTA_MESSAGE in message:
        kind = QuotaExceeded
    return kind(
        f"{what}: HTTP {status}: {message}", cause=exc, retry_after_seconds=_retry_after(exc)
    )


def _status_message(exc: ApiException) -> str:
    """The API server's own message from the Status body, else the HTTP reason."""
    try:
        body = json.loads(exc.body or "")
    except (TypeError, ValueError):
        body = None
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return str(body["message"])
    return str(exc.reason or "")


def _retry_after(exc: ApiException) -> float | None:
    """Retry-After in seconds, the only form the API server sends."""
    value = (exc.headers or {}).get("Retry-After")
    if not isinstance(value, str):
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None
