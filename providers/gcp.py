"""Compute Engine VMs running Squid, one per proxy (provider type `gcp`).

Each proxy is a small VM (e2-micro by default) with an ephemeral external IP. Squid is
installed and configured by a startup script carried in the instance metadata,
rendered by providers.squid like every other provider's config. One firewall
rule per installation opens the proxy port to `allowed_cidrs` only, for VMs
carrying the installation's network tag.

Compute Engine calls a VM RUNNING as soon as it boots, minutes before its
startup script has installed Squid. The script reports its progress in a
guest attribute (written through the metadata server, so the VM needs no
service account), and `get` says RUNNING only once it reads "ready" there,
or TERMINATED with the script's reason if it reports a failure.

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
- The provider acts only on its own: `delete` reads the instance's tags first
  and a `create` that meets an existing instance adopts it only when owner,
  installation, generation (and namespace, when tagged) match
  (providers.naming.ownership_mismatch).
- An instance is looked up by name with one `instances.get` per candidate
  zone, not an aggregated list (which costs list quota and is incomplete
  whenever a zone is unreachable). A twin that an earlier attempt left in a
  zone no longer configured is deleted once a create has its VM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Annotated, cast

import google.auth
from google.api_core import exceptions as api_exceptions
from google.cloud import compute_v1
from pydantic import Field, model_validator

from providers.base import CreateRequest, Instance, InstanceState, state_table
from providers.catalog import ProviderType
from providers.config import Config, ProviderEntry, ProviderSettings
from providers.errors import NotFound, Permanent, ProviderError, QuotaExceeded, Transient, classify
from providers.naming import (
    HASHED_IN_LABELS,
    INSTALLATION_KEY,
    RFC1035_LABEL,
    adoption_mismatch,
    ownership_mismatch,
    short_hash,
)
from providers.squid import SQUID_USER, ProxySettings, SquidPaths, render

# Compute Engine resource names (RFC 1035 labels), and zone names such as
# `europe-west1-b` (`<region>-<letter>`).
RESOURCE_NAME = r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"
ZONE_NAME = r"^[a-z]+-[a-z]+[0-9]+-[a-z]$"
Zone = Annotated[str, Field(pattern=ZONE_NAME)]
# A subnetwork, as a full or partial URL that names its region.
_SUBNETWORK_REGION = re.compile(
    r"(?:^|/)regions/(?P<region>[a-z]+-[a-z]+[0-9]+)/subnetworks/[^/]+$"
)
# Zones a create may try, fallbacks included. Each gets its own operation
# budget (OPERATION_TIMEOUT_SECONDS), so trying all of them stays within the
# create activity's 10-minute start-to-close timeout in all but the worst
# case, where the retry adopts whatever the timed-out attempt made.
MAX_ZONES = 4


class GcpConfig(ProviderSettings):
    """Compute Engine VMs with public IPs; credentials come from ADC only."""

    project: str
    zone: Zone
    # Fallbacks on a stockout, tried in order after `zone`.
    zones: Annotated[list[Zone], Field(max_length=MAX_ZONES - 1)] = Field(default_factory=list)
    machine_type: str = "e2-micro"
    image_project: str = "debian-cloud"
    image_family: str = "debian-12"
    spot: bool = False
    network: str = "global/networks/default"
    subnetwork: str | None = None
    # The network tag the installation's firewall rule targets. The default,
    # `proxy-operator-<installation>`, keeps two installations sharing a network
    # from opening each other's VMs to their own allowed_cidrs.
    network_tag: Annotated[str, Field(pattern=RESOURCE_NAME)] | None = None
    # The installation's firewall rule. Rule names are unique per project, not
    # per network: two entries on different networks of one project need one
    # each. Default `proxy-operator-<installation>`.
    firewall_rule: Annotated[str, Field(pattern=RESOURCE_NAME)] | None = None

    @model_validator(mode="after")
    def _zones_fit_the_subnetwork(self) -> GcpConfig:
        """Every zone must be in the subnetwork's region, or no insert there can succeed."""
        if self.subnetwork is None:
            return self
        region = self.subnetwork_region
        if region is None:
            raise ValueError(
                f"subnetwork {self.subnetwork!r} must name its region: "
                "regions/<region>/subnetworks/<name>"
            )
        wrong = [
            f"{where} {zone!r} is not in region {region!r}"
            for where, zone in [("zone", self.zone)]
            + [(f"zones[{i}]", z) for i, z in enumerate(self.zones)]
            if zone_region(zone) != region
        ]
        if wrong:
            raise ValueError(f"{'; '.join(wrong)}, the region of subnetwork {self.subnetwork!r}")
        return self

    @property
    def subnetwork_region(self) -> str | None:
        match = _SUBNETWORK_REGION.search(self.subnetwork or "")
        return match["region"] if match else None

    def placement_problems(self, placement: Mapping[str, str]) -> list[str]:
        """Why a workflow's `placement.zone` cannot be used here, naming the field.

        The zone goes into API paths, so only a zone name passes; with a
        subnetwork, it must be in the subnetwork's region.
        """
        zone = placement.get("zone")
        if zone is None:
            return []
        if not isinstance(zone, str) or not re.fullmatch(ZONE_NAME, zone):
            return [f"placement.zone: {zone!r} is not a zone name such as europe-west1-b"]
        region = self.subnetwork_region
        if region is not None and zone_region(zone) != region:
            return [
                f"placement.zone: {zone!r} is not in region {region!r} of this provider's "
                f"subnetwork {self.subnetwork!r}"
            ]
        return []


