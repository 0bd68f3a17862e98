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

Every Pod carries this provider's finalizer (`FINALIZER`), which only its own
`delete` removes. A Pod that a drain, a preemption or the taint manager
deletes would otherwise leave the API a second after its SIGTERM, before the
workflow's next probe fails and it looks: it would find nothing, and count a
crash. Held by the finalizer, the Pod stays, Terminating, with the condition
that says why, until the workflow has seen it and deletes it.

The API client comes from in-cluster config when the worker runs in a Pod and
from the local kubeconfig otherwise (a kind cluster on a laptop): one code
path for both. Every API error is translated into the provider taxonomy at one
edge (`_edge`); nothing from the kubernetes client escapes.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import logging
import math
import re
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, TypeVar

import pydantic
import urllib3
from kubernetes import client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from providers.base import CreateRequest, Disruption, Instance, InstanceState, state_table
from providers.catalog import ProviderType
from providers.config import LABEL_VALUE, Config, ProviderEntry, ProviderSettings
from providers.errors import NotFound, Permanent, ProviderError, QuotaExceeded, Transient
from providers.kubernetes_nodes import NodeAddresses
from providers.naming import (
    HASHED_IN_LABELS,
    INSTALLATION_KEY,
    MANAGED_BY_KEY,
    MANAGED_BY_VALUE,
    adoption_mismatch,
    ownership_mismatch,
    short_hash,
)
from squid.conf import RenderedSquid, SquidPaths, render

# Object names such as a PriorityClass's: RFC 1123 subdomains.
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_SUBDOMAIN_MAX = 253


# A resource quantity as the API server parses it (k8s.io/apimachinery
# pkg/api/resource, `ParseQuantity`): an optionally signed decimal number
# (`1`, `1.5`, `1.`, `.5`), then at most one suffix: binary SI (Ki .. Ei),
# decimal SI (n, u, m, k, M .. E; `K` is not one) or a decimal exponent
# (`e3`, `E-2`, whose power is an integer). ASCII only: Python's own number
# parsing would also take `1_000`, surrounding spaces or other scripts' digits.
_QUANTITY = re.compile(
    r"(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:(?P<binary>[KMGTPE])i|(?P<decimal>[numkMGTPE])|[eE](?P<exponent>[+-]?[0-9]+))?",
    re.ASCII,
)
_DECIMAL_SI = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY_SI = {"K": 10, "M": 20, "G": 30, "T": 40, "P": 50, "E": 60}


def _amount(quantity: str) -> Decimal:
    """A resource quantity's value (`250m` is 0.25); ValueError where the API server says no."""
    parsed = _QUANTITY.fullmatch(quantity)
    if parsed is None:
        raise ValueError(f"{quantity!r} is not a Kubernetes quantity (e.g. 250m, 256Mi)")
    if parsed["binary"]:
        return Decimal(parsed["number"]) * (1 << _BINARY_SI[parsed["binary"]])
    power = _DECIMAL_SI[parsed["decimal"]] if parsed["decimal"] else parsed["exponent"] or 0
    try:
        return Decimal(f"{parsed['number']}E{power}")
    except InvalidOperation:  # an exponent beyond what any number holds
        raise ValueError(f"{quantity!r} is out of range for a Kubernetes quantity") from None


def _quantity(value: str) -> str:
    """`value` if the API server would read it as a resource quantity and it is not negative."""
    if _amount(value) < 0:
        raise ValueError(f"{value!r} is negative; a resource quantity must not be")
    return value


