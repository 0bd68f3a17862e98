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
- label selectors (equality and existence) and limit/continue paging on lists;
- graceful deletion of a Pod bound to a node: it gets a deletionTimestamp and
  stays until the kubelet (the test) confirms, as on a real cluster;
- garbage collection of dependents through ownerReferences;
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
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Self, TypeVar

import aiohttp.web
import attrs
import kmock
import kubernetes
import kubernetes_validate

T = TypeVar("T")

PODS = kmock.resource("", "v1", "pods")
SECRETS = kmock.resource("", "v1", "secrets")
KINDS = {PODS: "Pod", SECRETS: "Secret"}
NODE_NAME = "fake-node"
SCHEMA_VERSION = kubernetes_validate.latest_version()

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


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    """The request handler: kmock's emulator with the behaviour listed above."""

    failures: list[Failure] = attrs.field(factory=list)
    verbs_used: set[tuple[str, str]] = attrs.field(factory=set)
    _versions: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1))

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for resource, kind in KINDS.items():
            self.resources[resource] = kmock.ResourceInfo(kind=kind, namespaced=True)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        resource = request.resource
        if resource is not None and request.action is not None:
            self.verbs_used.add((str(resource.plural), RBAC_VERBS[request.action]))
        failure = self._take_failure(request)
        if failure is not None:
            await asyncio.sleep(failure.delay)
            body = status_body(failure.status, failure.message)
            return aiohttp.web.json_response(body, status=failure.status, headers=failure.headers)
        if request.action == kmock.action.CREATE and resource in KINDS:
            problem = self._admit(request)
            if problem:
                return aiohttp.web.json_response(status_body(422, problem, "Invalid"), status=422)
        if request.action == kmock.action.DELETE and resource == PODS:
            graceful = self._delete_gracefully(request)
            if graceful is not None:
                return aiohttp.web.json_response(graceful)
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
        self.stamp(obj, request.namespace)
        return ""

    def stamp(self, obj: dict[str, Any], namespace: str | None) -> None:
        """Set what the API server sets on a new object."""
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", namespace)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now()
        meta["resourceVersion"] = str(next(self._versions))
        if obj.get("kind") == "Pod":
            obj["status"] = {"phase": "Pending"}

    def _delete_gracefully(self, request: kmock.Request) -> dict[str, Any] | None:
        """A Pod on a node stays, marked for deletion, until its kubelet confirms."""
        if request.name is None:
            return None
        key = (PODS, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        pod = self.objects[key]
        if not pod.get("spec", {}).get("nodeName"):
            return None
        if not pod["metadata"].get("deletionTimestamp"):
            grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
            pod.patch(
                {"metadata": {"deletionTimestamp": now(), "deletionGracePeriodSeconds": grace}}
            )
        return copy.deepcopy(pod.raw)

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

    def __init__(self) -> None:
        self.api = ApiServer()
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

    def set_pod_status(self, namespace: str, name: str, phase: str, pod_ip: str = "") -> None:
        """Play the scheduler and the kubelet: bind the Pod to a node, report its status."""
        status: dict[str, Any] = {"phase": phase, "podIP": pod_ip or None}
        status["podIPs"] = [{"ip": pod_ip}] if pod_ip else None
        self._patch(PODS, namespace, name, {"spec": {"nodeName": NODE_NAME}, "status": status})

    def finish_deletion(self, namespace: str, name: str) -> None:
        """Play the kubelet confirming that a deleted Pod's containers have stopped."""

        def remove() -> None:
            self.api.objects[PODS, namespace, name].delete()
            self.api.collect_garbage()

        self._on_loop(remove)

    def _patch(
        self, resource: kmock.resource, namespace: str, name: str, patch: dict[str, Any]
    ) -> None:
        self._on_loop(lambda: self.api.objects[resource, namespace, name].patch(patch))