def zone_region(zone: str) -> str:
    """`europe-west1-b` -> `europe-west1`."""
    return zone.rsplit("-", 1)[0]


def config_problems(config: Config) -> list[str]:
    """What the whole config gets wrong for GCP entries, each naming its path.

    - GCP proxy VMs have an IPv4 external address only, and a firewall rule
      holds one address family (the IPv6 ranges of `allowed_cidrs` serve
      other providers); without any IPv4 range no client could reach them.
    - Firewall rule names are unique per project: two entries sharing one
      rule but not its network or target tag would rewrite it in turn.
    """
    problems: list[str] = []
    has_ipv4 = any(ipaddress.ip_network(c).version == 4 for c in config.proxy.allowed_cidrs)
    rules: dict[tuple[str, str], tuple[int, GcpConfig]] = {}
    for i, entry in enumerate(config.providers):
        settings = entry.settings
        if not isinstance(settings, GcpConfig):
            continue
        if not has_ipv4:
            problems.append(
                f"proxy.allowed_cidrs: no IPv4 range, but providers[{i}] ({entry.name}) is of "
                "type gcp, whose VMs are reachable on an IPv4 external address only"
            )
        rule = settings.firewall_rule or firewall_name(config.installation)
        j, first = rules.setdefault((settings.project, rule), (i, settings))
        if j == i:
            continue
        clash = f"firewall rule {rule!r} in project {settings.project!r} as providers[{j}]"
        if _network_path(settings.project, settings.network) != _network_path(
            first.project, first.network
        ):
            problems.append(
                f"providers[{i}].gcp.network: {settings.network!r} shares {clash}, which is on "
                f"{first.network!r} (rule names are unique per project): set gcp.firewall_rule "
                "to a name of its own"
            )
        elif (settings.network_tag or rule) != (first.network_tag or rule):
            problems.append(
                f"providers[{i}].gcp.network_tag: {settings.network_tag!r} shares {clash}, "
                f"which targets {first.network_tag!r}: use the same network_tag or set "
                "gcp.firewall_rule to a name of its own"
            )
    return problems


PROVIDER_TYPE = ProviderType(
    name="gcp",
    settings=GcpConfig,
    placement_keys=frozenset({"zone"}),
    build=lambda entry, config: GcpProvider.from_config(entry, config),
    config_problems=config_problems,
)
log = logging.getLogger(__name__)

COMPUTE_SCOPE = "https://www.googleapis.com/auth/compute"

# Metadata keys this provider owns on every instance.
TAGS_METADATA_KEY = "proxy-operator-tags"
PORT_METADATA_KEY = "proxy-operator-port"
STARTUP_SCRIPT_KEY = "startup-script"
# Predefined metadata keys (compute/docs/metadata/predefined-metadata-keys):
# let the guest write guest attributes, and keep project-wide SSH keys off
# the proxies (only instance-level keys or OS Login can reach them).
GUEST_ATTRIBUTES_KEY = "enable-guest-attributes"
BLOCK_PROJECT_SSH_KEYS_KEY = "block-project-ssh-keys"