def _number_as_quantity(value: object) -> object:
    """A YAML number (`cpu_limit: 1`) as its quantity string: the API server takes both."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


Quantity = Annotated[str, BeforeValidator(_number_as_quantity), AfterValidator(_quantity)]


class KubernetesConfig(ProviderSettings):
    """Squid Pods in the cluster the worker runs in (or the kubeconfig's)."""

    namespace: Annotated[str, Field(pattern=LABEL_VALUE)] = "proxies"
    # The only namespaces a workflow's `placement.namespace` may name, and the
    # only ones orphan GC lists; the worker's Role is granted in each of them.
    # None means `namespace` alone.
    allowed_namespaces: (
        Annotated[list[Annotated[str, Field(pattern=LABEL_VALUE)]], Field(min_length=1)] | None
    ) = None
    # Canonical's Squid on Ubuntu 24.04 LTS, pinned by digest: the tag is a
    # channel Canonical rebuilds, the digest is one build (docs/providers.md
    # says how to move the pin).
    image: str = (
        "ubuntu/squid:6.6-24.04_beta"
        "@sha256:6a097f68bae708cedbabd6188d68c7e2e7a38cedd05a176e1cc0ba29e3bbe029"
    )
    # The uid (and gid, fsGroup) Squid runs as: the image's `proxy` user.
    # None leaves all three to the platform, as OpenShift's restricted SCC
    # requires (it assigns a uid from the namespace's range).
    run_as_user: Annotated[int, Field(ge=1, le=2147483647)] | None = 13
    # A Pod the scheduler cannot place is polled this long after its
    # creation (an autoscaler may be adding a node); after that `get` reports
    # a capacity wait (QuotaExceeded), which the workflow waits out on a timer
    # while the Pod stays queued for the scheduler: a full cluster frees
    # capacity later, and replacing the Pod would not place it sooner.
    unschedulable_timeout_seconds: Annotated[float, Field(gt=0, le=600)] = 300.0
    # The kubelet retries a failed image pull (ErrImagePull, ImagePullBackOff)
    # and a failed container creation with a backoff: a registry's 5xx or 429
    # passes. For this long after the Pod's creation `get` reports them as
    # Transient (waited out); after it the Pod is written off, naming the image.
    image_pull_timeout_seconds: Annotated[float, Field(gt=0, le=3600)] = 600.0
    # Every API call gives up after this long; Temporal's retry policy retries.
    request_timeout_seconds: Annotated[float, Field(gt=0, le=120)] = 10.0
    service_account: str | None = None
    # Requests equal to limits, for cpu and memory, make the Pod's QoS class
    # Guaranteed: under node memory pressure the kubelet evicts BestEffort and
    # Burstable Pods first, and the OOM killer spares Guaranteed ones longest.
    # A request below its limit is allowed (more proxies per node) and makes
    # the Pod Burstable; one above its limit the API server rejects.
    cpu_request: Quantity = "250m"
    cpu_limit: Quantity = "250m"
    memory_request: Quantity = "256Mi"
    memory_limit: Quantity = "256Mi"
    # The Pods' PriorityClass: a higher priority than the cluster's other
    # workloads keeps the scheduler from preempting proxies for them, and
    # lets a proxy preempt them when the cluster is full. The class must
    # exist, or the Priority admission plugin refuses every Pod (403).
    priority_class_name: (
        Annotated[str, Field(pattern=DNS_SUBDOMAIN, max_length=DNS_SUBDOMAIN_MAX)] | None
    ) = None
    node_selector: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _namespace_is_allowed(self) -> KubernetesConfig:
        if self.allowed_namespaces is not None:
            if self.namespace not in self.allowed_namespaces:
                raise ValueError(
                    f"namespace {self.namespace!r} must be one of allowed_namespaces "
                    f"{self.allowed_namespaces}"
                )
            if len(set(self.allowed_namespaces)) != len(self.allowed_namespaces):
                raise ValueError(f"allowed_namespaces has duplicates: {self.allowed_namespaces}")
        return self

    @model_validator(mode="after")
    def _requests_within_limits(self) -> KubernetesConfig:
        for resource in ("cpu", "memory"):
            request, limit = (
                getattr(self, f"{resource}_request"),
                getattr(self, f"{resource}_limit"),
            )
            if _amount(request) > _amount(limit):
                raise ValueError(
                    f"{resource}_request {request} is above {resource}_limit {limit}, "
                    "which the API server refuses"
                )
        return self

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Where this provider may create, list and delete Pods."""
        return tuple(self.allowed_namespaces or [self.namespace])

    def placement_problems(self, placement: Mapping[str, str]) -> list[str]:
        """Why a workflow's placement is not allowed here, each naming its field."""
        namespace = placement.get("namespace")
        if namespace is None or namespace in self.namespaces:
            return []
        return [
            f"placement.namespace: {namespace!r} is not one of this provider's "
            f"allowed_namespaces ({', '.join(self.namespaces)})"
        ]


PROVIDER_TYPE = ProviderType(
    name="kubernetes",
    settings=KubernetesConfig,
    placement_keys=frozenset({"namespace"}),
    build=lambda entry, config: KubernetesProvider.from_config(entry, config),
)
T = TypeVar("T")
log = logging.getLogger(__name__)

CONTAINER_NAME = "squid"
PORT_NAME = "proxy"
CONFIG_DIR = "/etc/squid-proxy"
SQUID_CONF_KEY = "squid.conf"
HTPASSWD_KEY = "passwords"
SPOOL_DIR = "/var/spool/squid"
# As a non-root user (KubernetesConfig.run_as_user) Squid needs no capability
# at all: a proxy port below 1024 is made bindable by the Pod's own network
# namespace (the safe sysctl below), and it writes only to stdout/stderr,
# /dev/shm (the runtime's tmpfs) and its spool directory (an emptyDir).
UNPRIVILEGED_PORT_SYSCTL = "net.ipv4.ip_unprivileged_port_start"
PRIVILEGED_PORTS_END = 1024
# Bare Pods with an emptyDir block the Cluster Autoscaler's scale-down; a
# proxy's workflow replaces an evicted Pod, so tell the autoscaler it is safe.
# Only the autoscaler reads this: `kubectl drain` ignores it, and refuses bare
# Pods (no controller) unless run with `--force` (docs/providers.md).
SAFE_TO_EVICT_ANNOTATION = "cluster-autoscaler.kubernetes.io/safe-to-evict"
# Held on every Pod until this provider's `delete` removes it, so a Pod someone
# else deleted stays readable until its workflow has seen how it ended. Like
# the Job controller's `batch.kubernetes.io/job-tracking` on the Pods it counts.
FINALIZER = "proxy-operator/instance"
# A strategic merge patch removes one finalizer without touching the others
# and without reading the list first (ObjectMeta.finalizers merges).
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
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

# Every API verb this provider needs, per resource, in each allowed namespace.
# deploy/kubernetes grants the worker's Role exactly these, and tests check
# both directions. `patch` on Pods removes the provider's finalizer. The
# provider never reads a Secret back; `delete` on Secrets is what the
# OwnerReferencesPermissionEnforcement admission plugin demands of whoever
# creates an object with ownerReferences (the Pod owns its Secret).
RBAC_VERBS: dict[str, tuple[str, ...]] = {
    "pods": ("create", "delete", "get", "list", "patch"),
    "secrets": ("create", "delete"),
}

# Container waiting reasons that no amount of waiting fixes: the Pod is written
# off at once (its workflow replaces it) with a readable reason.
TERMINAL_WAITING_REASONS: dict[str, str] = {
    "InvalidImageName": "invalid image name",
    "CreateContainerConfigError": "container config error",
}
# Container waiting reasons the kubelet retries with a backoff (a registry's
# 5xx or rate limit, a runtime hiccup): waited out for
# `image_pull_timeout_seconds`, then written off with the image named.
RETRIED_WAITING_REASONS: dict[str, str] = {
    "ErrImagePull": "image pull failed",
    "ImagePullBackOff": "image pull failed",
    "CreateContainerError": "container could not be created",
}
UNSCHEDULABLE = "Unschedulable"
# How Kubernetes marks a Pod it evicts: the kubelet's status reason under node
# pressure, and the condition the Eviction API, the scheduler's preemption and
# the taint manager set before deleting it.
EVICTED = "Evicted"
DISRUPTION_TARGET = "DisruptionTarget"
# The reason for a Pod someone other than this provider deleted without saying why.
DELETED_BY_ANOTHER_CLIENT = (
    "deleted, not by proxy-operator and without a DisruptionTarget condition "
    "(kubectl delete, a drain with --disable-eviction, its namespace being deleted)"
)
# A Pod still there this long after its deletionTimestamp (the end of its grace
# period) sits on a node that stopped reporting: it is deleted with grace 0.
STUCK_DELETION_MARGIN_SECONDS = 60.0

# Pod phase -> instance state. A Pod never restarts, so Succeeded and Failed
# mean Squid is gone for good; Unknown means its node stopped reporting, and
# the workflow should replace the proxy rather than wait for the node.
INSTANCE_STATES = state_table(
    {
        InstanceState.PROVISIONING: ("Pending",),
        InstanceState.RUNNING: ("Running",),
        InstanceState.TERMINATED: ("Succeeded", "Failed", "Unknown"),
    }
)

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
_DNS_SUBDOMAIN = re.compile(DNS_SUBDOMAIN)
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
        self._nodes = NodeAddresses(self._core, self._timeout)

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
        # validate_target rejects this first; checked again so no caller can
        # make the worker create Pods where it has no business.
        problems = self._settings.placement_problems({"namespace": namespace})
        if problems:
            raise Permanent(f"create {req.name}: {'; '.join(problems)}")
        try:
            rendered = render(req.proxy, SQUID_PATHS)
        except ValueError as exc:  # settings that would open the proxy
            raise Permanent(f"create {req.name}: {exc}", cause=exc) from exc
        what = f"pod {namespace}/{req.name}"
        try:
            pod = _create_unless_exists(
                lambda: self._core.create_namespaced_pod(
                    namespace,
                    client.V1Pod.model_validate(self._pod_manifest(req, namespace)),
                    _request_timeout=self._timeout,
                ),
                what,
            )
        except NotFound as exc:
            # Creating into a namespace that does not exist is a 404 that no
            # retry fixes (the NamespaceLifecycle admission plugin).
            raise Permanent(
                f"create {what}: namespace {namespace!r} does not exist; create it "
                f"(with the worker's Role) or choose another placement.namespace",
                cause=exc.cause,
            ) from exc
        if pod is None:
            pod = self._adoptable(namespace, req)
        self._ensure_secret(pod, rendered)
        return self._instance(pod)

    def get(self, provider_id: str) -> Instance:
        """The Pod's state; a Pod waiting on the platform raises that wait instead.

        An unschedulable Pod past `unschedulable_timeout_seconds` is a
        capacity wait (QuotaExceeded), and a container whose image pull or
        creation the kubelet is retrying is Transient within
        `image_pull_timeout_seconds`: neither is the proxy's failure, and
        the caller waits them out instead of replacing the Pod.
        """
        namespace, name = _parse_provider_id(provider_id)
        with _edge(f"get pod {provider_id}"):
            pod = self._read_pod(namespace, name)
        seen = _state(pod, self._settings)
        if seen.wait is not None:
            raise seen.wait(f"pod {provider_id}: {seen.reason}")
        return self._instance(pod)

    def delete(self, provider_id: str) -> None:
        """Delete our Pod, and only that one; the Secret goes with it (ownerReference).

        The Pod is read first and its tags checked: a Pod of another
        installation, or one made by hand under the same name, is Permanent.
        Then the provider's finalizer is removed, before the delete: a Pod
        with a deletionTimestamp and the finalizer is always one that someone
        else deleted, and one whose deletion is done leaves the API with the
        patch. The delete carries the UID read, so a Pod re-created under that
        name in between is never the one deleted (409, retried). A Pod still
        there well past its grace period sits on a node that stopped
        reporting: it is deleted again with grace period 0, which removes it.
        """
        namespace, name = _parse_provider_id(provider_id)
        try:
            with _edge(f"read pod {provider_id} to delete it"):
                pod = self._read_pod(namespace, name)
        except NotFound:
            return
        meta = pod.metadata or client.V1ObjectMeta()
        mismatch = ownership_mismatch(_tags(meta), self._installation)
        if mismatch:
            raise Permanent(f"delete pod {provider_id}: refused, {mismatch}")
        if FINALIZER in (meta.finalizers or []):
            try:
                self._release(namespace, name)
            except NotFound:
                return
        grace: int | None = None
        if meta.deletion_timestamp:
            if not _stuck_terminating(meta):
                return  # being deleted already, within its grace period
            log.warning("pod %s: %s", provider_id, _stuck_reason(meta))
            grace = 0
        options = client.V1DeleteOptions(
            grace_period_seconds=grace, preconditions=client.V1Preconditions(uid=meta.uid)
        )
        try:
            with _edge(f"delete pod {provider_id}"):
                self._core.delete_namespaced_pod(
                    name, namespace, body=options, _request_timeout=self._timeout
                )
        except NotFound:
            return

    def _release(self, namespace: str, name: str) -> None:
        """Remove the provider's finalizer, and only it, from the Pod."""
        patch = {"metadata": {"$deleteFromPrimitiveList/finalizers": [FINALIZER]}}
        with _edge(f"remove finalizer {FINALIZER} from pod {namespace}/{name}"):
            self._core.patch_namespaced_pod(
                name,
                namespace,
                patch,
                _content_type=STRATEGIC_MERGE_PATCH,
                _request_timeout=self._timeout,
            )

    def list_by_tag(self, key: str, value: str) -> list[Instance]:
        """Every Pod carrying the tag, in each allowed namespace and nowhere else.

        The API selects on labels; the exact tags in the annotation then drop
        anything a hashed label value matched by coincidence.
        """
        selector = {MANAGED_BY_KEY: MANAGED_BY_VALUE} | labels({key: value})
        label_selector = ",".join(f"{k}={v}" for k, v in selector.items())
        instances = (
            self._instance(pod)
            for namespace in self._settings.namespaces
            for pod in self._pods(namespace, label_selector)
        )
        return [instance for instance in instances if instance.tags.get(key) == value]

    def _adoptable(self, namespace: str, req: CreateRequest) -> client.V1Pod:
        """The existing Pod of the requested name, if it is the one this request made.

        Its owner, installation and generation tags must match the request's:
        anything else is someone else's Pod, never silently adopted.
        """
        with _edge(f"read existing pod {namespace}/{req.name}"):
            pod = self._read_pod(namespace, req.name)
        mismatch = adoption_mismatch(
            _tags(pod.metadata or client.V1ObjectMeta()), self._installation, req.tags
        )
        if mismatch:
            raise Permanent(
                f"create pod {namespace}/{req.name}: a pod of that name exists and is "
                f"not this proxy's, {mismatch}"
            )
        return pod

    def _instance(self, pod: client.V1Pod) -> Instance:
        """The Pod as an Instance, its exit address its node's external IP (if known)."""
        instance = _instance(pod, self._settings)
        node = pod.spec.node_name if pod.spec else None
        if not node or instance.state in (InstanceState.STOPPED, InstanceState.TERMINATED):
            return instance
        return dataclasses.replace(instance, exit_address=self._nodes.exit_of(node))

    def _read_pod(self, namespace: str, name: str) -> client.V1Pod:
        return self._core.read_namespaced_pod(name, namespace, _request_timeout=self._timeout)

    def _pods(self, namespace: str, label_selector: str) -> Iterator[client.V1Pod]:
        token: str | None = None
        while True:
            with _edge(f"list pods in {namespace} {label_selector}"):
                page = self._core.list_namespaced_pod(
                    namespace,
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
            # Nothing ever changes it; immutable Secrets also spare the
            # kubelet from watching them.
            "immutable": True,
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
        pod_security: dict[str, Any] = {
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        if settings.run_as_user is not None:
            uid = settings.run_as_user
            pod_security |= {"runAsUser": uid, "runAsGroup": uid, "fsGroup": uid}
        if req.proxy.port < PRIVILEGED_PORTS_END:
            # A namespaced sysctl on the "safe" list: it changes only this
            # Pod's network namespace and needs no capability.
            pod_security["sysctls"] = [
                {"name": UNPRIVILEGED_PORT_SYSCTL, "value": str(req.proxy.port)}
            ]
        spec: dict[str, Any] = {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 10,
            "securityContext": pod_security,
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
        if settings.priority_class_name:
            spec["priorityClassName"] = settings.priority_class_name
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": req.name,
                "namespace": namespace,
                "labels": labels(req.tags),
                "annotations": {
                    TAGS_ANNOTATION: json.dumps(req.tags, sort_keys=True),
                    SAFE_TO_EVICT_ANNOTATION: "true",
                },
                "finalizers": [FINALIZER],
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
        not slash or (len(prefix) <= DNS_SUBDOMAIN_MAX and _DNS_SUBDOMAIN.fullmatch(prefix))
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

    The owner (a user-chosen workflow id) and the Temporal namespace are
    always hashed (HASHED_IN_LABELS), as on GCP, so their labels have one
    predictable form; the exact value is in the annotation.
    """
    if key not in HASHED_IN_LABELS and (value == "" or _LABEL_NAME.fullmatch(value)):
        return value
    return short_hash(value, _HASH_CHARS)


@dataclasses.dataclass(frozen=True)
class _PodState:
    """What a Pod's status means for its proxy, and why, for users."""

    state: InstanceState
    reason: str = ""
    # What `get` raises instead of an Instance: a wait on the platform, which
    # the caller sits out (QuotaExceeded: capacity; Transient: a retry the
    # kubelet is making), never a failure of the proxy.
    wait: type[ProviderError] | None = None
    # Set when Kubernetes took the Pod away (`_disruption`): no failure of the proxy's.
    disruption: Disruption | None = None


def _instance(pod: client.V1Pod, settings: KubernetesConfig) -> Instance:
    meta = pod.metadata or client.V1ObjectMeta()
    status = pod.status or client.V1PodStatus()
    seen = _state(pod, settings)
    namespace, name = meta.namespace or "", meta.name or ""
    return Instance(
        provider_id=f"{namespace}/{name}",
        name=name,
        state=seen.state,
        ip=(status.pod_ip or "") if seen.state is InstanceState.RUNNING else "",
        port=_proxy_port(pod),
        tags=_tags(meta),
        # The API server always sets it; "now" keeps GC's grace period safe if not.
        created_at=meta.creation_timestamp or datetime.now(UTC),
        reason=seen.reason,
        disruption=seen.disruption,
    )


def _state(pod: client.V1Pod, settings: KubernetesConfig) -> _PodState:
    """The phase table with what the phase does not say.

    A deletionTimestamp means the Pod is going away for good, not pausing:
    TERMINATED, like the phases after it, rather than STOPPED. A Pending Pod
    that can never start (an invalid image name, a broken container config)
    is TERMINATED at once; one waiting on the platform is a wait (see
    `_pending_state`). RUNNING needs an IP and the Ready condition: Squid's
    port answers the readiness probe.
    """
    meta = pod.metadata or client.V1ObjectMeta()
    status = pod.status or client.V1PodStatus()
    evicted = _disruption(pod)
    if evicted is not None:
        return evicted
    if meta.deletion_timestamp:
        reason = _stuck_reason(meta) if _stuck_terminating(meta) else "being deleted"
        return _PodState(InstanceState.TERMINATED, reason)
    state = INSTANCE_STATES.get(status.phase or "", InstanceState.PROVISIONING)
    if state is InstanceState.PROVISIONING:
        return _pending_state(pod, settings)
    if state is InstanceState.RUNNING:
        if not status.pod_ip:
            return _PodState(InstanceState.PROVISIONING, "waiting for a Pod IP")
        if not _condition_true(status, "Ready"):
            return _PodState(InstanceState.PROVISIONING, "waiting for Squid to be ready")
    return _PodState(state, status.message or status.reason or "")


def _disruption(pod: client.V1Pod) -> _PodState | None:
    """A Pod Kubernetes is taking away, or took away: TERMINATED, a disruption.

    The kubelet's node-pressure eviction leaves the Pod Failed with reason
    `Evicted`; the Eviction API (a drain), the scheduler's preemption and the
    taint manager first set the `DisruptionTarget` condition, then delete the
    Pod (Kubernetes' "Pod disruption conditions"). That condition alone, on a
    Pod neither deleted nor ended, is a disruption that was interrupted: "that
    Pod might then not actually be deleted", and the condition is cleared
    later, so such a Pod is taken at its phase.

    The provider's finalizer keeps a deleted Pod readable until the provider
    deletes it, and the provider removes it before it deletes: a Pod with a
    deletionTimestamp that still carries it was deleted by someone else. Without
    the condition (`kubectl delete`, a drain with `--disable-eviction`, a
    namespace being deleted, a cluster before Kubernetes 1.26) that is still no
    failure of Squid's, so a disruption too. A Pod without the finalizer (made
    before it existed) and already gone says nothing: its NotFound is none.
    """
    meta = pod.metadata or client.V1ObjectMeta()
    status = pod.status or client.V1PodStatus()
    if status.reason == EVICTED:
        return _PodState(
            InstanceState.TERMINATED, f"evicted: {status.message or ''}", None, Disruption.EVICTED
        )
    target = next(
        (c for c in status.conditions or [] if c.type == DISRUPTION_TARGET and c.status == "True"),
        None,
    )
    ended = INSTANCE_STATES.get(status.phase or "") is InstanceState.TERMINATED
    if target is not None and (meta.deletion_timestamp or ended):
        why = f"{target.reason or DISRUPTION_TARGET}: {target.message or ''}"
        return _PodState(InstanceState.TERMINATED, f"evicted: {why}", None, Disruption.EVICTED)
    if meta.deletion_timestamp and FINALIZER in (meta.finalizers or []):
        return _PodState(
            InstanceState.TERMINATED, DELETED_BY_ANOTHER_CLIENT, None, Disruption.EVICTED
        )
    return None


def _pending_state(pod: client.V1Pod, settings: KubernetesConfig) -> _PodState:
    """A Pending Pod: starting, never going to start, or waiting on the platform.

    The kubelet retries image pulls and container creation with a backoff,
    so those are Transient for `image_pull_timeout_seconds` after the Pod's
    creation, then written off naming the image. The scheduler keeps an
    unschedulable Pod queued and places it once capacity frees up (a node
    added, another Pod gone): polled for `unschedulable_timeout_seconds`,
    then a capacity wait (QuotaExceeded), never written off.
    """
    meta = pod.metadata or client.V1ObjectMeta()
    status = pod.status or client.V1PodStatus()
    since = meta.creation_timestamp or datetime.now(UTC)
    waited = (datetime.now(UTC) - since).total_seconds()
    for container in status.container_statuses or []:
        waiting = container.state.waiting if container.state else None
        if not waiting or not waiting.reason:
            continue
        why = f"{waiting.reason}: {waiting.message or ''}"
        if waiting.reason in TERMINAL_WAITING_REASONS:
            summary = TERMINAL_WAITING_REASONS[waiting.reason]
            return _PodState(InstanceState.TERMINATED, f"{summary}: {why}")
        if waiting.reason in RETRIED_WAITING_REASONS:
            summary = f"{RETRIED_WAITING_REASONS[waiting.reason]} for image {_image(pod)}"
            if waited >= settings.image_pull_timeout_seconds:
                return _PodState(InstanceState.TERMINATED, f"{summary} for {waited:.0f}s: {why}")
            return _PodState(
                InstanceState.PROVISIONING,
                f"{summary}, the kubelet retries (for {waited:.0f}s of "
                f"{settings.image_pull_timeout_seconds:g}s): {why}",
                wait=Transient,
            )
    scheduled = next((c for c in status.conditions or [] if c.type == "PodScheduled"), None)
    if scheduled and scheduled.status == "False" and scheduled.reason == UNSCHEDULABLE:
        reason = f"unschedulable: {scheduled.message or ''}"
        if waited >= settings.unschedulable_timeout_seconds:
            return _PodState(
                InstanceState.PROVISIONING,
                f"waiting for capacity, {reason} (for {waited:.0f}s)",
                wait=QuotaExceeded,
            )
        return _PodState(InstanceState.PROVISIONING, reason)
    return _PodState(InstanceState.PROVISIONING)


def _image(pod: client.V1Pod) -> str:
    """The Squid container's image, as the Pod asks for it."""
    containers = pod.spec.containers if pod.spec else []
    return next((c.image or "" for c in containers if c.name == CONTAINER_NAME), "")


def _condition_true(status: client.V1PodStatus, kind: str) -> bool:
    return any(c.type == kind and c.status == "True" for c in status.conditions or [])


def _stuck_terminating(meta: client.V1ObjectMeta) -> bool:
    """Still there a margin after its deletionTimestamp, the end of its grace period."""
    deleted_at: datetime | None = meta.deletion_timestamp
    if deleted_at is None:
        return False
    return datetime.now(UTC) > deleted_at + timedelta(seconds=STUCK_DELETION_MARGIN_SECONDS)


def _stuck_reason(meta: client.V1ObjectMeta) -> str:
    deleted_at: datetime | None = meta.deletion_timestamp
    since = deleted_at.isoformat() if deleted_at else "?"
    return (
        f"stuck terminating since {since} (its node is not "
        "reporting); deleting it with grace period 0"
    )


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
