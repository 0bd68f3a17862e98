"""A fake Compute Engine REST API, small enough to read, for the GCP provider's tests.

The real google-cloud-compute clients talk to it over HTTP on 127.0.0.1 with
anonymous credentials, so requests are built, serialised and parsed exactly
as they would be against compute.googleapis.com. It keeps instances per
zone, zonal and global operations, firewall rules and guest attributes, and
it rejects what the real API would reject in the requests this project sends
(invalid names, labels on instances and disks, metadata, spot scheduling, a
subnetwork outside the zone's region, IPv4 and IPv6 in one firewall rule, a
rule moved to another network): a provider bug shows up as a 400 here.
docs/fakes.md lists what it models and where the real behaviour is documented.

Stable API (used by the provider tests and by workflow-level tests):

    with FakeCompute(project="test-project") as fake:   # or the `fake_compute` fixture
        provider = GcpProvider(settings, "prod-eu", **fake.clients())
        fake.set_status("europe-west1-b", name, "RUNNING", nat_ip="203.0.113.10")
        fake.inject_error("insert", "stockout", zone="europe-west1-b", times=None)
        fake.inject_error("get", "unavailable", times=2)
        fake.clear_errors()
        fake.set_operations_paused(True)      # operations stay RUNNING until resumed
        fake.set_operation_seconds(3.0, zone=zone)  # operations there take 3 s
        fake.guest_write(zone, name, "proxy-operator/state", "ready")  # as the VM would
        fake.set_zone_unreachable(zone, True)  # aggregated lists cannot see it
        fake.preempt(zone, name)              # Compute Engine reclaims a Spot VM
        fake.delete_firewall(rule)            # a rule deleted by hand
        fake.race_firewall_update(rule, 8080) # another writer's update overwrites ours
        fake.admits(3128)                     # whether a rule lets the port through
        fake.instance(zone, name)             # stored resource (dict) or None
        fake.calls("insert")                  # requests received, oldest first

- Operations: a write returns a RUNNING operation that is DONE on the next
  poll (`get` or `wait`), unless paused. An instance exists (PROVISIONING) as
  soon as its insert is accepted and disappears when its delete operation is
  DONE, as on the real API.
- `auto_start_ip`: when set, an instance whose insert operation finishes is
  RUNNING with that external IP (e.g. 127.0.0.1 in front of a local Squid).
  RUNNING is only the hypervisor's view: the guest's startup script has not
  run yet. Its guest attributes stay empty (`getGuestAttributes` answers 404)
  until a test writes them as the script would (`guest_write`), which is how
  the fake models the minutes a real first boot takes.
- An insert carrying a `requestId` seen before is answered with the
  operation the first one started, creating nothing (the API deduplicates
  by it for at least 60 minutes).
- A failed insert operation leaves its instance behind as PROVISIONING for
  the next FAILED_INSERT_LINGER_GETS `get`s (its name still taken: a second
  insert is a 409), then it vanishes, as on the real API.
- Errors (`inject_error(method, kind, times=1, zone=None)`; `times=None`
  means until cleared): METHODS lists the methods, ERROR_KINDS the kinds.
  `stockout`, `quota_operation` and `org_policy_operation` fail the
  operation (as Compute Engine reports them) and are accepted only for
  methods that return one.
- `preempt(zone, name)` reclaims a Spot VM as Compute Engine does: it records
  a `compute.instances.preempted` operation in the zone (listed by
  `zoneOperations.list`, filtered by `operationType`) and deletes the VM, its
  `instanceTerminationAction`; `stopping=True` leaves it STOPPING instead, the
  notice before the delete. A VM that is not Spot is refused (ValueError).
- Firewall rules carry no fingerprint and `firewalls.update` takes no
  precondition, so the last write wins: `race_firewall_update(rule, port)`
  plays another worker whose read-modify-write lands right after the next
  update and drops its change; `delete_firewall(rule)` is a rule deleted by
  hand. `admits(port)` is the network's part: whether any rule lets TCP
  `port` through (a test's probe sees a timeout otherwise).
- From another process: `python -m tests.fakes.compute --port 8089` serves
  it, and `remote(url, "inject_error", method="insert", kind="quota")`
  (a POST to `/_fake/<name>` with the keyword arguments as JSON) calls any of
  CONTROL_METHODS on it. `make_clients(url)` builds clients for it anywhere.
"""

from __future__ import annotations

import argparse
import ipaddress
import itertools
import json
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler
from typing import Any, TypedDict
from urllib.parse import parse_qs, urlsplit

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1

from tests.fakes.served import ServedFake

DEFAULT_PROJECT = "test-project"
DEFAULT_ZONES = ("europe-west1-b", "europe-west1-c", "europe-west1-d", "us-central1-a")
API_PREFIX = "/compute/v1"
SELF_LINK_BASE = "https://www.googleapis.com/compute/v1"

# How long `wait` holds a request for a paused operation before answering
# "still RUNNING" (the real API holds up to two minutes).
WAIT_HOLD_SECONDS = 0.05
# How long `wait` holds one for an operation that takes time (set_operation_seconds).
TIMED_WAIT_HOLD_SECONDS = 2.0
# A failed insert's instance stays visible, PROVISIONING, for this many `get`s
# before it vanishes. The API accepts the insert and creates the instance
# before the zone reports the failure, then cleans it up; a client that reads
# the instance right after the failed operation still finds it (e.g.
# dragonflydb/dragonfly#8155: a freshly inserted instance 404s minutes later).
FAILED_INSERT_LINGER_GETS = 1
# Guest attributes, written by the guest through the metadata server, are
# accepted only when the instance's metadata enables them
# (https://cloud.google.com/compute/docs/metadata/manage-guest-attributes).
GUEST_ATTRIBUTES_KEY = "enable-guest-attributes"