# Where the startup script reports its progress: `installing`, `ready`, or
# `failed: <why>`. Any process on the VM could write it; only Squid runs there.
STARTUP_STATE_ATTRIBUTE = "proxy-operator/state"
STARTUP_READY = "ready"
STARTUP_FAILED_PREFIX = "failed"
MAX_REASON_CHARS = 300
# Guest attributes are meant for "at most 10 queries per minute per VM"
# (compute/docs/metadata/manage-guest-attributes); a VM not ready yet is asked
# at most this often, the answer in between reused.
GUEST_ATTRIBUTE_INTERVAL_SECONDS = 6.0

FIREWALL_PREFIX = "proxy-operator-"
SQUID_CONF = "/etc/squid/squid.conf"

# One API call, not counting operation waits; a hung connection must not
# outlive the activity that made it.
CALL_TIMEOUT_SECONDS = 60.0
# Default bound on one operation: the insert in one zone (a zone that reports
# a stockout late leaves the next one its own full budget), a delete, or the
# firewall.
OPERATION_TIMEOUT_SECONDS = 120.0
# Compute Engine counts API rate quotas per minute (compute/docs/api-quota):
# a rate limit is over within one, unlike a resource quota.
RATE_LIMIT_RETRY_SECONDS = 60.0
# `wait` may return before the operation is done, in the worst case at once;
# this keeps a loop of such answers from hammering the API's rate quota.
MIN_WAIT_INTERVAL_SECONDS = 1.0

# GCE instance status -> common state (Libcloud style). RUNNING is only
# reported once the VM has an external IP and its startup script reports
# Squid ready; see `_to_instance` and `GcpProvider._with_readiness`.
# REPAIRING (Compute Engine recovering the VM after a host error) is STOPPED:
# the VM is not serving and may come back rebooted, so its workflow replaces it.
INSTANCE_STATES = state_table(
    {
        InstanceState.PROVISIONING: ("PENDING", "PROVISIONING", "STAGING"),
        InstanceState.RUNNING: ("RUNNING",),
        InstanceState.STOPPED: (
            "PENDING_STOP",
            "STOPPING",
            "STOPPED",
            "SUSPENDING",
            "SUSPENDED",
            "REPAIRING",
            "TERMINATED",
            "DEPROVISIONING",
        ),
    }
)
# A status newer than this table is not usable yet, but not proof of death
# either: PROVISIONING lets the workflow's provisioning deadline decide.
_UNKNOWN_STATE = InstanceState.PROVISIONING

