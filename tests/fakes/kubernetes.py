"""An HTTP-level fake Kubernetes API: kmock's emulator plus what it lacks.

The provider talks to it with the real `kubernetes` client over loopback HTTP,
so request paths, JSON (de)serialisation, status codes and headers are all
exercised. kmock's `KubernetesEmulator` already stores objects and serves
create, get, list and delete, with 409 on a duplicate create and 404 for a
missing object. This module adds the API-server behaviour the provider relies
on and kmock does not model:

- schema validation of created objects (422, as the API server answers) with
  `kubernetes-validate`, and the server-set fields: uid, creationTimestamp,
  resourceVersion, and `status.phase: Pending` for a new Pod;
- namespaces: a create into one that does not exist is a 404;
- the Priority admission plugin: a Pod naming a PriorityClass that does not
  exist is refused (403), and a Pod gets its class's `spec.priority`;
- the Pod's QoS class (`status.qosClass`) from its containers' resources;
- label selectors (equality and existence) and limit/continue paging on lists;
- graceful deletion of a Pod bound to a node: it gets a deletionTimestamp (the
  end of its grace period) and stays until the kubelet (the test) confirms, as
  on a real cluster; grace period 0 ends it at once; a UID precondition that
  does not match is a 409;
- finalizers: a deleted Pod that has any stays, marked for deletion, until
  the last one is removed (by a PATCH: a JSON merge patch, or a strategic
  merge patch with `$deleteFromPrimitiveList/finalizers`); none can be added
  to a Pod being deleted;
- garbage collection of dependents through ownerReferences, and the RBAC
  verbs the OwnerReferencesPermissionEnforcement admission plugin checks
  when an object is created with them;
- the scheduler's and the kubelet's reports (helpers): Ready and PodScheduled
  conditions, container waiting reasons, and clocks moved back for timeouts;
- disruptions: the Eviction subresource (`POST .../pods/<name>/eviction`,
  what `kubectl drain` sends), and as helpers the scheduler's preemption, the
  taint manager's deletion and the kubelet's node-pressure eviction, each with
  the DisruptionTarget condition Kubernetes sets;
- injected failures answered *before* any state change (kmock's own reactions
  run after the emulator has stored the object), with any status, message and
  headers, optionally after a delay;
- a record of every (resource, verb) served, for the RBAC check.

The server runs on its own event loop in a background thread, so synchronous
callers (the provider, Temporal activities in a thread pool, plain tests) can
use it from anywhere without blocking the loop that serves them. The test-side
helpers run on that loop too, so they never race a request in flight.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import re
import threading
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, Self, TypeVar

import aiohttp.web
import attrs
import kmock
import kubernetes
import kubernetes_validate
from kubernetes.utils import parse_quantity

T = TypeVar("T")

PODS = kmock.resource("", "v1", "pods")
SECRETS = kmock.resource("", "v1", "secrets")
KINDS = {PODS: "Pod", SECRETS: "Secret"}
# Cluster-scoped: read by the provider (with `get nodes`) for the exit address.
NODES = kmock.resource("", "v1", "nodes")
NODE_NAME = "fake-node"
# What every cluster has from the start; tests add the namespaces they use.
BUILTIN_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
SCHEMA_VERSION = kubernetes_validate.latest_version()
# The PriorityClasses every cluster has, and their values
# (kubernetes.io/docs/concepts/scheduling-eviction/pod-priority-preemption/).
BUILTIN_PRIORITY_CLASSES = {
    "system-cluster-critical": 2000000000,
    "system-node-critical": 2000001000,
}
# The resources that decide a Pod's QoS class.
QOS_RESOURCES = ("cpu", "memory")
# The condition the control plane sets on a Pod it is about to take away, and
# the reason each component gives (kubernetes.io/docs/concepts/workloads/pods/
# disruptions/#pod-disruption-conditions).
DISRUPTION_TARGET = "DisruptionTarget"
EVICTION_BY_EVICTION_API = "EvictionByEvictionAPI"
PREEMPTION_BY_SCHEDULER = "PreemptionByScheduler"
DELETION_BY_TAINT_MANAGER = "DeletionByTaintManager"
TERMINATION_BY_KUBELET = "TerminationByKubelet"

# The patch types the fake serves, by Content-Type; a JSON patch it does not.
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
# What a patch of a Pod may change here: metadata only, and in it these keys.
PATCHABLE_METADATA = frozenset({"labels", "annotations", "finalizers"})
DELETE_FINALIZERS = "$deleteFromPrimitiveList/finalizers"

# kmock's action for a request -> the RBAC verb a real API server checks.
RBAC_VERBS = {
    kmock.action.LIST: "list",
    kmock.action.WATCH: "watch",
    kmock.action.FETCH: "get",
    kmock.action.CREATE: "create",
    kmock.action.UPDATE: "patch",
    kmock.action.DELETE: "delete",
}


@dataclass
class Failure:
    """An injected answer for requests matching `method` and `path` (a regex)."""

    method: str
    path: re.Pattern[str]
    status: int
    message: str
    headers: dict[str, str] = field(default_factory=dict)
    # None: every matching request; otherwise this many, then the fake behaves normally.
    remaining: int | None = 1
    delay: float = 0.0

    def matches(self, request: kmock.Request) -> bool:
        return request.method.value == self.method and bool(self.path.search(request.url.path))


def status_body(code: int, message: str, reason: str = "") -> dict[str, Any]:
    """A `Status` object, the body of every API error."""
    return {
        "apiVersion": "v1",
        "kind": "Status",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def now(offset_seconds: float = 0.0) -> str:
    return (datetime.now(UTC) + timedelta(seconds=offset_seconds)).strftime(TIME_FORMAT)


def earlier(timestamp: str, seconds: float) -> str:
    """`timestamp` moved `seconds` into the past."""
    moved = datetime.strptime(timestamp, TIME_FORMAT).replace(tzinfo=UTC)
    return (moved - timedelta(seconds=seconds)).strftime(TIME_FORMAT)


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality (`k=v`, `k==v`, `k!=v`) and existence (`k`, `!k`) requirements."""
    for term in (t.strip() for t in selector.split(",")):
        if not term:
            continue
        if "(" in term:
            raise kmock.KubernetesError(400, "BadRequest", f"set-based selector {term!r} not faked")
        if "!=" in term:
            key, value = (part.strip() for part in term.split("!=", 1))
            ok = labels.get(key) != value
        elif "=" in term:
            key, value = (part.strip() for part in term.replace("==", "=").split("=", 1))
            ok = labels.get(key) == value
        elif term.startswith("!"):
            ok = term[1:].strip() not in labels
        else:
            ok = term in labels
        if not ok:
            return False
    return True