RFC1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
LABEL_KEY = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
LABEL_VALUE = re.compile(r"^[a-z0-9_-]{0,63}$")
METADATA_KEY = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")
METADATA_VALUE_MAX = 256 * 1024
METADATA_TOTAL_MAX = 512 * 1024
# instances.insert's `requestId`: a UUID, not the zero UUID (API reference).
REQUEST_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
NIL_UUID = "00000000-0000-0000-0000-000000000000"
# The one filter form the provider sends: `<field> = "<value>"`.
FILTER = re.compile(r'^\s*(?P<field>[a-z][a-zA-Z0-9_.-]*)\s*=\s*"(?P<value>[^"]*)"\s*$')

OPERATION_METHODS = frozenset({"insert", "delete", "firewall_insert", "firewall_update"})
METHODS = (
    *sorted(OPERATION_METHODS),
    "get",
    "get_guest_attributes",
    "aggregated_list",
    "firewall_get",
    "zone_operation_get",
    "zone_operation_wait",
    "zone_operation_list",
    "global_operation_get",
    "global_operation_wait",
)
CONTROL_METHODS = frozenset(
    {
        "set_status",
        "inject_error",
        "clear_errors",
        "set_operations_paused",
        "set_operation_seconds",
        "set_zone_unreachable",
        "guest_write",
        "preempt",
        "add_instance",
        "put_firewall",
        "delete_firewall",
        "race_firewall_update",
        "instance",
        "firewall",
    }
)
# Statuses in which an instance has released its ephemeral external IP.
STOPPED_STATUSES = frozenset({"STOPPING", "STOPPED", "TERMINATED", "SUSPENDED"})


@dataclass(frozen=True)
class ErrorKind:
    """An error as Compute Engine reports it: HTTP status, reason or code, message."""

    status: int
    reason: str
    message: str
    in_operation: bool = False
    retry_after: int | None = None


ERROR_KINDS: dict[str, ErrorKind] = {
    "quota": ErrorKind(403, "quotaExceeded", "Quota 'CPUS' exceeded.  Limit: 8.0 in region."),
    "quota_operation": ErrorKind(
        403,
        "QUOTA_EXCEEDED",
        "Quota 'IN_USE_ADDRESSES' exceeded.  Limit: 8.0 in region.",
        in_operation=True,
    ),
    "stockout": ErrorKind(
        503,
        "ZONE_RESOURCE_POOL_EXHAUSTED",
        "The zone does not have enough resources available to fulfill the request.  "
        "Try a different zone, or try again later.",
        in_operation=True,
    ),
    # A project's per-minute rate quota, or its concurrent operations
    # (compute/api-quota, compute/operations-quota): "wait a minute".
    "rate_limit": ErrorKind(403, "rateLimitExceeded", "Rate Limit Exceeded"),
    "user_rate_limit": ErrorKind(403, "userRateLimitExceeded", "User Rate Limit Exceeded"),
    # Too many operations on one resource, reported by the operation
    # (googleapis/python-compute#279: "403 FORBIDDEN RESOURCE_OPERATION_RATE_EXCEEDED").
    "operation_rate": ErrorKind(
        403,
        "RESOURCE_OPERATION_RATE_EXCEEDED",
        "Too frequent operations from the source resource.",
        in_operation=True,
    ),
    # An organisation policy refusing the request: HTTP 412, reason
    # conditionNotMet, e.g. gardener/gardener-extension-provider-gcp#415 and
    # fortinet/fortigate-terraform-deploy#34 ("googleapi: Error 412: Constraint
    # constraints/compute.vmExternalIpAccess violated ..., conditionNotMet").
    "org_policy": ErrorKind(
        412,
        "conditionNotMet",
        "Constraint constraints/compute.vmExternalIpAccess violated for project 123456789. "
        "Add instance projects/test-project/zones/europe-west1-b/instances/x to the "
        "constraint to use external IP with it.",
    ),
    # The same refusal reported by the insert's operation (code CONDITION_NOT_MET,
    # as in GoogleCloudPlatform/pubsub#258 and 2i2c-org/infrastructure#489).
    "org_policy_operation": ErrorKind(
        412,
        "CONDITION_NOT_MET",
        "Instance 'x' creation failed: Constraint constraints/compute.vmExternalIpAccess "
        "violated for project 123456789.",
        in_operation=True,
    ),
    "too_many_requests": ErrorKind(429, "tooManyRequests", "Too Many Requests", retry_after=7),
    "unavailable": ErrorKind(503, "backendError", "The service is currently unavailable."),
    "internal": ErrorKind(500, "internalError", "Internal error. Please try again."),
    "forbidden": ErrorKind(403, "forbidden", "Required 'compute.instances.create' permission"),
    "bad_request": ErrorKind(
        400, "invalid", "Invalid value for field 'resource.machineType': machine type not found."
    ),
    "not_found": ErrorKind(
        404, "notFound", "The resource 'projects/debian-cloud/global/images/family/x' was not found"
    ),
    "not_ready": ErrorKind(400, "resourceNotReady", "The resource is not ready"),
}


class ComputeClients(TypedDict):
    """The clients GcpProvider takes, as keyword arguments: `GcpProvider(..., **clients)`."""

    instances: compute_v1.InstancesClient
    operations: compute_v1.ZoneOperationsClient
    global_operations: compute_v1.GlobalOperationsClient
    firewalls: compute_v1.FirewallsClient


def make_clients(url: str) -> ComputeClients:
    """Real REST clients pointed at `url`, with anonymous credentials."""
    credentials = AnonymousCredentials()
    options = {"api_endpoint": url}
    return ComputeClients(
        instances=compute_v1.InstancesClient(credentials=credentials, client_options=options),
        operations=compute_v1.ZoneOperationsClient(credentials=credentials, client_options=options),
        global_operations=compute_v1.GlobalOperationsClient(
            credentials=credentials, client_options=options
        ),
        firewalls=compute_v1.FirewallsClient(credentials=credentials, client_options=options),
    )