# Error reasons (REST `errors[].reason`, ErrorInfo reason, or an operation's
# error code), compared without case and underscores: the REST API says
# `quotaExceeded` where an operation says `QUOTA_EXCEEDED`.
_STOCKOUT_REASONS = frozenset({"zoneresourcepoolexhausted", "zoneresourcepoolexhaustedwithdetails"})
_RATE_LIMIT_REASONS = frozenset({"ratelimitexceeded", "userratelimitexceeded"})
_QUOTA_REASONS = _STOCKOUT_REASONS | _RATE_LIMIT_REASONS | {"quotaexceeded"}
# "The resource ... is not ready": another operation on it is still running.
_RETRYABLE_REASONS = frozenset({"resourcenotready"})
# An organisation policy refusing the request (412 conditionNotMet, or
# CONDITION_NOT_MET in an operation): e.g. constraints/compute.vmExternalIpAccess.
# No retry gets past a policy. (412 also answers a stale fingerprint, which
# this provider never sends.)
_PERMANENT_REASONS = frozenset({"conditionnotmet"})
# Client errors that a later attempt can get past.
_RETRYABLE_STATUS = frozenset({408, 409, 429})

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
        guest_attribute_interval: float = GUEST_ATTRIBUTE_INTERVAL_SECONDS,
    ) -> None:
        self._settings = settings
        self._project = settings.project
        self._installation = installation
        self._firewall_name = settings.firewall_rule or firewall_name(installation)
        self._network_tag = settings.network_tag or self._firewall_name
        self._instances = instances
        self._operations = operations
        self._firewalls = firewalls
        self._global_operations = global_operations
        self._operation_timeout = operation_timeout
        self._guest_interval = guest_attribute_interval
        # (port, IPv4 CIDRs) pairs the firewall rule is known to admit. The
        # rule is checked once per pair and provider object, not per create.
        self._firewall_ensured: set[tuple[int, tuple[str, ...]]] = set()
        self._firewall_lock = threading.Lock()
        # Startup state per VM (zone, name, instance id): "ready" is kept for
        # good; anything else with when it was read, to pace the queries.
        self._startup: dict[tuple[str, str, int], tuple[str, float]] = {}
        self._startup_lock = threading.Lock()

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
        """Create the VM (or adopt the one an earlier attempt made), trying fallback zones.

        The firewall rule's port and CIDRs come from `req.proxy`, the same
        settings Squid is rendered from, so the two can never disagree and a
        proxy whose port the workflow overrides is still reachable.
        """
        if req.tags.get(INSTALLATION_KEY) != self._installation:
            # This installation's orphan GC could never find such a VM.
            raise Permanent(
                f"create {req.name}: tag {INSTALLATION_KEY} must be {self._installation!r}, "
                f"got {req.tags.get(INSTALLATION_KEY)!r}"
            )
        # validate_target rejects this first; checked again so no caller can
        # steer the API paths this builds.
        problems = self._settings.placement_problems(req.placement)
        if problems:
            raise Permanent(f"create {req.name}: {'; '.join(problems)}")
        with _edge():
            self._ensure_firewall(req.proxy, time.monotonic() + self._operation_timeout)
            pinned = req.placement.get("zone")
            zones = [pinned] if pinned else self._candidate_zones()
            if len(zones) > 1:
                # A retried create may find its VM in a fallback zone that an
                # earlier attempt reached; inserting into the first zone again
                # would run a second VM under the same name.
                existing = self._find_by_name(req, zones)
                if existing is not None:
                    self._remove_twins(req, existing)
                    return existing
            for zone in zones[:-1]:
                try:
                    return self._create_in_zone(req, zone)
                except api_exceptions.GoogleAPICallError as exc:
                    if not _reasons(exc) & _STOCKOUT_REASONS:
                        raise
                    log.info("zone %s has no capacity for %s, trying the next zone", zone, req.name)
            return self._create_in_zone(req, zones[-1])

    def get(self, provider_id: str) -> Instance:
        zone, name = _parse_provider_id(provider_id)
        with _edge():
            return self._with_readiness(zone, self._fetch(zone, name))

    def delete(self, provider_id: str) -> None:
        """Delete our VM, and only that one; an instance already gone is success.

        The instance is read first and its tags checked: a VM of another
        installation, or one made by hand under the same name, is Permanent.
        (Compute Engine's delete takes no precondition, so a VM re-created
        under the name between the read and the delete is not excluded; the
        name is a hash of this installation's owner and generation.)
        """
        zone, name = _parse_provider_id(provider_id)
        with _edge(), contextlib.suppress(api_exceptions.NotFound):
            mismatch = ownership_mismatch(_tags(self._fetch(zone, name)), self._installation)
            if mismatch:
                raise Permanent(f"delete instance {provider_id}: refused, {mismatch}")
            self._delete(zone, name)

    def list_by_tag(self, key: str, value: str) -> list[Instance]:
        """Select by label in every zone of the project, then match the exact tags.

        A zone the list could not reach makes it Transient: the contract
        promises every instance, and a sweep must not act on part of them.
        """
        with _edge():
            found, unreachable = self._aggregated(
                f'labels.{label_key(key)} = "{label_value(key, value)}"'
            )
        if unreachable:
            raise Transient(
                f"Compute Engine: instances in {', '.join(unreachable)} are unreachable; "
                "the list would be incomplete"
            )
        # A hashed or sanitised label can collide; the metadata copy cannot.
        instances = (_to_instance(gce) for gce in found)
        return [inst for inst in instances if inst.tags.get(key) == value]

    # -- instances ----------------------------------------------------------

    def _candidate_zones(self) -> list[str]:
        return list(dict.fromkeys([self._settings.zone, *self._settings.zones]))

    def _create_in_zone(self, req: CreateRequest, zone: str) -> Instance:
        """The VM in `zone`, inserted or adopted, with no twin left elsewhere.

        Each zone gets its own operation budget. A failed insert's instance
        lingers for a while: the error is raised only once it is gone, so the
        retry that follows inserts afresh instead of adopting a VM about to
        vanish.
        """
        deadline = time.monotonic() + self._operation_timeout
        try:
            op = self._instances.insert_unary(
                project=self._project,
                zone=zone,
                instance_resource=self._instance_resource(req, zone),
                retry=None,
                timeout=CALL_TIMEOUT_SECONDS,
            )
        except api_exceptions.Conflict:
            # Already exists: a retried create, or somebody else's VM.
            instance = self._adopt(req, zone, self._fetch(zone, req.name))
            self._remove_twins(req, instance)
            return instance
        except api_exceptions.NotFound as exc:
            # On insert, a 404 names what the request refers to (image family,
            # zone, network), never the instance: a config error, not a lost VM.
            raise _normalise(exc, missing=Permanent) from exc
        done = self._wait_done(op, deadline, self._zone_waiter(zone))
        if done.error.errors:
            self._wait_vanished(zone, req.name, deadline)
            raise _operation_error(done)
        instance = self._with_readiness(zone, self._fetch(zone, req.name))
        self._remove_twins(req, instance)
        return instance

    def _adopt(self, req: CreateRequest, zone: str, gce: compute_v1.Instance) -> Instance:
        """The existing VM of the requested name, if it is the one this request made.

        Its owner, installation and generation tags must match the request's:
        anything else is someone else's VM, never silently adopted.
        """
        mismatch = self._not_made_by(req, gce)
        if mismatch:
            raise Permanent(
                f"create instance {zone}/{req.name}: an instance of that name exists and is "
                f"not this proxy's, {mismatch}"
            )
        return self._with_readiness(zone, gce)

    def _not_made_by(self, req: CreateRequest, gce: compute_v1.Instance) -> str | None:
        """Why `gce` is not the VM `req` makes (installation, namespace, owner, generation)."""
        return adoption_mismatch(_tags(gce), self._installation, req.tags)

    def _find_by_name(self, req: CreateRequest, zones: list[str]) -> Instance | None:
        """Ask each candidate zone for the VM (one `instances.get` each).

        A zone that cannot answer fails the lookup: creating elsewhere while
        the VM may exist there would make a second one.
        """
        for zone in zones:
            with contextlib.suppress(api_exceptions.NotFound):
                return self._adopt(req, zone, self._fetch(zone, req.name))
        return None

    def _remove_twins(self, req: CreateRequest, keep: Instance) -> None:
        """Delete this request's VMs in zones other than `keep`'s.

        An earlier attempt may have reached a fallback zone that a config
        change has since removed from `zones`, so `_find_by_name` never asked
        there. It runs after every successful create, adopted or inserted, so
        a create that failed while deleting a twin finishes the job when
        retried. A twin this cannot see (its zone unreachable) is logged.
        """
        zone = keep.provider_id.partition("/")[0]
        found, unreachable = self._aggregated(f'name = "{req.name}"')
        if unreachable:
            log.warning(
                "cannot check %s for twins of %s: unreachable", ", ".join(unreachable), req.name
            )
        for gce in found:
            twin_zone = _zone_of(gce)
            if twin_zone == zone:
                continue
            if self._not_made_by(req, gce):
                continue  # not ours: never touched
            log.warning(
                "deleting %s/%s: a twin of %s/%s left by an earlier attempt",
                twin_zone,
                gce.name,
                zone,
                req.name,
            )
            with contextlib.suppress(api_exceptions.NotFound):
                self._delete(twin_zone, gce.name)

    def _delete(self, zone: str, name: str) -> None:
        op = self._instances.delete_unary(
            project=self._project,
            zone=zone,
            instance=name,
            retry=None,
            timeout=CALL_TIMEOUT_SECONDS,
        )
        self._wait(op, time.monotonic() + self._operation_timeout, self._zone_waiter(zone))
        with self._startup_lock:
            for key in [k for k in self._startup if k[:2] == (zone, name)]:
                del self._startup[key]

    def _wait_vanished(self, zone: str, name: str, deadline: float) -> None:
        """Wait (until `deadline`) for a failed insert's instance to be gone."""
        while time.monotonic() < deadline:
            try:
                self._fetch(zone, name)
            except api_exceptions.NotFound:
                return
            time.sleep(max(0.0, min(MIN_WAIT_INTERVAL_SECONDS, deadline - time.monotonic())))
        log.warning("the instance of the failed insert of %s/%s is still there", zone, name)

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
            GUEST_ATTRIBUTES_KEY: "TRUE",
            BLOCK_PROJECT_SSH_KEYS_KEY: "TRUE",
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
                        source_image=f"projects/{s.image_project}/global/images/family/{s.image_family}",
                        # Billing exports and disk listings show whose disk it is.
                        labels=labels(req.tags),
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

    def _fetch(self, zone: str, name: str) -> compute_v1.Instance:
        return self._instances.get(
            project=self._project,
            zone=zone,
            instance=name,
            retry=None,
            timeout=CALL_TIMEOUT_SECONDS,
        )

    def _aggregated(self, filter_: str) -> tuple[list[compute_v1.Instance], list[str]]:
        """Matching instances in every zone, and the scopes the list could not reach."""
        pages = self._instances.aggregated_list(
            request=compute_v1.AggregatedListInstancesRequest(
                project=self._project, filter=filter_
            ),
            retry=None,
            timeout=CALL_TIMEOUT_SECONDS,
        )
        found: list[compute_v1.Instance] = []
        unreachable: dict[str, None] = {}
        for page in pages.pages:
            unreachable.update(dict.fromkeys(page.unreachables))
            for scope, scoped in page.items.items():
                # Typed as the builtin Warning by the SDK's forward reference.
                warning = cast(compute_v1.Warning, scoped.warning)
                if warning.code == UNREACHABLE_WARNING:
                    unreachable[scope] = None
                found.extend(scoped.instances)
        return found, list(unreachable)

    # -- readiness ----------------------------------------------------------

    def _with_readiness(self, zone: str, gce: compute_v1.Instance) -> Instance:
        """The instance, RUNNING only once its startup script reports Squid ready.

        A script that reports a failure ends the instance (TERMINATED with its
        reason), so the workflow replaces it at once instead of waiting out its
        deadline. VMs made before readiness reporting (no guest attributes
        enabled) keep the plain status mapping.
        """
        instance = _to_instance(gce)
        if instance.state is not InstanceState.RUNNING or not _reports_readiness(gce):
            return instance
        state = self._startup_state(zone, gce)
        if state == STARTUP_READY:
            return instance
        if state.startswith(STARTUP_FAILED_PREFIX):
            # Written by the VM: shown to users, so kept short and printable.
            said = "".join(c if c.isprintable() else "?" for c in state[:MAX_REASON_CHARS])
            return dataclasses.replace(
                instance, state=InstanceState.TERMINATED, ip="", reason=f"startup script {said}"
            )
        return dataclasses.replace(
            instance,
            state=InstanceState.PROVISIONING,
            ip="",
            reason=f"VM running, waiting for its startup script to start Squid ({state})",
        )

    def _startup_state(self, zone: str, gce: compute_v1.Instance) -> str:
        """The startup script's last report ("booting" before its first), paced per VM."""
        key = (zone, gce.name, gce.id)
        with self._startup_lock:
            known = self._startup.get(key)
        if known is not None and (
            known[0] == STARTUP_READY or time.monotonic() - known[1] < self._guest_interval
        ):
            return known[0]
        state = "booting"
        try:
            answer = self._instances.get_guest_attributes(
                request=compute_v1.GetGuestAttributesInstanceRequest(
                    project=self._project,
                    zone=zone,
                    instance=gce.name,
                    query_path=STARTUP_STATE_ATTRIBUTE,
                ),
                retry=None,
                timeout=CALL_TIMEOUT_SECONDS,
            )
        except api_exceptions.NotFound:
            pass  # nothing written yet: the guest is still booting
        else:
            namespace, _, attribute = STARTUP_STATE_ATTRIBUTE.partition("/")
            state = next(
                (
                    item.value
                    for item in answer.query_value.items
                    if (item.namespace, item.key) == (namespace, attribute)
                ),
                state,
            )
        with self._startup_lock:
            self._startup[key] = (state, time.monotonic())
        return state

    # -- firewall -----------------------------------------------------------

    def _ensure_firewall(self, proxy: ProxySettings, deadline: float) -> None:
        """Make the installation's rule admit `proxy`'s port from its IPv4 CIDRs only.

        Get, then insert if missing (a 409 from a racing worker is fine) or
        replace it if it differs: the rule belongs to the installation, so a
        widened source range or port list is put back. Ports of earlier
        proxies are kept, since running VMs may still listen on them. A rule
        of that name on another network is somebody else's: Permanent.
        """
        cidrs = _ipv4_ranges(proxy.allowed_cidrs)
        if not cidrs:
            # An ingress rule without source ranges admits 0.0.0.0/0.
            raise Permanent(
                "proxy.allowed_cidrs has no IPv4 range: a GCP proxy VM is reachable on its "
                "IPv4 external address only, and refusing to open the proxy port to everyone"
            )
        key = (proxy.port, cidrs)
        with self._firewall_lock:
            if key in self._firewall_ensured:
                return
            existing = self._get_firewall()
            if existing is None:
                try:
                    op = self._firewalls.insert_unary(
                        project=self._project,
                        firewall_resource=self._firewall_rule({proxy.port}, cidrs),
                        retry=None,
                        timeout=CALL_TIMEOUT_SECONDS,
                    )
                    self._wait(op, deadline, self._global_waiter)
                except api_exceptions.Conflict:
                    existing = self._get_firewall()
            if existing is not None:
                self._check_network(existing)
                wanted = self._firewall_rule(_tcp_ports(existing) | {proxy.port}, cidrs)
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

    def _check_network(self, rule: compute_v1.Firewall) -> None:
        theirs = _network_path(self._project, rule.network)
        ours = _network_path(self._project, self._settings.network)
        if theirs != ours:
            raise Permanent(
                f"firewall rule {self._firewall_name!r} is on network {theirs!r}, but this "
                f"provider's VMs are on {ours!r}; rule names are unique per project: set "
                "gcp.firewall_rule to a name of its own"
            )

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
        """Wait until `op` is DONE (see `_wait_done`); raise its error if it failed."""
        done = self._wait_done(op, deadline, wait)
        if done.error.errors:
            raise _operation_error(done)

    def _wait_done(
        self,
        op: compute_v1.Operation,
        deadline: float,
        wait: Callable[[str, float], compute_v1.Operation],
    ) -> compute_v1.Operation:
        """The operation once DONE, failed or not; Transient if `deadline` passes first.

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
        return op


# The warning code on an aggregated list's scope it could not reach.
UNREACHABLE_WARNING = "UNREACHABLE"


# -- instances <-> the contract ---------------------------------------------


def _metadata(gce: compute_v1.Instance) -> dict[str, str]:
    return {item.key: item.value for item in gce.metadata.items}


def _reports_readiness(gce: compute_v1.Instance) -> bool:
    return _metadata(gce).get(GUEST_ATTRIBUTES_KEY, "").upper() == "TRUE"


def _zone_of(gce: compute_v1.Instance) -> str:
    return gce.zone.rsplit("/", 1)[-1]


def _to_instance(gce: compute_v1.Instance) -> Instance:
    """The status table applied; readiness is `GcpProvider._with_readiness`'s."""
    metadata = _metadata(gce)
    ip = next(
        (ac.nat_i_p for nic in gce.network_interfaces for ac in nic.access_configs if ac.nat_i_p),
        "",
    )
    state = INSTANCE_STATES.get(gce.status, _UNKNOWN_STATE)
    if state is InstanceState.RUNNING and not ip:
        state = InstanceState.PROVISIONING  # never publish an empty endpoint
    return Instance(
        provider_id=f"{_zone_of(gce)}/{gce.name}",
        name=gce.name,
        state=state,
        ip=ip if state is InstanceState.RUNNING else "",
        port=int(metadata.get(PORT_METADATA_KEY, "0")),
        tags=_tags(gce),
        created_at=datetime.fromisoformat(gce.creation_timestamp),
    )


