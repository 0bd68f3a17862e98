"""Compute Engine VMs running Squid, one per proxy (provider type `gcp`).

Each proxy is a small VM (e2-micro by default) with an ephemeral external IP. Squid is
installed and configured by a startup script carried in the instance metadata,
rendered by providers.squid like every other provider's config. One firewall
rule per installation opens the proxy port to `allowed_cidrs` only, for VMs
carrying the installation's network tag.

Design choices, and why:

- Credentials come from Application Default Credentials (`from_config`), never
  from the YAML; tests inject clients pointed at a fake server instead.
- Writes use the `*_unary` client methods and wait through the injected
  operations clients. The SDK's ExtendedOperation would poll through a hidden
  operations client of its own, which neither the tests nor the operation
  deadline of this module control.
- The SDK's built-in retries (up to 10 minutes on 503) are switched off on
  every call: Temporal's activity retry policy is the one retry layer, derived
  from the error taxonomy.
- Labels select instances server-side (`list_by_tag`), but GCP label values are
  short and restricted, so the exact tags live in a JSON metadata item as well
  and `Instance.tags` always round-trips what `create` was given.
- Errors are translated once, at the edge (`_normalise`), from the API's HTTP
  status and error reasons, or from the error codes of a failed operation.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Annotated, cast

import google.auth
from google.api_core import exceptions as api_exceptions
from google.cloud import compute_v1
from pydantic import Field

from providers.base import CreateRequest, Instance, InstanceState
from providers.catalog import ProviderType
from providers.config import Config, ProviderEntry, StrictModel
from providers.errors import NotFound, Permanent, ProviderError, QuotaExceeded, Transient, classify
from providers.naming import HASHED_IN_LABELS, RFC1035_LABEL, short_hash
from providers.squid import SQUID_USER, ProxySettings, SquidPaths, render


class GcpConfig(StrictModel):
    """Compute Engine VMs with public IPs; credentials come from ADC only."""

    project: str
    zone: str
    zones: list[str] = Field(default_factory=list)
    machine_type: str = "e2-micro"
    image_project: str = "debian-cloud"
    image_family: str = "debian-12"
    spot: bool = False
    network: str = "global/networks/default"
    subnetwork: str | None = None
    # The network tag the installation's firewall rule targets. The default,
    # `proxy-operator-<installation>`, keeps two installations sharing a network
    # from opening each other's VMs to their own allowed_cidrs.
    network_tag: Annotated[str, Field(pattern=r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")] | None = None


PROVIDER_TYPE = ProviderType(
    name="gcp",
    settings=GcpConfig,
    placement_keys=frozenset({"zone"}),
    build=lambda entry, config: GcpProvider.from_config(entry, config),
)
log = logging.getLogger(__name__)

COMPUTE_SCOPE = "https://www.googleapis.com/auth/compute"

# Metadata keys this provider owns on every instance.
TAGS_METADATA_KEY = "proxy-operator-tags"
PORT_METADATA_KEY = "proxy-operator-port"
STARTUP_SCRIPT_KEY = "startup-script"

FIREWALL_PREFIX = "proxy-operator-"
SQUID_CONF = "/etc/squid/squid.conf"

# One API call, not counting operation waits; a hung connection must not
# outlive the activity that made it.
CALL_TIMEOUT_SECONDS = 60.0
# Default bound on a whole create or delete, operation waits included. Well
# under the create/delete activities' start-to-close timeouts (10 minutes).
OPERATION_TIMEOUT_SECONDS = 240.0
# `wait` may return before the operation is done, in the worst case at once;
# this keeps a loop of such answers from hammering the API's rate quota.
MIN_WAIT_INTERVAL_SECONDS = 1.0

# GCE instance status -> common state (Libcloud style). RUNNING is only
# reported once the VM has an external IP; see `_to_instance`.
INSTANCE_STATES: dict[str, InstanceState] = {
    "PENDING": InstanceState.PROVISIONING,
    "PROVISIONING": InstanceState.PROVISIONING,
    "STAGING": InstanceState.PROVISIONING,
    "RUNNING": InstanceState.RUNNING,
    "PENDING_STOP": InstanceState.STOPPED,
    "STOPPING": InstanceState.STOPPED,
    "STOPPED": InstanceState.STOPPED,
    "SUSPENDING": InstanceState.STOPPED,
    "SUSPENDED": InstanceState.STOPPED,
    "REPAIRING": InstanceState.STOPPED,
    "TERMINATED": InstanceState.STOPPED,
    "DEPROVISIONING": InstanceState.STOPPED,
}
# A status newer than this table is not usable yet, but not proof of death
# either: PROVISIONING lets the workflow's provisioning deadline decide.
_UNKNOWN_STATE = InstanceState.PROVISIONING

# Error reasons (REST `errors[].reason`, ErrorInfo reason, or an operation's
# error code), compared without case and underscores: the REST API says
# `quotaExceeded` where an operation says `QUOTA_EXCEEDED`.
_STOCKOUT_REASONS = frozenset({"zoneresourcepoolexhausted", "zoneresourcepoolexhaustedwithdetails"})
_QUOTA_REASONS = _STOCKOUT_REASONS | {
    "quotaexceeded",
    "ratelimitexceeded",
    "userratelimitexceeded",
}
# "The resource ... is not ready": another operation on it is still running.
_RETRYABLE_REASONS = frozenset({"resourcenotready"})
# Client errors that a later attempt can get past.
_RETRYABLE_STATUS = frozenset({408, 409, 412, 429})

_LABEL_MAX = 63
_LABEL_KEY_START = re.compile(r"^[a-z]")
_LABEL_KEY_INVALID = re.compile(r"[^a-z0-9_-]")
_LABEL_VALUE = re.compile(r"^[a-z0-9_-]{0,63}$")

_CONF_EOF = "PROXY_OPERATOR_SQUID_CONF"
_HTPASSWD_EOF = "PROXY_OPERATOR_HTPASSWD"


class GcpProvider:
    """The provider contract on Compute Engine; `provider_id` is `<zone>/<name>`."""

    def __init__(
        self,
        settings: GcpConfig,
        installation: str,
        *,
        instances: compute_v1.InstancesClient,
        operations: compute_v1.ZoneOperationsClient,
        firewalls: compute_v1.FirewallsClient,
        global_operations: compute_v1.GlobalOperationsClient,
        operation_timeout: float = OPERATION_TIMEOUT_SECONDS,
    ) -> None:
        self._settings = settings
        self._project = settings.project
        self._firewall_name = firewall_name(installation)
        self._network_tag = settings.network_tag or self._firewall_name
        self._instances = instances
        self._operations = operations
        self._firewalls = firewalls
        self._global_operations = global_operations
        self._operation_timeout = operation_timeout
        # (port, allowed CIDRs) pairs the firewall rule is known to admit. The
        # rule is checked once per pair and provider object, not per create.
        self._firewall_ensured: set[tuple[int, tuple[str, ...]]] = set()
        self._firewall_lock = threading.Lock()

    @classmethod
    def from_config(cls, entry: ProviderEntry, config: Config) -> GcpProvider:
        """Real clients on Application Default Credentials; never used by tests."""
        settings = PROVIDER_TYPE.settings_of(entry)
        credentials, _ = google.auth.default(scopes=[COMPUTE_SCOPE])
        return cls(
            settings,
            config.installation,
            instances=compute_v1.InstancesClient(credentials=credentials),
            operations=compute_v1.ZoneOperationsClient(credentials=credentials),
            firewalls=compute_v1.FirewallsClient(credentials=credentials),
            global_operations=compute_v1.GlobalOperationsClient(credentials=credentials),
        )

    # -- the contract -------------------------------------------------------

    def create(self, req: CreateRequest) -> Instance:
        """Create the VM (or adopt it), trying fallback zones on a stockout.

        The firewall rule's port and CIDRs come from `req.proxy`, the same
        settings Squid is rendered from, so the two can never disagree and a
        proxy whose port the workflow overrides is still reachable.
        """
        deadline = time.monotonic() + self._operation_timeout
        with _edge():
            self._ensure_firewall(req.proxy, deadline)
            pinned = req.placement.get("zone")
            zones = [pinned] if pinned else self._candidate_zones()
            if len(zones) > 1:
                # A retried create may find its VM in a fallback zone that an
                # earlier attempt reached; inserting into the first zone again
                # would run a second VM under the same name.
                existing = self._find_by_name(req.name)
                if existing is not None:
                    return existing
            for zone in zones[:-1]:
                try:
                    return self._create_in_zone(req, zone, deadline)
                except api_exceptions.GoogleAPICallError as exc:
                    if not _reasons(exc) & _STOCKOUT_REASONS:
                        raise
                    log.info("zone %s has no capacity for %s, trying the next zone", zone, req.name)
            return self._create_in_zone(req, zones[-1], deadline)

    def get(self, provider_id: str) -> Instance:
        zone, name = _parse_provider_id(provider_id)
        with _edge():
            return self._fetch(zone, name)

    def delete(self, provider_id: str) -> None:
        """Delete and wait for the operation; an instance already gone is success."""
        zone, name = _parse_provider_id(provider_id)
        deadline = time.monotonic() + self._operation_timeout
        with _edge(), contextlib.suppress(api_exceptions.NotFound):
            op = self._instances.delete_unary(
                project=self._project,
                zone=zone,
                instance=name,
                retry=None,
                timeout=CALL_TIMEOUT_SECONDS,
            )
            self._wait(op, deadline, self._zone_waiter(zone))

    def list_by_tag(self, key: str, value: str) -> list[Instance]:
        """Select by label in every zone of the project, then match the exact tags."""
        with _edge():
            found = self._aggregated(f'labels.{label_key(key)} = "{label_value(key, value)}"')
        # A hashed or sanitised label can collide; the metadata copy cannot.
        return [inst for inst in found if inst.tags.get(key) == value]

    # -- instances ----------------------------------------------------------

    def _candidate_zones(self) -> list[str]:
        return list(dict.fromkeys([self._settings.zone, *self._settings.zones]))

    def _create_in_zone(self, req: CreateRequest, zone: str, deadline: float) -> Instance:
        try:
            op = self._instances.insert_unary(
                project=self._project,
                zone=zone,
                instance_resource=self._instance_resource(req, zone),
                retry=None,
                timeout=CALL_TIMEOUT_SECONDS,
            )
            self._wait(op, deadline, self._zone_waiter(zone))
        except api_exceptions.Conflict:
            pass  # already exists: a retried create, adopt it below
        except api_exceptions.NotFound as exc:
            # On insert, a 404 names what the request refers to (image family,
            # zone, network), never the instance: a config error, not a lost VM.
            raise _normalise(exc, missing=Permanent) from exc
        return self._fetch(zone, req.name)

    def _instance_resource(self, req: CreateRequest, zone: str) -> compute_v1.Instance:
        s = self._settings
        interface = compute_v1.NetworkInterface(
            network=s.network,
            access_configs=[compute_v1.AccessConfig(name="external-nat", type_="ONE_TO_ONE_NAT")],
        )
        if s.subnetwork:
            interface.subnetwork = s.subnetwork
        metadata = {
            TAGS_METADATA_KEY: json.dumps(req.tags, sort_keys=True),
            PORT_METADATA_KEY: str(req.proxy.port),
            STARTUP_SCRIPT_KEY: startup_script(req.proxy),
        }
        instance = compute_v1.Instance(
            name=req.name,
            machine_type=f"zones/{zone}/machineTypes/{s.machine_type}",
            labels=labels(req.tags),
            tags=compute_v1.Tags(items=[self._network_tag]),
            metadata=compute_v1.Metadata(
                items=[compute_v1.Items(key=k, value=v) for k, v in metadata.items()]
            ),
            disks=[
                compute_v1.AttachedDisk(
                    boot=True,
                    auto_delete=True,
                    initialize_params=compute_v1.AttachedDiskInitializeParams(
                        source_image=f"projects/{s.image_project}/global/images/family/{s.image_family}"
                    ),
                )
            ],
            network_interfaces=[interface],
            # No service account: a proxy VM needs no Google API access, so a
            # compromised one has no credentials to steal.
        )
        if s.spot:
            # Deleted, not stopped, on preemption: a stopped VM still bills its
            # disk, and the workflow replaces a vanished instance anyway.
            instance.scheduling = compute_v1.Scheduling(
                provisioning_model="SPOT",
                instance_termination_action="DELETE",
                automatic_restart=False,
                on_host_maintenance="TERMINATE",
            )
        return instance

    def _fetch(self, zone: str, name: str) -> Instance:
        gce = self._instances.get(
            project=self._project,
            zone=zone,
            instance=name,
            retry=None,
            timeout=CALL_TIMEOUT_SECONDS,
        )
        return _to_instance(gce)

    def _find_by_name(self, name: str) -> Instance | None:
        return next(iter(self._aggregated(f'name = "{name}"')), None)

    def _aggregated(self, filter_: str) -> list[Instance]:
        pages = self._instances.aggregated_list(
            request=compute_v1.AggregatedListInstancesRequest(
                project=self._project, filter=filter_
            ),
            retry=None,
            timeout=CALL_TIMEOUT_SECONDS,
        )
        return [_to_instance(gce) for _, scoped in pages for gce in scoped.instances]

    # -- firewall -----------------------------------------------------------

    def _ensure_firewall(self, proxy: ProxySettings, deadline: float) -> None:
        """Make the installation's rule admit `proxy`'s port from its CIDRs only.

        Get, then insert if missing (a 409 from a racing worker is fine) or
        replace it if it differs: the rule belongs to the installation, so a
        widened source range or port list is put back. Ports of earlier
        proxies are kept, since running VMs may still listen on them.
        """
        if not proxy.allowed_cidrs:
            # An ingress rule without source ranges admits 0.0.0.0/0.
            raise Permanent("allowed_cidrs is empty: refusing to open the proxy port to everyone")
        key = (proxy.port, tuple(sorted(proxy.allowed_cidrs)))
        with self._firewall_lock:
            if key in self._firewall_ensured:
                return
            existing = self._get_firewall()
            if existing is None:
                try:
                    op = self._firewalls.insert_unary(
                        project=self._project,
                        firewall_resource=self._firewall_rule({proxy.port}, key[1]),
                        retry=None,
                        timeout=CALL_TIMEOUT_SECONDS,
                    )
                    self._wait(op, deadline, self._global_waiter)
                except api_exceptions.Conflict:
                    existing = self._get_firewall()
            if existing is not None:
                wanted = self._firewall_rule(_tcp_ports(existing) | {proxy.port}, key[1])
                if _rule_shape(existing) != _rule_shape(wanted):
                    op = self._firewalls.update_unary(
                        project=self._project,
                        firewall=self._firewall_name,
                        firewall_resource=wanted,
                        retry=None,
                        timeout=CALL_TIMEOUT_SECONDS,
                    )
                    self._wait(op, deadline, self._global_waiter)
            self._firewall_ensured.add(key)

    def _get_firewall(self) -> compute_v1.Firewall | None:
        try:
            return self._firewalls.get(
                project=self._project,
                firewall=self._firewall_name,
                retry=None,
                timeout=CALL_TIMEOUT_SECONDS,
            )
        except api_exceptions.NotFound:
            return None

    def _firewall_rule(self, ports: set[int], cidrs: tuple[str, ...]) -> compute_v1.Firewall:
        return compute_v1.Firewall(
            name=self._firewall_name,
            description="proxy-operator: the proxy port, from allowed_cidrs only",
            network=self._settings.network,
            direction="INGRESS",
            allowed=[compute_v1.Allowed(I_p_protocol="tcp", ports=[str(p) for p in sorted(ports)])],
            source_ranges=list(cidrs),
            target_tags=[self._network_tag],
            disabled=False,
        )

    # -- operations ---------------------------------------------------------

    def _zone_waiter(self, zone: str) -> Callable[[str, float], compute_v1.Operation]:
        def wait(name: str, timeout: float) -> compute_v1.Operation:
            return self._operations.wait(
                project=self._project, zone=zone, operation=name, retry=None, timeout=timeout
            )

        return wait

    def _global_waiter(self, name: str, timeout: float) -> compute_v1.Operation:
        return self._global_operations.wait(
            project=self._project, operation=name, retry=None, timeout=timeout
        )

    def _wait(
        self,
        op: compute_v1.Operation,
        deadline: float,
        wait: Callable[[str, float], compute_v1.Operation],
    ) -> None:
        """Wait until `op` is DONE or `deadline` passes; raise its error if it failed.

        A timeout is Transient: the retried call adopts the instance (409) or
        finds it gone (404), so nothing is lost by giving up here.
        """
        while op.status != compute_v1.Operation.Status.DONE:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                status = compute_v1.Operation.Status(op.status).name
                raise Transient(
                    f"Compute Engine operation {op.name} still {status} "
                    f"after {self._operation_timeout:g}s"
                )
            op = wait(op.name, remaining)
            if op.status != compute_v1.Operation.Status.DONE:
                time.sleep(max(0.0, min(MIN_WAIT_INTERVAL_SECONDS, deadline - time.monotonic())))
        if op.error.errors:
            raise _operation_error(op)


# -- instances <-> the contract ---------------------------------------------


def _to_instance(gce: compute_v1.Instance) -> Instance:
    metadata = {item.key: item.value for item in gce.metadata.items}
    ip = next(
        (ac.nat_i_p for nic in gce.network_interfaces for ac in nic.access_configs if ac.nat_i_p),
        "",
    )
    state = INSTANCE_STATES.get(gce.status, _UNKNOWN_STATE)
    if state is InstanceState.RUNNING and not ip:
        state = InstanceState.PROVISIONING  # never publish an empty endpoint
    zone = gce.zone.rsplit("/", 1)[-1]
    return Instance(
        provider_id=f"{zone}/{gce.name}",
        name=gce.name,
        state=state,
        ip=ip if state is InstanceState.RUNNING else "",
        port=int(metadata.get(PORT_METADATA_KEY, "0")),
        tags=_tags(metadata),
        created_at=datetime.fromisoformat(gce.creation_timestamp),
    )


def _tags(metadata: dict[str, str]) -> dict[str, str]:
    """The exact tags from metadata; none for a VM this provider did not make.

    Labels are not a fallback: they hold hashes and sanitised keys, and a VM
    that merely copies our labels must not look like ours to orphan GC.
    """
    with contextlib.suppress(ValueError):
        parsed = json.loads(metadata.get(TAGS_METADATA_KEY, ""))
        if isinstance(parsed, dict):
            return {str(k): str(v) for k, v in parsed.items()}
    return {}


def _parse_provider_id(provider_id: str) -> tuple[str, str]:
    zone, _, name = provider_id.partition("/")
    if not (RFC1035_LABEL.fullmatch(zone) and RFC1035_LABEL.fullmatch(name)):
        raise Permanent(f"malformed GCP provider_id {provider_id!r}: expected <zone>/<name>")
    return zone, name


def labels(tags: dict[str, str]) -> dict[str, str]:
    """GCP labels for `tags`: what `list_by_tag` filters on server-side."""
    return {label_key(k): label_value(k, v) for k, v in tags.items()}


def label_key(key: str) -> str:
    """A tag key as a label key: lowercase, `/` and other invalid characters as `_`.

    `proxy-operator/installation` becomes `proxy-operator_installation`. A key
    too long after that keeps a readable prefix and a hash of the original.
    """
    sanitised = _LABEL_KEY_INVALID.sub("_", key.lower())
    if not _LABEL_KEY_START.match(sanitised):
        sanitised = f"k_{sanitised}"
    if len(sanitised) > _LABEL_MAX:
        suffix = short_hash(key)
        sanitised = f"{sanitised[: _LABEL_MAX - len(suffix) - 1]}_{suffix}"
    return sanitised


def label_value(key: str, value: str) -> str:
    """A tag value as a label value: itself when valid, else its short hash.

    The owner (a user-chosen workflow id) and the Temporal namespace are
    always hashed (HASHED_IN_LABELS), so their labels have one predictable
    form and no free text reaches labels, which billing exports copy. The
    exact value is in the instance metadata.
    """
    if key not in HASHED_IN_LABELS and _LABEL_VALUE.fullmatch(value):
        return value
    return short_hash(value)


def firewall_name(installation: str) -> str:
    """`proxy-operator-<installation>`, shortened with a hash past 63 characters."""
    name = f"{FIREWALL_PREFIX}{installation}"
    if len(name) <= _LABEL_MAX:
        return name
    suffix = short_hash(installation)
    return f"{name[: _LABEL_MAX - len(suffix) - 1]}-{suffix}"


def startup_script(proxy: ProxySettings) -> str:
    """A boot script that installs Squid and writes its config and htpasswd.

    It runs as root on every boot, so a VM that restarts comes back with the
    config in its metadata. The htpasswd is created group-readable by Squid's
    user only, before the hash is written into it.
    """
    paths = SquidPaths()
    rendered = render(proxy, paths)
    squid_conf = rendered.squid_conf.rstrip("\n")
    htpasswd = rendered.htpasswd.rstrip("\n")
    return f"""#!/bin/bash