def remote(url: str, name: str, /, **kwargs: Any) -> Any:
    """Call control method `name` of a fake running in another process."""
    request = urllib.request.Request(
        f"{url}/_fake/{name}",
        data=json.dumps(kwargs).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read() or b"null")


@dataclass(frozen=True)
class Call:
    """One request the fake received."""

    method: str
    zone: str | None
    path: str
    query: dict[str, list[str]]
    body: dict[str, Any] | None


class ApiError(Exception):
    """Answered as a Compute Engine error body."""

    def __init__(self, kind: ErrorKind) -> None:
        super().__init__(kind.message)
        self.kind = kind


def _invalid(message: str) -> ApiError:
    return ApiError(ErrorKind(400, "invalid", message))


def _not_found(resource: str) -> ApiError:
    return ApiError(ErrorKind(404, "notFound", f"The resource '{resource}' was not found"))


@dataclass
class _Injection:
    method: str
    kind: ErrorKind
    remaining: int | None
    zone: str | None


@dataclass
class _Operation:
    name: str
    zone: str | None
    op_type: str
    target: str
    error: ErrorKind | None = None
    on_done: Callable[[], None] | None = None
    status: str = "RUNNING"
    # time.monotonic() before which polls still find it RUNNING.
    not_before: float = 0.0
    status_message: str = ""
    insert_time: str = field(
        default_factory=lambda: datetime.now(UTC).isoformat(timespec="milliseconds")
    )


@dataclass
class _Route:
    verb: str
    pattern: re.Pattern[str]
    method: str
    handler: Callable[..., tuple[int, Any]] = field(repr=False)