def _unfaked_patch(method: str, content_type: str, patch: Any) -> str:
    """Why the fake cannot serve this Pod patch as the API server would; '' if it can."""
    if method != "PATCH":
        return f"{method} of a Pod is not faked; PATCH its metadata"
    if content_type not in (MERGE_PATCH, STRATEGIC_MERGE_PATCH):
        return f"patch type {content_type!r} is not faked; use {MERGE_PATCH} or a strategic one"
    if not isinstance(patch, dict) or set(patch) - {"metadata"}:
        return "only patches of metadata are faked"
    meta = patch["metadata"]
    allowed = PATCHABLE_METADATA | (
        {DELETE_FINALIZERS} if content_type == STRATEGIC_MERGE_PATCH else set()
    )
    unfaked = set(meta) - allowed if isinstance(meta, dict) else {"metadata"}
    if unfaked:
        return f"patching metadata {sorted(unfaked)} is not faked"
    return ""


def qos_class(spec: dict[str, Any]) -> str:
    """The QoS class the API server gives a Pod with this spec.

    BestEffort: no container requests or limits cpu or memory. Guaranteed:
    every container has cpu and memory limits, and its requests (which default
    to its limits) equal them. Anything else is Burstable
    (kubernetes.io/docs/concepts/workloads/pods/pod-qos/).
    """
    containers = spec.get("containers") or []
    resources = [c.get("resources") or {} for c in containers]
    if not any(
        name in (r.get(kind) or {})
        for r in resources
        for kind in ("requests", "limits")
        for name in QOS_RESOURCES
    ):
        return "BestEffort"
    for r in resources:
        limits, requests = r.get("limits") or {}, r.get("requests") or {}
        for name in QOS_RESOURCES:
            if name not in limits:
                return "Burstable"
            request = requests.get(name, limits[name])
            if parse_quantity(request) != parse_quantity(limits[name]):
                return "Burstable"
    return "Guaranteed"


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    """The request handler: kmock's emulator with the behaviour listed above."""

    failures: list[Failure] = attrs.field(factory=list)
    verbs_used: set[tuple[str, str]] = attrs.field(factory=set)
    namespaces: set[str] = attrs.field(factory=lambda: set(BUILTIN_NAMESPACES))
    priority_classes: dict[str, int] = attrs.field(factory=lambda: dict(BUILTIN_PRIORITY_CLASSES))
    _versions: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1))

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for resource, kind in KINDS.items():
            self.resources[resource] = kmock.ResourceInfo(kind=kind, namespaced=True)
        self.resources[NODES] = kmock.ResourceInfo(kind="Node", namespaced=False)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        resource = request.resource
        if resource is not None and request.action is not None:
            self.verbs_used.add((str(resource.plural), RBAC_VERBS[request.action]))
        if resource is not None and request.subresource and request.method.value == "POST":
            self.verbs_used.add((f"{resource.plural}/{request.subresource}", "create"))
        failure = self._take_failure(request)
        if failure is not None:
            await asyncio.sleep(failure.delay)
            body = status_body(failure.status, failure.message)
            return aiohttp.web.json_response(body, status=failure.status, headers=failure.headers)
        if request.action == kmock.action.CREATE and resource in KINDS:
            # The NamespaceLifecycle admission plugin "ensures that requests in
            # a non-existent Namespace are rejected" (kubernetes.io/docs/reference/
            # access-authn-authz/admission-controllers/#namespacelifecycle): 404.
            if request.namespace not in self.namespaces:
                message = f'namespaces "{request.namespace}" not found'
                body = status_body(404, message, "NotFound")
                return aiohttp.web.json_response(body, status=404)
            forbidden = self._priority_class_missing(request)
            if forbidden:
                body = status_body(403, forbidden, "Forbidden")
                return aiohttp.web.json_response(body, status=403)
            problem = self._admit(request)
            if problem:
                return aiohttp.web.json_response(status_body(422, problem, "Invalid"), status=422)
        if resource == PODS and request.subresource == "eviction":
            return self._evict(request)
        if resource == PODS and request.name and not request.subresource:
            if request.action == kmock.action.DELETE:
                return self._delete_pod(request)
            if request.action == kmock.action.UPDATE:
                return self._patch_pod(request)
        response = await super()._handle(request)
        if request.action == kmock.action.DELETE:
            self.collect_garbage()
        return response

    async def _serve_list(self, request: kmock.Request) -> kmock.Payload:
        listing = await super()._serve_list(request)
        assert isinstance(listing, dict)
        selector = request.params.get("labelSelector", "")
        items = sorted(
            (
                item
                for item in listing["items"]
                if selector_matches(selector, item.get("metadata", {}).get("labels") or {})
            ),
            key=lambda item: (item["metadata"].get("namespace", ""), item["metadata"]["name"]),
        )
        start = int(request.params.get("continue") or 0)
        limit = int(request.params.get("limit") or 0) or len(items)
        page = items[start : start + limit]
        metadata: dict[str, str] = {"resourceVersion": str(next(self._versions))}
        if start + limit < len(items):
            metadata["continue"] = str(start + limit)
        kind = KINDS.get(request.resource, "Object") if request.resource else "Object"
        return {"apiVersion": "v1", "kind": f"{kind}List", "metadata": metadata, "items": page}

    def _take_failure(self, request: kmock.Request) -> Failure | None:
        for failure in self.failures:
            if failure.matches(request):
                if failure.remaining is not None:
                    failure.remaining -= 1
                    if failure.remaining <= 0:
                        self.failures.remove(failure)
                return failure
        return None

    def _admit(self, request: kmock.Request) -> str:
        """Validate like the API server, then fill the fields it sets; '' when admitted."""
        obj = request.data
        if not isinstance(obj, dict):
            return "body is not a JSON object"
        try:
            kubernetes_validate.validate(obj, SCHEMA_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            return f"{obj.get('kind', 'object')} is invalid: {exc.message}"
        self._record_owner_reference_checks(request, obj)
        self.stamp(obj, request.namespace)
        return ""

    def _priority_class_missing(self, request: kmock.Request) -> str:
        """The Priority admission plugin's refusal of an unknown PriorityClass; '' if none.

        "If you submit a Pod that has a priorityClassName which is not found,
        the Pod is rejected by the admission controller" (kubernetes.io/docs/
        concepts/scheduling-eviction/pod-priority-preemption/); the message is
        the plugin's.
        """
        obj = request.data
        if request.resource != PODS or not isinstance(obj, dict):
            return ""
        name = (obj.get("spec") or {}).get("priorityClassName")
        if not name or name in self.priority_classes:
            return ""
        pod = (obj.get("metadata") or {}).get("name")
        return f'pods "{pod}" is forbidden: no PriorityClass with name {name} was found'

    def _record_owner_reference_checks(self, request: kmock.Request, obj: dict[str, Any]) -> None:
        """The extra authorization OwnerReferencesPermissionEnforcement makes.

        "only users with delete permission to the object can change" its
        ownerReferences, and setting blockOwnerDeletion needs "update
        permission to the finalizers subresource of the referenced owner"
        (kubernetes.io/docs/reference/access-authn-authz/admission-controllers/
        #ownerreferencespermissionenforcement); OpenShift enables it. A create
        with ownerReferences is such a change, so it needs those verbs too.
        """
        owners = obj.get("metadata", {}).get("ownerReferences") or []
        if owners and request.resource is not None:
            self.verbs_used.add((str(request.resource.plural), "delete"))
        for owner in owners:
            if owner.get("blockOwnerDeletion"):
                self.verbs_used.add((f"{owner['kind'].lower()}s/finalizers", "update"))

    def stamp(self, obj: dict[str, Any], namespace: str | None) -> None:
        """Set what the API server sets on a new object."""
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", namespace)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now()
        meta["resourceVersion"] = str(next(self._versions))
        if obj.get("kind") == "Pod":
            spec = obj.setdefault("spec", {})
            spec["priority"] = self.priority_classes.get(spec.get("priorityClassName", ""), 0)
            obj["status"] = {"phase": "Pending", "qosClass": qos_class(spec)}

    def _delete_options(self, request: kmock.Request) -> dict[str, Any]:
        """DeleteOptions from the body, with `gracePeriodSeconds` also taken as a query."""
        options = dict(request.data) if isinstance(request.data, dict) else {}
        if "gracePeriodSeconds" in request.params:
            options["gracePeriodSeconds"] = int(request.params["gracePeriodSeconds"])
        return options

    def _precondition_failure(self, request: kmock.Request) -> str:
        """DeleteOptions.preconditions "Must be fulfilled before a deletion is carried
        out. If not possible, a 409 Conflict status will be returned" (API reference,
        DeleteOptions); the message is the API server's."""
        wanted = (self._delete_options(request).get("preconditions") or {}).get("uid")
        key = (PODS, request.namespace, request.name)
        if not wanted or key not in self.objects or self.objects[key].deleted:
            return ""
        actual = self.objects[key]["metadata"].get("uid")
        if wanted == actual:
            return ""
        return f"Precondition failed: UID in precondition: {wanted}, UID in object meta: {actual}"

    def _delete_pod(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """DELETE of one Pod: 404 if there is none, 409 on a stale UID, else marked or removed.

        The answer is the Pod as it is after the delete: 200, or 202 when
        finalizers keep it ("returns a 202 status code (HTTP \"Accepted\")",
        kubernetes.io/docs/concepts/overview/working-with-objects/finalizers/).
        """
        key = (PODS, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            message = f'pods "{request.name}" not found'
            return aiohttp.web.json_response(status_body(404, message, "NotFound"), status=404)
        conflict = self._precondition_failure(request)
        if conflict:
            return aiohttp.web.json_response(status_body(409, conflict, "Conflict"), status=409)
        grace = self._delete_options(request).get("gracePeriodSeconds")
        marked = self.mark_deleted(key, grace)
        if marked is None:
            return aiohttp.web.json_response(copy.deepcopy(self.objects[key].last.raw))
        held = bool(marked["metadata"].get("finalizers"))
        return aiohttp.web.json_response(marked, status=202 if held else 200)

    def mark_deleted(self, key: Any, grace: int | None) -> dict[str, Any] | None:
        """A deleted Pod: marked with the end of its grace period, removed once that ends.

        A Pod on a node stays until its kubelet confirms that its containers
        stopped (a delete with grace period 0, `finish_deletion`), as on a
        real cluster. The deletionTimestamp is when the grace period ends:
        ObjectMeta's API reference calls it the "date and time at which this
        resource will be deleted", and a repeated delete may only shorten it.
        Grace period 0 is a force deletion, and a Pod no node runs needs no
        kubelet's word (kubernetes.io/docs/concepts/workloads/pods/
        pod-lifecycle/#pod-termination-forced). Either way a Pod with
        finalizers stays until they are all removed. Returns the marked Pod,
        or None when it is gone.
        """
        pod = self.objects[key]
        meta = pod["metadata"]
        if not pod.get("spec", {}).get("nodeName"):
            grace = 0
        elif grace is None:
            grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
        current = meta.get("deletionGracePeriodSeconds")
        if current is None or grace < current:
            pod.patch(
                {"metadata": {"deletionTimestamp": now(grace), "deletionGracePeriodSeconds": grace}}
            )
        if self.remove_if_released(key):
            return None
        return copy.deepcopy(pod.raw)

    def remove_if_released(self, key: Any) -> bool:
        """Remove a Pod whose deletion is complete: grace period over and no finalizers.

        "When the metadata.finalizers field is empty, Kubernetes considers the
        deletion complete and deletes the object" (kubernetes.io/docs/concepts/
        overview/working-with-objects/finalizers/); a Pod's graceful deletion
        completes when its kubelet deletes it with grace period 0.
        """
        meta = self.objects[key]["metadata"]
        done = meta.get("deletionTimestamp") and meta.get("deletionGracePeriodSeconds") == 0
        if not done or meta.get("finalizers"):
            return False
        self.objects[key].delete()
        self.collect_garbage()
        return True

    def _patch_pod(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """PATCH of a Pod's labels, annotations and finalizers; anything else is not faked.

        A JSON merge patch replaces `finalizers` whole; a strategic merge patch
        adds to them (the field's patch strategy is `merge`) and removes those
        listed under `$deleteFromPrimitiveList/finalizers` (kubernetes.io/docs/
        tasks/manage-kubernetes-objects/update-api-object-kubectl-patch/). A
        Pod being deleted takes no new finalizer (the API server's "no new
        finalizers can be added if the object is being deleted", 422), and
        one whose last finalizer goes is removed once its grace period is over.
        """
        key = (PODS, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            message = f'pods "{request.name}" not found'
            return aiohttp.web.json_response(status_body(404, message, "NotFound"), status=404)
        content_type = next(
            (v for k, v in request.headers.items() if k.lower() == "content-type"), ""
        ).split(";")[0]
        patch = request.data
        problem = _unfaked_patch(request.method.value, content_type, patch)
        if problem:
            return aiohttp.web.json_response(status_body(400, problem, "BadRequest"), status=400)
        changes = dict(patch["metadata"])
        pod = self.objects[key]
        old: list[str] = list(pod["metadata"].get("finalizers") or [])
        finalizers = old
        if content_type == STRATEGIC_MERGE_PATCH:
            removed = changes.pop(DELETE_FINALIZERS, None) or []
            added = [f for f in changes.pop("finalizers", None) or [] if f not in old]
            finalizers = [f for f in [*old, *added] if f not in removed]
        elif "finalizers" in changes:
            finalizers = list(changes.pop("finalizers") or [])
        if pod["metadata"].get("deletionTimestamp") and set(finalizers) - set(old):
            message = (
                f'Pod "{request.name}" is invalid: metadata.finalizers: Forbidden: '
                "no new finalizers can be added if the object is being deleted"
            )
            return aiohttp.web.json_response(status_body(422, message, "Invalid"), status=422)
        pod.patch({"metadata": {**changes, "finalizers": finalizers or None}})
        pod.patch({"metadata": {"resourceVersion": str(next(self._versions))}})
        answer = copy.deepcopy(pod.raw)
        self.remove_if_released(key)
        return aiohttp.web.json_response(answer)

    def disrupt(self, key: Any, reason: str, message: str, grace: int | None = None) -> None:
        """Take a Pod away as the control plane does: condition first, then deletion.

        "A dedicated Pod DisruptionTarget condition is added to indicate that
        the Pod is about to be deleted due to a disruption" (kubernetes.io/docs/
        concepts/workloads/pods/disruptions/#pod-disruption-conditions); the
        Eviction API, the scheduler's preemption and the taint manager then
        delete it gracefully.
        """
        self.set_disruption_target(key, reason, message)
        self.mark_deleted(key, grace)

    def set_disruption_target(self, key: Any, reason: str, message: str) -> None:
        """Add the DisruptionTarget condition (True) to the Pod's conditions."""
        pod = self.objects[key]
        conditions = (pod.get("status") or {}).get("conditions") or []
        others = [c for c in conditions if c.get("type") != DISRUPTION_TARGET]
        condition = {
            "type": DISRUPTION_TARGET,
            "status": "True",
            "reason": reason,
            "message": message,
            "lastTransitionTime": now(),
        }
        pod.patch({"status": {"conditions": [*others, condition]}})

    def _evict(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """`POST .../pods/<name>/eviction`, as `kubectl drain` sends it.

        An allowed eviction deletes the Pod gracefully after setting its
        DisruptionTarget condition (reason EvictionByEvictionAPI), honouring
        the Eviction's `deleteOptions`; a Pod that does not exist is a 404
        (kubernetes.io/docs/concepts/scheduling-eviction/api-eviction/).
        PodDisruptionBudgets are not modelled: every eviction is allowed.
        """
        key = (PODS, request.namespace, request.name)
        if request.method.value != "POST" or key not in self.objects or self.objects[key].deleted:
            message = f'pods "{request.name}" not found'
            return aiohttp.web.json_response(status_body(404, message, "NotFound"), status=404)
        body = request.data if isinstance(request.data, dict) else {}
        grace = (body.get("deleteOptions") or {}).get("gracePeriodSeconds")
        self.disrupt(key, EVICTION_BY_EVICTION_API, "Eviction API: evicting", grace)
        success = {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Success"}
        return aiohttp.web.json_response({**success, "code": 201}, status=201)

    def collect_garbage(self) -> None:
        """Delete every object whose owners are all gone, until nothing changes."""
        while True:
            live = [self.objects[key] for key in self.objects if not self.objects[key].deleted]
            uids = {obj["metadata"].get("uid") for obj in live}
            orphans = [
                obj
                for obj in live
                if (owners := obj["metadata"].get("ownerReferences"))
                and not any(owner["uid"] in uids for owner in owners)
            ]
            if not orphans:
                return
            for obj in orphans:
                obj.delete()


class FakeKubernetes:
    """The fake API server on 127.0.0.1, served from a background thread.

    Use as a context manager. `configuration()` gives a client configuration
    pointing at it; the other methods play the scheduler and the kubelet, add
    unrelated objects, inject failures and read what the server stores.
    """

    def __init__(self, namespaces: tuple[str, ...] = ()) -> None:
        self.api = ApiServer()
        self.api.namespaces.update(namespaces)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="fake-kubernetes", daemon=True
        )
        self._server = kmock.Server(self.api)

    def __enter__(self) -> Self:
        self._thread.start()
        self._run(self._start())
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._run(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _start(self) -> None:
        await self.api.__aenter__()
        await self._server.__aenter__()

    async def _stop(self) -> None:
        await self._server.__aexit__(None, None, None)
        await self.api.__aexit__(None, None, None)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def _on_loop(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the server's loop, between requests, never during one."""

        async def call() -> T:
            return fn()

        return self._run(call())

    @property
    def url(self) -> str:
        return str(self._server.url).rstrip("/")

    def configuration(self) -> kubernetes.client.Configuration:
        """A client configuration for this server; no kubeconfig is ever read."""
        return kubernetes.client.Configuration(host=self.url)

    def verbs_used(self) -> set[tuple[str, str]]:
        return self._on_loop(lambda: set(self.api.verbs_used))

    def fail(
        self,
        method: str,
        path: str,
        status: int,
        message: str = "injected failure",
        *,
        headers: dict[str, str] | None = None,
        times: int | None = 1,
        delay: float = 0.0,
    ) -> None:
        """Answer matching requests with a Status of `status`, before any state change."""
        failure = Failure(method, re.compile(path), status, message, headers or {}, times, delay)
        self._on_loop(lambda: self.api.failures.append(failure))

    def clear_failures(self) -> None:
        """Stop answering with injected failures, e.g. at the end of an outage."""
        self._on_loop(lambda: self.api.failures.clear())

    def get(self, resource: kmock.resource, namespace: str, name: str) -> dict[str, Any] | None:
        """The stored object, or None when it does not exist (a copy: edits do nothing)."""

        def read() -> dict[str, Any] | None:
            key = (resource, namespace, name)
            if key not in self.api.objects or self.api.objects[key].deleted:
                return None
            return copy.deepcopy(self.api.objects[key].raw)

        return self._on_loop(read)

    def add(self, resource: kmock.resource, obj: dict[str, Any]) -> None:
        """Store an object as if some other client had created it."""
        obj = copy.deepcopy(obj)
        meta = obj["metadata"]

        def store() -> None:
            self.api.stamp(obj, meta["namespace"])
            self.api.objects[resource, meta["namespace"], meta["name"]] = obj

        self._on_loop(store)

    def add_node(self, name: str = NODE_NAME, *, external_ip: str | None = None) -> None:
        """A node as the kubelet registers it: an InternalIP, and an ExternalIP if given
        (kubernetes.io/docs/reference/node/node-status/#addresses)."""
        addresses = [
            {"type": "InternalIP", "address": "10.128.0.7"},
            {"type": "Hostname", "address": name},
        ]
        if external_ip:
            addresses.append({"type": "ExternalIP", "address": external_ip})
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name},
            "status": {"addresses": addresses},
        }

        def store() -> None:
            self.api.stamp(node, None)
            self.api.objects[NODES, None, name] = node

        self._on_loop(store)

    def add_priority_class(self, name: str, value: int) -> None:
        """A PriorityClass as an admin creates it (cluster-scoped; only its value matters)."""
        self._on_loop(lambda: self.api.priority_classes.__setitem__(name, value))

    def set_pod_status(
        self, namespace: str, name: str, phase: str, pod_ip: str = "", *, ready: bool | None = None
    ) -> None:
        """Play the scheduler and the kubelet: bind the Pod to a node, report its status.

        `ready` is the Ready condition; by default what the kubelet reports
        once the readiness probe passes on a Running Pod, and not before.
        """
        ready = phase == "Running" if ready is None else ready
        status: dict[str, Any] = {
            "phase": phase,
            "podIP": pod_ip or None,
            "podIPs": [{"ip": pod_ip}] if pod_ip else None,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True" if ready else "False"},
            ],
        }
        self._patch(PODS, namespace, name, {"spec": {"nodeName": NODE_NAME}, "status": status})

    def set_container_waiting(self, namespace: str, name: str, reason: str, message: str) -> None:
        """Play the kubelet of a Pod whose container cannot start (`ErrImagePull`, ...).

        The Pod stays Pending; the reason is in its container status
        (kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#container-state-waiting).
        """
        waiting = {"waiting": {"reason": reason, "message": message}}
        status = {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [
                {
                    "name": "squid",
                    "image": "image",
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "state": waiting,
                }
            ],
        }
        self._patch(PODS, namespace, name, {"spec": {"nodeName": NODE_NAME}, "status": status})

    def set_unschedulable(self, namespace: str, name: str, message: str) -> None:
        """Play the scheduler failing to place a Pod: PodScheduled False, Unschedulable
        (kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#pod-conditions)."""
        condition = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": message,
        }
        self._patch(
            PODS, namespace, name, {"status": {"phase": "Pending", "conditions": [condition]}}
        )

    def evict(self, namespace: str, name: str) -> None:
        """Evict the Pod as `kubectl drain` does: POST an Eviction to its subresource."""
        with kubernetes.client.ApiClient(self.configuration()) as api:
            eviction = kubernetes.client.V1Eviction(
                metadata=kubernetes.client.V1ObjectMeta(name=name, namespace=namespace)
            )
            kubernetes.client.CoreV1Api(api).create_namespaced_pod_eviction(
                name, namespace, eviction
            )

    def disrupt(self, namespace: str, name: str, reason: str, message: str) -> None:
        """Play the scheduler preempting the Pod (`PREEMPTION_BY_SCHEDULER`) or the
        taint manager deleting it (`DELETION_BY_TAINT_MANAGER`): the DisruptionTarget
        condition, then a graceful deletion the kubelet (`finish_deletion`) confirms."""
        self._on_loop(lambda: self.api.disrupt((PODS, namespace, name), reason, message))

    def start_disruption(self, namespace: str, name: str, reason: str, message: str) -> None:
        """Only the DisruptionTarget condition, as when a disruption is interrupted:
        "that Pod might then not actually be deleted" (kubernetes.io/docs/concepts/
        workloads/pods/disruptions/#pod-disruption-conditions)."""
        self._on_loop(
            lambda: self.api.set_disruption_target((PODS, namespace, name), reason, message)
        )

    def evict_for_node_pressure(self, namespace: str, name: str, message: str) -> None:
        """Play the kubelet evicting the Pod under node pressure: phase Failed, reason
        Evicted, and the DisruptionTarget condition with reason TerminationByKubelet
        (kubernetes.io/docs/concepts/scheduling-eviction/node-pressure-eviction/; the
        Pod stays in the API, stopped, until it is deleted)."""

        def evict() -> None:
            key = (PODS, namespace, name)
            self.api.set_disruption_target(key, TERMINATION_BY_KUBELET, message)
            conditions = [
                {**c, "status": "False"} if c.get("type") == "Ready" else c
                for c in self.api.objects[key]["status"].get("conditions") or []
            ]
            status = {"phase": "Failed", "reason": "Evicted", "message": message}
            self.api.objects[key].patch({"status": {**status, "conditions": conditions}})

        self._on_loop(evict)

    def move_back(self, namespace: str, name: str, field: str, seconds: float) -> None:
        """Move the Pod's `creationTimestamp` or `deletionTimestamp` into the past,
        as if that much time had gone by (instead of a test waiting for it)."""

        def move() -> None:
            meta = self.api.objects[PODS, namespace, name]["metadata"]
            self.api.objects[PODS, namespace, name].patch(
                {"metadata": {field: earlier(meta[field], seconds)}}
            )

        self._on_loop(move)

    def finish_deletion(self, namespace: str, name: str) -> None:
        """Play the kubelet once a deleted Pod's containers have stopped.

        It reports the Pod ended (`Failed`, unless it already `Succeeded`) and
        not Ready, then deletes it with grace period 0, which removes it unless
        finalizers hold it: "the kubelet transitions deleted Pods, except for
        static Pods and force-deleted Pods without a finalizer, to a terminal
        phase ... before their deletion from the API server"
        (kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#pod-phase).
        """

        def confirm() -> None:
            key = (PODS, namespace, name)
            pod = self.api.objects[key]
            assert pod["metadata"].get("deletionTimestamp"), f"pod {name} is not being deleted"
            status = pod.get("status") or {}
            phase = "Succeeded" if status.get("phase") == "Succeeded" else "Failed"
            conditions = [
                {**c, "status": "False"} if c.get("type") == "Ready" else c
                for c in status.get("conditions") or []
            ]
            pod.patch({"status": {"phase": phase, "conditions": conditions}})
            self.api.mark_deleted(key, 0)

        self._on_loop(confirm)

    def _patch(
        self, resource: kmock.resource, namespace: str, name: str, patch: dict[str, Any]
    ) -> None:
        self._on_loop(lambda: self.api.objects[resource, namespace, name].patch(patch))