def _tags(gce: compute_v1.Instance) -> dict[str, str]:
    """The exact tags from metadata; none for a VM this provider did not make.

    Labels are not a fallback: they hold hashes and sanitised keys, and a VM
    that merely copies our labels must not look like ours to orphan GC.
    """
    with contextlib.suppress(ValueError):
        parsed = json.loads(_metadata(gce).get(TAGS_METADATA_KEY, ""))
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
    """A boot script that installs Squid, writes its config and htpasswd, and reports.

    It runs as root on every boot, so a VM that restarts comes back with the
    config in its metadata. The htpasswd is created group-readable by Squid's
    user only, before the hash is written into it.

    First boots are where images differ: unattended-upgrades may hold the dpkg
    lock for minutes, and a third-party apt repository on the image may fail
    `apt-get update`. apt waits for the lock (DPkg::Lock::Timeout), a failed
    update does not stop the install from Debian's own lists, and the install
    is retried. Progress goes to the guest attribute STARTUP_STATE_ATTRIBUTE:
    `installing`, then `ready` once Squid listens, or `failed: <why>` from
    whichever step failed, which ends the instance with that reason.
    """
    paths = SquidPaths()
    rendered = render(proxy, paths)
    squid_conf = rendered.squid_conf.rstrip("\n")
    htpasswd = rendered.htpasswd.rstrip("\n")
    return f"""#!/bin/bash
# proxy-operator: install and configure Squid, then report. Runs on every boot; idempotent.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
STATE_URL=http://metadata.google.internal/computeMetadata/v1/instance/guest-attributes/{STARTUP_STATE_ATTRIBUTE}
report() {{
  curl -sS --retry 5 --retry-connrefused --max-time 10 -X PUT \\
    -H "Metadata-Flavor: Google" --data "$1" "$STATE_URL" || true
}}
trap 'report "{STARTUP_FAILED_PREFIX}: line $LINENO: ${{BASH_COMMAND:0:200}} (exit $?)"' ERR
APT=(apt-get -q -o DPkg::Lock::Timeout=120 -o Acquire::Retries=3)
install_squid() {{
  for attempt in 1 2 3 4 5; do
    # A broken third-party repository fails the update, not Debian's own lists.
    "${{APT[@]}}" update || echo "apt-get update failed (attempt $attempt)" >&2
    if "${{APT[@]}}" install -y --no-install-recommends squid; then
      return 0
    fi
    sleep 20
  done
  return 1
}}
if ! command -v squid >/dev/null 2>&1; then
  report installing
  if ! install_squid; then
    report "{STARTUP_FAILED_PREFIX}: apt-get could not install squid in 5 attempts"
    exit 1
  fi
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
listening() {{ (exec 3<>/dev/tcp/127.0.0.1/{proxy.port}) 2>/dev/null; }}
for attempt in $(seq 1 30); do
  if systemctl is-active --quiet squid && listening; then
    report {STARTUP_READY}
    exit 0
  fi
  sleep 2
done
report "{STARTUP_FAILED_PREFIX}: squid is not listening on port {proxy.port}"
exit 1
"""