# proxy-operator: install and configure Squid. Runs on every boot; idempotent.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
if ! command -v squid >/dev/null 2>&1; then
  for attempt in 1 2 3 4 5; do
    if apt-get update -q && apt-get install -y -q --no-install-recommends squid; then
      break
    fi
    if [ "$attempt" -eq 5 ]; then exit 1; fi
    sleep 10
  done
fi
install -d -m 0755 /etc/squid
cat > {SQUID_CONF} <<'{_CONF_EOF}'
{squid_conf}
{_CONF_EOF}
install -m 0640 -o root -g {SQUID_USER} /dev/null {paths.htpasswd}
cat > {paths.htpasswd} <<'{_HTPASSWD_EOF}'
{htpasswd}
{_HTPASSWD_EOF}
squid -k parse -f {SQUID_CONF}
systemctl enable squid
systemctl restart squid
"""


# -- firewall helpers --------------------------------------------------------


def _tcp_ports(rule: compute_v1.Firewall) -> set[int]:
    """Single TCP ports a rule allows; ranges and other protocols are not ours."""
    return {
        int(port)
        for allowed in rule.allowed
        if allowed.I_p_protocol == "tcp"
        for port in allowed.ports
        if port.isdigit()
    }


def _rule_shape(rule: compute_v1.Firewall) -> tuple[object, ...]:
    """What decides who can reach the proxies; differences here trigger a replace."""
    return (
        rule.direction,
        rule.disabled,
        sorted(rule.source_ranges),
        sorted(rule.source_tags),
        sorted(rule.source_service_accounts),
        sorted(rule.target_tags),
        sorted(rule.target_service_accounts),
        sorted((a.I_p_protocol, tuple(sorted(a.ports))) for a in rule.allowed),
        len(rule.denied),
    )


# -- errors at the edge ------------------------------------------------------


@contextlib.contextmanager
def _edge() -> Iterator[None]:
    """Every public operation runs in here: nothing but the taxonomy escapes."""
    try:
        yield
    except Exception as exc:
        error = _normalise(exc)
        if error is exc:
            raise
        raise error from exc


def _normalise(exc: BaseException, *, missing: type[ProviderError] = NotFound) -> ProviderError:
    """The one translation of Compute Engine failures into the taxonomy.

    Reasons beat status codes: Compute Engine reports quota and rate limits
    as 403, which alone would read as permission denied. `missing` is what a
    404 means to the caller (NotFound, or Permanent on insert).
    """
    if not isinstance(exc, api_exceptions.GoogleAPICallError):
        return classify(exc)  # connection errors, timeouts, unknowns: Transient
    reasons = _reasons(exc)
    code = exc.code or 0
    kind: type[ProviderError]
    if reasons & _QUOTA_REASONS:
        kind = QuotaExceeded
    elif reasons & _RETRYABLE_REASONS:
        kind = Transient
    elif code == 404:
        kind = missing
    elif code in _RETRYABLE_STATUS or not 400 <= code < 500:
        kind = Transient
    else:
        kind = Permanent  # bad request, permission denied, invalid image or machine type
    return kind(f"Compute Engine: {exc}", cause=exc, retry_after_seconds=_retry_after(exc))


def _reasons(exc: api_exceptions.GoogleAPICallError) -> set[str]:
    found = [e.get("reason") for e in exc.errors if isinstance(e, dict)]
    found.append(exc.reason)
    return {r.replace("_", "").lower() for r in found if isinstance(r, str)}


def _retry_after(exc: api_exceptions.GoogleAPICallError) -> float | None:
    headers = getattr(exc.response, "headers", None)
    value = headers.get("Retry-After") if headers is not None else None
    return float(value) if isinstance(value, str) and value.isdigit() else None


def _operation_error(op: compute_v1.Operation) -> api_exceptions.GoogleAPICallError:
    """A failed operation as the API error the same failure would be if synchronous.

    Its error codes become the reasons and its HTTP status the class, so
    `_normalise` (and the stockout check in `create`) read both alike.
    """
    errors = [{"reason": e.code, "message": e.message} for e in op.error.errors]
    message = "; ".join(f"{e.code}: {e.message}" for e in op.error.errors)
    error = api_exceptions.from_http_status(  # type: ignore[no-untyped-call]  # untyped in api_core
        op.http_error_status_code, f"operation {op.name} failed: {message}", errors=errors
    )
    return cast(api_exceptions.GoogleAPICallError, error)