class FakeCompute(ServedFake):
    """The fake server and its state; every public method is thread-safe."""

    def __init__(
        self,
        project: str = DEFAULT_PROJECT,
        zones: tuple[str, ...] = DEFAULT_ZONES,
        *,
        auto_start_ip: str | None = None,
    ) -> None:
        self.project = project
        self.zones = zones
        self.auto_start_ip = auto_start_ip
        # Page size of aggregated lists when set (the client's maxResults otherwise).
        self.page_size: int | None = None
        self._cond = threading.Condition()
        self._instances: dict[tuple[str, str], dict[str, Any]] = {}
        self._firewalls: dict[str, dict[str, Any]] = {}
        self._operations: dict[str, _Operation] = {}
        self._errors: list[_Injection] = []
        self._calls: list[Call] = []
        self._paused = False
        self._operation_seconds: dict[str | None, float] = {}
        self._unreachable: set[str] = set()
        # (zone, name) -> `get`s left before a failed insert's instance vanishes.
        self._lingering: dict[tuple[str, str], int] = {}
        self._guest: dict[tuple[str, str], dict[str, str]] = {}
        # requestId -> the operation its first request started.
        self._requests: dict[str, str] = {}
        # Firewall rule name -> the TCP port another writer adds in a PUT
        # that lands right after the next update's (race_firewall_update).
        self._racing_writers: dict[str, int] = {}
        self._ids = itertools.count(1000)
        self._routes = self._build_routes()

    # -- lifecycle ------------------------------------------------------------

    def start(self, port: int = 0) -> FakeCompute:
        self._serve_http(self._handler_class(), "fake-compute", port)
        return self

    def clients(self) -> ComputeClients:
        return make_clients(self.url)

    # -- control ------------------------------------------------------------

    def set_status(self, zone: str, name: str, status: str, *, nat_ip: str | None = None) -> None:
        """Move an instance to `status`; `nat_ip` assigns its external IP.

        Stopping statuses release the ephemeral IP, as Compute Engine does.
        """
        with self._cond:
            inst = self._require(zone, name)
            inst["status"] = status
            access = inst["networkInterfaces"][0].setdefault("accessConfigs", [{}])[0]
            if nat_ip is not None:
                access["natIP"] = nat_ip
            elif status in STOPPED_STATUSES:
                access.pop("natIP", None)

    def inject_error(
        self, method: str, kind: str, *, times: int | None = 1, zone: str | None = None
    ) -> None:
        """Fail the next `times` calls of `method` (in `zone`, if given) with `kind`."""
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; one of {METHODS}")
        spec = ERROR_KINDS[kind]
        if spec.in_operation and method not in OPERATION_METHODS:
            raise ValueError(f"{kind!r} fails an operation; {method!r} returns none")
        with self._cond:
            self._errors.append(_Injection(method, spec, times, zone))

    def clear_errors(self) -> None:
        with self._cond:
            self._errors.clear()

    def set_operations_paused(self, paused: bool) -> None:
        """While paused, operations stay RUNNING however often they are polled."""
        with self._cond:
            self._paused = paused
            self._cond.notify_all()

    def set_operation_seconds(self, seconds: float, *, zone: str | None = None) -> None:
        """Operations started from now on (in `zone`, or global ones) take `seconds`.

        Real inserts take tens of seconds, and a stockout can be reported
        minutes after the insert was accepted.
        """
        with self._cond:
            self._operation_seconds[zone] = seconds

    def set_zone_unreachable(self, zone: str, unreachable: bool) -> None:
        """Make `zone` unreachable: aggregated lists report it, zonal calls get 503.

        An aggregated list then carries the zone in `unreachables` and an
        UNREACHABLE warning on its scope instead of its instances (Warning.code
        UNREACHABLE, "a given scope cannot be reached", in the API reference of
        instances.aggregatedList); calls to the zone itself fail as unavailable.
        """
        with self._cond:
            if unreachable:
                self._unreachable.add(zone)
            else:
                self._unreachable.discard(zone)

    def guest_write(self, zone: str, name: str, path: str, value: str) -> None:
        """What a process on the VM does with `PUT .../guest-attributes/<path>`.

        `path` is `<namespace>/<key>`. Refused (ValueError) unless the instance's
        metadata sets `enable-guest-attributes: TRUE`, as the metadata server
        refuses such writes.
        """
        namespace, _, key = path.partition("/")
        with self._cond:
            inst = self._require(zone, name)
            metadata = {i["key"]: i.get("value", "") for i in inst["metadata"].get("items", [])}
            if metadata.get(GUEST_ATTRIBUTES_KEY, "").upper() != "TRUE":
                raise ValueError(f"guest attributes are not enabled on {zone}/{name}")
            if not (namespace and key):
                raise ValueError(f"guest attribute path {path!r}: expected <namespace>/<key>")
            self._guest.setdefault((zone, name), {})[path] = value

    def preempt(self, zone: str, name: str, *, stopping: bool = False) -> None:
        """Reclaim a Spot VM: a `compute.instances.preempted` operation, then the VM deleted.

        `stopping`: the VM stays STOPPING (its external IP released), as
        during the notice before Compute Engine deletes it.
        """
        with self._cond:
            inst = self._require(zone, name)
            if inst.get("scheduling", {}).get("provisioningModel") != "SPOT":
                raise ValueError(
                    f"{zone}/{name} is not a Spot VM: Compute Engine never preempts it"
                )
            op = _Operation(
                name=f"operation-{next(self._ids)}-fake",
                zone=zone,
                op_type="compute.instances.preempted",
                target=f"zones/{zone}/instances/{name}",
                status="DONE",
                status_message="Instance was preempted.",
            )
            self._operations[op.name] = op
            if stopping:
                self.set_status(zone, name, "STOPPING")
            else:
                self._forget(zone, name)
            self._cond.notify_all()

    def add_instance(
        self,
        zone: str,
        name: str,
        *,
        labels: dict[str, str] | None = None,
        metadata: dict[str, str] | None = None,
        status: str = "RUNNING",
        nat_ip: str | None = None,
    ) -> None:
        """Seed an instance that did not come through `insert` (another tool's VM)."""
        body: dict[str, Any] = {
            "name": name,
            "machineType": f"zones/{zone}/machineTypes/e2-small",
            "labels": labels or {},
            "metadata": {"items": [{"key": k, "value": v} for k, v in (metadata or {}).items()]},
            "networkInterfaces": [{"network": "global/networks/default"}],
        }
        with self._cond:
            self._store_instance(zone, body)
        self.set_status(zone, name, status, nat_ip=nat_ip)

    def put_firewall(self, body: dict[str, Any]) -> None:
        """Seed or overwrite a firewall rule (e.g. one widened by hand)."""
        with self._cond:
            self._firewalls[body["name"]] = self._complete_firewall(body)

    def delete_firewall(self, name: str) -> None:
        """Delete a firewall rule as someone would by hand (console, gcloud); absent is fine."""
        with self._cond:
            self._firewalls.pop(name, None)

    def race_firewall_update(self, name: str, port: int) -> None:
        """Another writer adds TCP `port` to rule `name`, racing the next update.

        It read the rule when the next update's request did and writes its
        own read-modify-write result just after that update is applied: the
        last write wins, so that update's change is lost. Firewall rules
        carry no fingerprint and `firewalls.update` takes no precondition,
        so Compute Engine accepts both (API reference of firewalls.update).
        """
        with self._cond:
            self._racing_writers[name] = port

    def admits(self, port: int) -> bool:
        """Whether an enabled ingress rule of the project admits TCP `port`.

        The VPC network's part in a probe: traffic no rule admits is dropped,
        and the prober sees a timeout (firewall/docs/firewalls, implied deny ingress).
        """
        with self._cond:
            return any(
                rule.get("direction") == "INGRESS"
                and not rule.get("disabled", False)
                and any(
                    allowed.get("IPProtocol") in ("tcp", "all")
                    and (not allowed.get("ports") or str(port) in allowed["ports"])
                    for allowed in rule.get("allowed", [])
                )
                for rule in self._firewalls.values()
            )

    def instance(self, zone: str, name: str) -> dict[str, Any] | None:
        with self._cond:
            found = self._instances.get((zone, name))
            return json.loads(json.dumps(found)) if found is not None else None

    def instance_keys(self) -> set[tuple[str, str]]:
        """(zone, name) of every instance."""
        with self._cond:
            return set(self._instances)

    def firewall(self, name: str) -> dict[str, Any] | None:
        with self._cond:
            found = self._firewalls.get(name)
            return json.loads(json.dumps(found)) if found is not None else None

    def calls(self, method: str | None = None) -> list[Call]:
        with self._cond:
            return [c for c in self._calls if method is None or c.method == method]

    # -- HTTP -----------------------------------------------------------------

    def _build_routes(self) -> list[_Route]:
        project = r"/projects/(?P<project>[^/]+)"
        zone = project + r"/zones/(?P<zone>[^/]+)"
        instance = zone + r"/instances/(?P<name>[^/]+)"
        zone_op = zone + r"/operations/(?P<op>[^/]+)"
        global_op = project + r"/global/operations/(?P<op>[^/]+)"
        firewalls = project + r"/global/firewalls"
        firewall = firewalls + r"/(?P<name>[^/]+)"
        table: list[tuple[str, str, str, Callable[..., tuple[int, Any]]]] = [
            ("POST", zone + r"/instances", "insert", self._insert),
            ("GET", instance, "get", self._get),
            (
                "GET",
                instance + "/getGuestAttributes",
                "get_guest_attributes",
                self._guest_attributes,
            ),
            ("DELETE", instance, "delete", self._delete),
            ("GET", project + r"/aggregated/instances", "aggregated_list", self._aggregated),
            ("GET", zone_op, "zone_operation_get", self._op_get),
            ("POST", zone_op + "/wait", "zone_operation_wait", self._op_wait),
            ("GET", zone + r"/operations", "zone_operation_list", self._op_list),
            ("GET", global_op, "global_operation_get", self._op_get),
            ("POST", global_op + "/wait", "global_operation_wait", self._op_wait),
            ("GET", firewall, "firewall_get", self._fw_get),
            ("POST", firewalls, "firewall_insert", self._fw_insert),
            ("PUT", firewall, "firewall_update", self._fw_update),
        ]
        return [
            _Route(verb, re.compile(f"^{API_PREFIX}{path}$"), method, handler)
            for verb, path, method, handler in table
        ]

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake._serve(self)

            do_POST = do_PUT = do_DELETE = do_GET

            def log_message(self, format: str, *args: Any) -> None:
                pass  # keep test output clean

        return Handler

    def _serve(self, request: BaseHTTPRequestHandler) -> None:
        url = urlsplit(request.path)
        length = int(request.headers.get("Content-Length") or 0)
        raw = request.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        headers: dict[str, str] = {}
        try:
            if url.path.startswith("/_fake/"):
                status, payload = 200, self._control(url.path.removeprefix("/_fake/"), body or {})
            else:
                status, payload = self._dispatch(
                    request.command, url.path, parse_qs(url.query), body
                )
        except ApiError as err:
            status, payload = err.kind.status, _error_body(err.kind)
            if err.kind.retry_after is not None:
                headers["Retry-After"] = str(err.kind.retry_after)
        data = json.dumps(payload).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json; charset=UTF-8")
        request.send_header("Content-Length", str(len(data)))
        for name, value in headers.items():
            request.send_header(name, value)
        request.end_headers()
        request.wfile.write(data)

    def _control(self, name: str, kwargs: dict[str, Any]) -> Any:
        if name not in CONTROL_METHODS:
            raise ApiError(ErrorKind(404, "notFound", f"no control method {name!r}"))
        return getattr(self, name)(**kwargs)

    def _dispatch(
        self, verb: str, path: str, query: dict[str, list[str]], body: dict[str, Any] | None
    ) -> tuple[int, Any]:
        for route in self._routes:
            match = route.pattern.match(path)
            if route.verb != verb or match is None:
                continue
            params = match.groupdict()
            zone = params.get("zone")
            with self._cond:
                self._calls.append(Call(route.method, zone, path, query, body))
                if params.pop("project") != self.project:
                    raise _not_found(f"projects/{self.project}")
                if zone is not None and zone not in self.zones:
                    raise _not_found(f"projects/{self.project}/zones/{zone}")
                if zone in self._unreachable:
                    raise ApiError(ERROR_KINDS["unavailable"])
                injected = self._take_error(route.method, zone)
                if injected is not None and not injected.in_operation:
                    raise ApiError(injected)
                return route.handler(query=query, body=body, failure=injected, **params)
        raise ApiError(ErrorKind(404, "notFound", f"no route for {verb} {path}"))

    def _take_error(self, method: str, zone: str | None) -> ErrorKind | None:
        for injection in self._errors:
            if injection.method == method and injection.zone in (None, zone):
                if injection.remaining is not None:
                    injection.remaining -= 1
                    if injection.remaining <= 0:
                        self._errors.remove(injection)
                return injection.kind
        return None

    # -- instances ------------------------------------------------------------

    def _insert(
        self,
        *,
        zone: str,
        query: dict[str, list[str]],
        body: dict[str, Any] | None,
        failure: ErrorKind | None,
        **_: Any,
    ) -> tuple[int, Any]:
        if body is None:
            raise _invalid("Required field 'resource' not specified")
        _validate_instance(zone, body)
        name = body["name"]
        request_id = query.get("requestId", [""])[0]
        if request_id:
            if not REQUEST_ID.match(request_id) or request_id == NIL_UUID:
                raise _invalid(f"Invalid value for field 'requestId': '{request_id}'")
            earlier = self._requests.get(request_id)
            if earlier is not None:
                # A request repeated with its requestId is answered with the
                # operation the first one started, however it has fared.
                return 200, self._op_json(self._poll(earlier, zone))
        if (zone, name) in self._instances:
            raise ApiError(
                ErrorKind(
                    409,
                    "alreadyExists",
                    f"The resource 'projects/{self.project}/zones/{zone}/instances/{name}' "
                    "already exists",
                )
            )
        # The instance exists from the moment the insert is accepted, even if
        # the operation later fails; `lingered` below removes it then.
        self._store_instance(zone, body)

        def lingered() -> None:
            self._lingering[zone, name] = FAILED_INSERT_LINGER_GETS

        def started() -> None:
            if self.auto_start_ip is not None and (zone, name) in self._instances:
                self._instances[zone, name]["status"] = "RUNNING"
                access = self._instances[zone, name]["networkInterfaces"][0]["accessConfigs"][0]
                access["natIP"] = self.auto_start_ip

        operation = self._new_operation(
            zone, "insert", f"zones/{zone}/instances/{name}", failure, started, lingered
        )
        if request_id:
            self._requests[request_id] = operation["name"]
        return 200, operation

    def _get(self, *, zone: str, name: str, **_: Any) -> tuple[int, Any]:
        inst = self._require(zone, name)
        left = self._lingering.get((zone, name))
        if left is not None:
            if left <= 0:
                self._forget(zone, name)
                return 200, self._require(zone, name)  # raises the 404
            self._lingering[zone, name] = left - 1
        return 200, inst

    def _guest_attributes(
        self, *, zone: str, name: str, query: dict[str, list[str]], **_: Any
    ) -> tuple[int, Any]:
        """instances.getGuestAttributes with a `queryPath` of `<namespace>/[<key>]`.

        Nothing written under the path yet is a 404, which is how tools that
        wait on a guest attribute see "not yet" (GoogleCloudPlatform's
        compute-image-tools e2e helpers poll WaitForGuestAttributes through 404s).
        """
        self._require(zone, name)
        path = query.get("queryPath", [""])[0]
        if "variableKey" in query or "/" not in path:
            raise _invalid(f"Invalid value for field 'queryPath': '{path}'")
        written = self._guest.get((zone, name), {})
        items = [
            {"namespace": k.split("/", 1)[0], "key": k.split("/", 1)[1], "value": v}
            for k, v in sorted(written.items())
            if k == path or (path.endswith("/") and k.startswith(path))
        ]
        if not items:
            raise _not_found(
                f"projects/{self.project}/zones/{zone}/instances/{name}/guestAttributes/{path}"
            )
        return 200, {
            "kind": "compute#guestAttributes",
            "queryPath": path,
            "queryValue": {"items": items},
        }

    def _delete(
        self, *, zone: str, name: str, failure: ErrorKind | None, **_: Any
    ) -> tuple[int, Any]:
        inst = self._require(zone, name)
        if failure is None:
            inst["status"] = "STOPPING"

        def gone() -> None:
            self._forget(zone, name)

        return 200, self._new_operation(
            zone, "delete", f"zones/{zone}/instances/{name}", failure, gone
        )

    def _aggregated(self, *, query: dict[str, list[str]], **_: Any) -> tuple[int, Any]:
        matches = [
            (zone, inst)
            for zone, inst in self._filter(query.get("filter", [""])[0])
            if zone not in self._unreachable
        ]
        page_size = self.page_size or int(query.get("maxResults", ["500"])[0])
        start = int(query.get("pageToken", ["0"])[0])
        page = matches[start : start + page_size]
        items: dict[str, Any] = {}
        for zone, inst in page:
            items.setdefault(f"zones/{zone}", {"instances": []})["instances"].append(inst)
        if start == 0:
            for zone in self.zones:
                scope = _unreachable_scope(zone) if zone in self._unreachable else _no_results(zone)
                items.setdefault(f"zones/{zone}", scope)
        payload: dict[str, Any] = {
            "kind": "compute#instanceAggregatedList",
            "id": f"projects/{self.project}/aggregated/instances",
            "items": items,
        }
        if start == 0 and self._unreachable:
            payload["unreachables"] = [f"zones/{zone}" for zone in sorted(self._unreachable)]
        if start + page_size < len(matches):
            payload["nextPageToken"] = str(start + page_size)
        return 200, payload

    def _filter(self, expression: str) -> list[tuple[str, dict[str, Any]]]:
        selected = sorted(self._instances.items())
        if not expression:
            return [(zone, inst) for (zone, _), inst in selected]
        match = FILTER.match(expression)
        if match is None:
            raise _invalid(f"Invalid list filter expression '{expression}'")
        path, wanted = match["field"].split("."), match["value"]

        def value(inst: dict[str, Any]) -> Any:
            node: Any = inst
            for part in path:
                node = node.get(part) if isinstance(node, dict) else None
            return node

        return [(zone, inst) for (zone, _), inst in selected if value(inst) == wanted]

    def _store_instance(self, zone: str, body: dict[str, Any]) -> None:
        inst = json.loads(json.dumps(body))
        name = inst["name"]
        inst.update(
            kind="compute#instance",
            id=str(next(self._ids)),
            status="PROVISIONING",
            zone=f"{SELF_LINK_BASE}/projects/{self.project}/zones/{zone}",
            selfLink=f"{SELF_LINK_BASE}/projects/{self.project}/zones/{zone}/instances/{name}",
            creationTimestamp=datetime.now(UTC).isoformat(timespec="milliseconds"),
            machineType=f"{SELF_LINK_BASE}/projects/{self.project}/{inst['machineType']}",
            labelFingerprint="42WmSpB8rSM=",
        )
        inst.setdefault("metadata", {})["fingerprint"] = "fake-fp"
        for i, nic in enumerate(inst.get("networkInterfaces", [])):
            nic.update(name=f"nic{i}", networkIP=f"10.132.0.{next(self._ids) % 250 + 2}")
        self._instances[zone, name] = inst

    def _forget(self, zone: str, name: str) -> None:
        self._instances.pop((zone, name), None)
        self._lingering.pop((zone, name), None)
        self._guest.pop((zone, name), None)

    def _require(self, zone: str, name: str) -> dict[str, Any]:
        inst = self._instances.get((zone, name))
        if inst is None:
            raise _not_found(f"projects/{self.project}/zones/{zone}/instances/{name}")
        return inst

    # -- operations -----------------------------------------------------------

    def _new_operation(
        self,
        zone: str | None,
        op_type: str,
        target: str,
        failure: ErrorKind | None,
        on_done: Callable[[], None],
        on_failed: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        op = _Operation(
            name=f"operation-{next(self._ids)}-fake",
            zone=zone,
            op_type=op_type,
            target=target,
            error=failure,
            on_done=on_failed if failure else on_done,
            not_before=time.monotonic() + self._operation_seconds.get(zone, 0.0),
        )
        self._operations[op.name] = op
        return self._op_json(op)

    def _op_get(self, *, op: str, zone: str | None = None, **_: Any) -> tuple[int, Any]:
        return 200, self._op_json(self._poll(op, zone))

    def _op_wait(self, *, op: str, zone: str | None = None, **_: Any) -> tuple[int, Any]:
        operation = self._poll(op, zone)
        if operation.status != "DONE":
            # Like the real wait: hold the request until the operation is done,
            # or for a while (the real API holds up to two minutes).
            hold = WAIT_HOLD_SECONDS if self._paused else TIMED_WAIT_HOLD_SECONDS
            held_until = time.monotonic() + hold
            while operation.status != "DONE" and (left := held_until - time.monotonic()) > 0:
                # Not done although due means paused: wait to be resumed.
                until_done = operation.not_before - time.monotonic()
                self._cond.wait(left if until_done <= 0 else min(left, until_done))
                operation = self._poll(op, zone)
        return 200, self._op_json(operation)

    def _op_list(self, *, zone: str, query: dict[str, list[str]], **_: Any) -> tuple[int, Any]:
        """zoneOperations.list, one page, with a `field = "value"` filter on the operation."""
        listed = [self._op_json(op) for op in self._operations.values() if op.zone == zone]
        expression = query.get("filter", [""])[0]
        if expression:
            match = FILTER.match(expression)
            if match is None:
                raise _invalid(f"Invalid list filter expression '{expression}'")
            listed = [op for op in listed if op.get(match["field"]) == match["value"]]
        base = f"{SELF_LINK_BASE}/projects/{self.project}/zones/{zone}"
        return 200, {
            "kind": "compute#operationList",
            "id": f"{base}/operations",
            "items": listed,
            "selfLink": f"{base}/operations",
        }

    def _poll(self, name: str, zone: str | None) -> _Operation:
        op = self._operations.get(name)
        if op is None or op.zone != zone:
            scope = f"zones/{zone}" if zone else "global"
            raise _not_found(f"projects/{self.project}/{scope}/operations/{name}")
        if op.status != "DONE" and not self._paused and time.monotonic() >= op.not_before:
            op.status = "DONE"
            if op.on_done is not None:
                op.on_done()
        return op

    def _op_json(self, op: _Operation) -> dict[str, Any]:
        scope = f"zones/{op.zone}" if op.zone else "global"
        base = f"{SELF_LINK_BASE}/projects/{self.project}"
        payload: dict[str, Any] = {
            "kind": "compute#operation",
            "id": op.name.split("-")[1],
            "name": op.name,
            "operationType": op.op_type,
            "targetLink": f"{base}/{op.target}",
            "selfLink": f"{base}/{scope}/operations/{op.name}",
            "status": op.status,
            "progress": 100 if op.status == "DONE" else 0,
            "insertTime": op.insert_time,
        }
        if op.status_message:
            payload["statusMessage"] = op.status_message
        if op.zone:
            payload["zone"] = f"{base}/zones/{op.zone}"
        if op.status == "DONE" and op.error is not None:
            payload["error"] = {"errors": [{"code": op.error.reason, "message": op.error.message}]}
            payload["httpErrorStatusCode"] = op.error.status
            payload["httpErrorMessage"] = _HTTP_MESSAGES.get(op.error.status, "ERROR")
        return payload

    # -- firewalls --------------------------------------------------------------

    def _fw_get(self, *, name: str, **_: Any) -> tuple[int, Any]:
        found = self._firewalls.get(name)
        if found is None:
            raise _not_found(f"projects/{self.project}/global/firewalls/{name}")
        return 200, found

    def _fw_insert(
        self, *, body: dict[str, Any] | None, failure: ErrorKind | None, **_: Any
    ) -> tuple[int, Any]:
        rule = self._complete_firewall(body or {})
        name = rule["name"]
        if name in self._firewalls:
            raise ApiError(
                ErrorKind(
                    409,
                    "alreadyExists",
                    f"The resource 'projects/{self.project}/global/firewalls/{name}' "
                    "already exists",
                )
            )

        def store() -> None:
            self._firewalls[name] = rule

        return 200, self._new_operation(None, "insert", f"global/firewalls/{name}", failure, store)

    def _fw_update(
        self, *, name: str, body: dict[str, Any] | None, failure: ErrorKind | None, **_: Any
    ) -> tuple[int, Any]:
        _, current = self._fw_get(name=name)
        rule = self._complete_firewall(body or {})
        if rule["name"] != name:
            raise _invalid("Invalid value for field 'resource.name'")
        if rule["network"] != current["network"]:
            # A rule belongs to one network for life; firewall names are unique
            # per project, not per network (firewall/docs/using-firewalls:
            # "the name you choose for each of them must be unique to the project").
            raise _invalid(
                f"Invalid value for field 'resource.network': '{rule['network']}'. "
                "The network of a firewall rule cannot be changed."
            )

        racer = self._racing_writers.pop(name, None)

        def store() -> None:
            self._firewalls[name] = rule
            if racer is not None:
                # The other writer's PUT, made from the rule as both read it.
                theirs = json.loads(json.dumps(current))
                tcp = [a for a in theirs.get("allowed", []) if a.get("IPProtocol") == "tcp"]
                tcp[0].setdefault("ports", []).append(str(racer))
                self._firewalls[name] = theirs

        return 200, self._new_operation(None, "update", f"global/firewalls/{name}", failure, store)

    def _complete_firewall(self, body: dict[str, Any]) -> dict[str, Any]:
        """Validate a rule and fill in what the API defaults, as it would."""
        rule: dict[str, Any] = json.loads(json.dumps(body))
        if not RFC1035.match(rule.get("name", "")):
            raise _invalid(f"Invalid value for field 'resource.name': '{rule.get('name')}'")
        families = set()
        for cidr in rule.get("sourceRanges", []):
            try:
                families.add(ipaddress.ip_network(cidr).version)
            except ValueError:
                raise _invalid(
                    f"Invalid value for field 'resource.sourceRanges': '{cidr}'"
                ) from None
        if len(families) > 1:
            # "A firewall rule can contain either IPv4 or IPv6 ranges, but not
            # both" (https://cloud.google.com/firewall/docs/using-firewalls).
            raise _invalid(
                "Invalid value for field 'resource.sourceRanges': IPv4 and IPv6 "
                "ranges cannot be combined in one firewall rule"
            )
        for allowed in rule.get("allowed", []):
            if allowed.get("IPProtocol") not in ("tcp", "udp", "icmp", "all"):
                raise _invalid("Invalid value for field 'resource.allowed[].IPProtocol'")
        rule.setdefault("direction", "INGRESS")
        rule.setdefault("priority", 1000)
        rule.setdefault("network", "global/networks/default")
        if (
            rule["direction"] == "INGRESS"
            and not rule.get("sourceRanges")
            and not rule.get("sourceTags")
        ):
            rule["sourceRanges"] = ["0.0.0.0/0"]  # the API's default: everyone
        if not rule["network"].startswith("https://"):
            rule["network"] = f"{SELF_LINK_BASE}/projects/{self.project}/{rule['network']}"
        rule.update(
            kind="compute#firewall",
            selfLink=f"{SELF_LINK_BASE}/projects/{self.project}/global/firewalls/{rule['name']}",
        )
        rule.setdefault("id", str(next(self._ids)))
        return rule


_HTTP_MESSAGES = {403: "FORBIDDEN", 404: "NOT FOUND", 409: "CONFLICT", 503: "SERVICE UNAVAILABLE"}


def _error_body(kind: ErrorKind) -> dict[str, Any]:
    return {
        "error": {
            "code": kind.status,
            "message": kind.message,
            "errors": [{"message": kind.message, "domain": "global", "reason": kind.reason}],
        }
    }


def _scope_warning(zone: str, code: str, message: str) -> dict[str, Any]:
    """A scope of an aggregated list that carries a warning instead of instances."""
    scope = f"zones/{zone}"
    return {
        "warning": {"code": code, "message": message, "data": [{"key": "scope", "value": scope}]}
    }


def _unreachable_scope(zone: str) -> dict[str, Any]:
    return _scope_warning(zone, "UNREACHABLE", f"Scope 'zones/{zone}' is unreachable.")


def _no_results(zone: str) -> dict[str, Any]:
    return _scope_warning(
        zone,
        "NO_RESULTS_ON_PAGE",
        f"There are no results for scope 'zones/{zone}' on this page.",
    )


def _validate_labels(field_name: str, labels: dict[str, str]) -> None:
    """Label rules are the same on instances and disks (resource-manager/docs/labels)."""
    if len(labels) > 64:
        raise _invalid(f"Invalid value for field '{field_name}': at most 64 labels")
    for key, value in labels.items():
        if not LABEL_KEY.match(key) or not LABEL_VALUE.match(value):
            raise _invalid(f"Invalid value for field '{field_name}': '{key}': '{value}'")


def _validate_instance(zone: str, body: dict[str, Any]) -> None:
    """Reject what Compute Engine would reject in the fields this project sends."""
    name = body.get("name", "")
    if not RFC1035.match(name):
        raise _invalid(f"Invalid value for field 'resource.name': '{name}'")
    machine_type = body.get("machineType", "")
    if not re.fullmatch(rf"(.*/)?zones/{re.escape(zone)}/machineTypes/[a-z0-9-]+", machine_type):
        raise _invalid(f"Invalid value for field 'resource.machineType': '{machine_type}'")
    _validate_labels("resource.labels", body.get("labels", {}))
    for i, disk in enumerate(body.get("disks", [])):
        params = disk.get("initializeParams", {})
        _validate_labels(f"resource.disks[{i}].initializeParams.labels", params.get("labels", {}))
    items = body.get("metadata", {}).get("items", [])
    keys = [item.get("key", "") for item in items]
    if len(set(keys)) != len(keys) or not all(METADATA_KEY.match(k) for k in keys):
        raise _invalid(f"Invalid value for field 'resource.metadata': keys {keys}")
    sizes = [len(k) + len(item.get("value", "")) for k, item in zip(keys, items, strict=True)]
    if any(size > METADATA_VALUE_MAX for size in sizes) or sum(sizes) > METADATA_TOTAL_MAX:
        raise _invalid("Value for field 'resource.metadata' is too large")
    for tag in body.get("tags", {}).get("items", []):
        if not RFC1035.match(tag):
            raise _invalid(f"Invalid value for field 'resource.tags.items': '{tag}'")
    boot = [d for d in body.get("disks", []) if d.get("boot")]
    if len(boot) != 1 or not boot[0].get("initializeParams", {}).get("sourceImage"):
        raise _invalid("Exactly one boot disk with initializeParams.sourceImage is required")
    if not body.get("networkInterfaces"):
        raise _invalid("At least one network interface is required")
    region = zone.rsplit("-", 1)[0]
    for i, nic in enumerate(body["networkInterfaces"]):
        # A subnetwork is regional: an interface can use one in its zone's region only.
        subnet = re.search(r"regions/([^/]+)/subnetworks/", nic.get("subnetwork", ""))
        if subnet is not None and subnet[1] != region:
            raise _invalid(
                f"Invalid value for field 'resource.networkInterfaces[{i}].subnetwork': "
                f"'{nic['subnetwork']}'. Subnetwork should belong to region '{region}'"
            )
    scheduling = body.get("scheduling", {})
    if scheduling.get("provisioningModel") == "SPOT" and (
        scheduling.get("automaticRestart", True)
        or scheduling.get("onHostMaintenance") != "TERMINATE"
        or scheduling.get("instanceTerminationAction") not in ("STOP", "DELETE")
    ):
        raise _invalid(
            "Spot VMs need automaticRestart false, onHostMaintenance TERMINATE "
            "and an instanceTerminationAction"
        )


@pytest.fixture(name="fake_compute")
def fake_compute_fixture() -> Iterator[FakeCompute]:
    """A started FakeCompute, stopped after the test."""
    with FakeCompute() as fake:
        yield fake


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve the fake Compute Engine API.")
    parser.add_argument("--port", type=int, default=8089)
    parser.add_argument("--project", default=DEFAULT_PROJECT)
    parser.add_argument("--zones", default=",".join(DEFAULT_ZONES))
    parser.add_argument("--auto-start-ip", default=None)
    args = parser.parse_args()
    fake = FakeCompute(args.project, tuple(args.zones.split(",")), auto_start_ip=args.auto_start_ip)
    fake.start(args.port)
    print(f"fake Compute Engine for project {args.project} at {fake.url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        fake.stop()


if __name__ == "__main__":
    main()