# -- firewall helpers --------------------------------------------------------


def _ipv4_ranges(cidrs: tuple[str, ...]) -> tuple[str, ...]:
    """The IPv4 ranges, sorted: a VPC firewall rule holds one family only
    ("either IPv4 or IPv6 ranges, but not both", firewall/docs/using-firewalls),
    and the VMs have an IPv4 external address only."""
    return tuple(sorted(c for c in cidrs if ipaddress.ip_network(c).version == 4))


def _network_path(project: str, network: str) -> str:
    """A network as `projects/<p>/global/networks/<n>`, however it was written."""
    path = network.split("/compute/v1/", 1)[-1]
    return path if path.startswith("projects/") else f"projects/{project}/{path}"


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
    elif reasons & _PERMANENT_REASONS:
        kind = Permanent
    elif reasons & _RETRYABLE_REASONS:
        kind = Transient
    elif code == 404:
        kind = missing
    elif code in _RETRYABLE_STATUS or not 400 <= code < 500:
        kind = Transient
    else:
        kind = Permanent  # bad request, permission denied, invalid image or machine type
    retry_after = _retry_after(exc)
    if retry_after is None and reasons & _RATE_LIMIT_REASONS:
        retry_after = RATE_LIMIT_RETRY_SECONDS
    return kind(f"Compute Engine: {exc}", cause=exc, retry_after_seconds=retry_after)


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
