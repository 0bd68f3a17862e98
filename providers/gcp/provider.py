"""GcpProvider: the provider contract on Compute Engine, one VM per proxy.

The concerns it leans on live next to it in this package (see its
docstring): settings, names and labels, the state table, the startup script,
the firewall rule, operations, and the error edge.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Generic, TypeVar, cast

import google.auth
from google.api_core import exceptions as api_exceptions
from google.cloud import compute_v1

from providers.base import CreateRequest, Disruption, Instance, InstanceState
from providers.boot_script import with_report
from providers.catalog import ProviderType
from providers.config import Config, ProviderEntry
from providers.errors import NotFound, Permanent, Transient
from providers.gcp.errors import STOCKOUT_REASONS, edge, normalise, operation_error, reasons
from providers.gcp.firewall import DOUBT_INTERVAL_SECONDS as FIREWALL_DOUBT_SECONDS
from providers.gcp.firewall import RECHECK_SECONDS as FIREWALL_RECHECK_SECONDS
from providers.gcp.firewall import InstallationFirewall
from providers.gcp.instances import (
    BLOCK_PROJECT_SSH_KEYS_KEY,
    GUEST_ATTRIBUTES_KEY,
    PORT_METADATA_KEY,
    STARTUP_SCRIPT_KEY,
    TAGS_METADATA_KEY,
    parse_provider_id,
    preemptible,
    reports_readiness,
    tags_of,
    to_instance,
    zone_of,
)
from providers.gcp.naming import firewall_name, label_key, label_value, labels
from providers.gcp.operations import (
    CALL_TIMEOUT_SECONDS,
    MIN_WAIT_INTERVAL_SECONDS,
    OPERATION_TIMEOUT_SECONDS,
    Waiter,
    wait_done,
    wait_succeeded,
)
from providers.gcp.settings import GcpConfig, config_problems
from providers.gcp.startup import STARTUP_READY, STARTUP_STATE_ATTRIBUTE, startup_script
from providers.naming import (
    GENERATION_KEY,
    INSTALLATION_KEY,
    RFC1035_LABEL,
    adoption_mismatch,
    ownership_mismatch,
)
from squid.conf import ProxySettings

PROVIDER_TYPE = ProviderType(
    name="gcp",
    settings=GcpConfig,
    placement_keys=frozenset({"zone"}),
    build=lambda entry, config: GcpProvider.from_config(entry, config),
    config_problems=config_problems,
)
log = logging.getLogger(__name__)

COMPUTE_SCOPE = "https://www.googleapis.com/auth/compute"

# Guest attributes are meant for "at most 10 queries per minute per VM"
# (compute/docs/metadata/manage-guest-attributes); a VM not ready yet is asked
# at most this often, the answer in between reused.
GUEST_ATTRIBUTE_INTERVAL_SECONDS = 6.0

# What `insert_request_id` derives its UUIDs from.
REQUEST_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://proxy-operator/gcp/insert")

# A requestId is remembered for at least an hour, so a retried insert walks
# the inserts that failed under it (a quota waited out every few minutes)
# before its own, one call each, back to back. Past this many failures the
# create says so and sends nothing more until Compute Engine has forgotten
# the first of them: a burst of inserts into a zone that keeps refusing them
# would only spend the project's rate quota.
MAX_FAILED_INSERTS = 4

# The operation Compute Engine records when it preempts a Spot or preemptible
# VM (compute/docs/instances/spot, "Detect if a Spot VM was preempted").
PREEMPTED_OPERATION = "compute.instances.preempted"
# A stopping Spot VM's zone operations are listed at most this often while
# no preemption is found (a VM we delete ourselves stops for a while too).
PREEMPTION_CHECK_SECONDS = 10.0

# The warning code on an aggregated list's scope it could not reach.
UNREACHABLE_WARNING = "UNREACHABLE"

# VMs whose startup state and preemption lookups are remembered, the most
# recently read first: a worker's share of a large fleet, while a VM deleted
# by someone else (or preempted) never leaves an entry behind for good.
MAX_REMEMBERED_VMS = 4096

K = TypeVar("K")
V = TypeVar("V")


def insert_request_id(req: CreateRequest, zone: str) -> str:
    """The `requestId` of `req`'s insert into `zone`: the same for every attempt.

    Compute Engine answers a request repeated with its requestId (for at
    least 60 minutes) with the operation the first one started, so a retry
    whose first answer was lost, or that meets its VM still PROVISIONING,
    waits on the original insert and sees its outcome, a stockout included.
    Per zone: a fallback zone's insert is a request of its own.
    """
    generation = req.tags.get(GENERATION_KEY, "")
    return str(uuid.uuid5(REQUEST_ID_NAMESPACE, f"{zone}/{req.name}/{generation}"))


class _Recent(Generic[K, V]):
    """A thread-safe map keeping its `size` most recently written entries."""

    def __init__(self, size: int) -> None:
        self._items: OrderedDict[K, V] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            return self._items.get(key)

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def drop(self, matches: Callable[[K], bool]) -> None:
        with self._lock:
            for key in [k for k in self._items if matches(k)]:
                del self._items[key]


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
        preemption_check_interval: float = PREEMPTION_CHECK_SECONDS,
        remembered_vms: int = MAX_REMEMBERED_VMS,
        firewall_recheck_seconds: float = FIREWALL_RECHECK_SECONDS,
        firewall_doubt_seconds: float = FIREWALL_DOUBT_SECONDS,
    ) -> None:
        self._settings = settings
        self._project = settings.project
        self._installation = installation
        firewall_rule = settings.firewall_rule or firewall_name(installation)
        self._network_tag = settings.network_tag or firewall_rule
        self._instances = instances
        self._operations = operations
        self._global_operations = global_operations
        self._operation_timeout = operation_timeout
        self._guest_interval = guest_attribute_interval
        self._firewall = InstallationFirewall(
            project=settings.project,
            name=firewall_rule,
            network=settings.network,
            target_tag=self._network_tag,
            firewalls=firewalls,
            wait=self._global_waiter,
            operation_timeout=operation_timeout,
            recheck_seconds=firewall_recheck_seconds,
            doubt_interval=firewall_doubt_seconds,
        )
        # Startup state per VM (zone, name, instance id): "ready" is kept for
        # good; anything else with when it was read, to pace the queries.
        self._startup: _Recent[tuple[str, str, int], tuple[str, float]] = _Recent(remembered_vms)
        # Preemptions per VM (zone, name): the reason ("" none yet), and when read.
        self._preempted: _Recent[tuple[str, str], tuple[str, float]] = _Recent(remembered_vms)
        self._preemption_interval = preemption_check_interval

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
        with edge():
            self._firewall.ensure(req.proxy, time.monotonic() + self._operation_timeout)
            pinned = req.placement.get("zone")
            zones = [pinned] if pinned else self._candidate_zones()
            if len(zones) > 1:
                # A retried create may find its VM in a fallback zone that an
                # earlier attempt reached; inserting into the first zone again
                # would run a second VM under the same name.
                existing = self._find_by_name(req, zones)
                if existing is not None and existing.state is not InstanceState.PROVISIONING:
                    self._remove_twins(req, existing)
                    return existing
                if existing is not None:
                    # Its insert may still fail (a late stockout): wait on the
                    # original operation, asked again under its requestId,
                    # from its zone on.
                    zones = zones[zones.index(existing.provider_id.partition("/")[0]) :]
            for zone in zones[:-1]:
                try:
                    return self._create_in_zone(req, zone)
                except api_exceptions.GoogleAPICallError as exc:
                    if not reasons(exc) & STOCKOUT_REASONS:
                        raise
                    log.info("zone %s has no capacity for %s, trying the next zone", zone, req.name)
            return self._create_in_zone(req, zones[-1])

    def get(self, provider_id: str) -> Instance:
        """The VM's state; a Spot VM Compute Engine preempted says so, gone or going.

        A Spot VM is deleted on preemption (`instance_termination_action`),
        after some 30 s of STOPPING: both the STOPPED state and the NotFound
        after it carry the disruption when the zone's operations show a
        preemption of the VM.
        """
        zone, name = parse_provider_id(provider_id)
        with edge():
            try:
                gce = self._fetch(zone, name)
            except api_exceptions.NotFound as exc:
                preempted = self._preemption(zone, name) if self._settings.spot else ""
                if not preempted:
                    raise
                raise NotFound(
                    preempted,
                    cause=exc,
                    disruption=Disruption.PREEMPTED,
                ) from exc
            instance = self._with_readiness(zone, gce)
            if instance.state is InstanceState.STOPPED and preemptible(gce):
                preempted = self._preemption(zone, name)
                if preempted:
                    return replace(instance, reason=preempted, disruption=Disruption.PREEMPTED)
            return instance

    def delete(self, provider_id: str) -> None:
        """Delete our VM, and only that one; an instance already gone is success.

        The instance is read first and its tags checked: a VM of another
        installation, or one made by hand under the same name, is Permanent.
        (Compute Engine's delete takes no precondition, so a VM re-created
        under the name between the read and the delete is not excluded; the
        name is a hash of this installation's owner and generation.)
        """
        zone, name = parse_provider_id(provider_id)
        with edge(), contextlib.suppress(api_exceptions.NotFound):
            mismatch = ownership_mismatch(tags_of(self._fetch(zone, name)), self._installation)
            if mismatch:
                raise Permanent(f"delete instance {provider_id}: refused, {mismatch}")
            self._delete(zone, name)

    def find(self, name: str, placement: Mapping[str, str]) -> Instance | None:
        """The VM named `name` in the zones a create with `placement` tries (NamedLookup).

        One zonal `get` per candidate zone, usually one in all: a read, where
        `list_by_tag`'s aggregated list costs list quota and a filtered
        list's overhead. The plain status mapping, no guest attribute query:
        callers ask about a VM whose owner already found it ready.

        A placement this config no longer allows (a zone outside a new
        subnetwork's region) finds nothing here: the VM made under the old
        config still exists, and the caller's listing by tag finds it.
        """
        problems = self._settings.placement_problems(placement)
        if problems:
            log.info("find %s: %s; not looked up by name", name, "; ".join(problems))
            return None
        if not RFC1035_LABEL.fullmatch(name):
            raise Permanent(f"find {name!r}: not an instance name")
        pinned = placement.get("zone")
        with edge():
            for zone in [pinned] if pinned else self._candidate_zones():
                with contextlib.suppress(api_exceptions.NotFound):
                    return to_instance(self._fetch(zone, name))
        return None

    def recheck_access(self, provider_id: str, proxy: ProxySettings) -> None:
        """A VM failed a probe: check the firewall rule that admits its clients (AccessCheck).

        A rule deleted by hand, or a port another writer's update dropped,
        is put back at once rather than when the proxy has crashed and its
        replacement is created. The rule is read at most every
        `firewall_doubt_seconds` however many VMs fail; the next create
        checks it again in any case.
        """
        parse_provider_id(provider_id)
        with edge():
            self._firewall.doubt(proxy, time.monotonic() + self._operation_timeout)

    def list_by_tag(self, key: str, value: str) -> list[Instance]:
        """Select by label in every zone of the project, then match the exact tags.

        A zone the list could not reach makes it Transient: the contract
        promises every instance, and a sweep must not act on part of them.
        """
        with edge():
            found, unreachable = self._aggregated(
                f'labels.{label_key(key)} = "{label_value(key, value)}"'
            )
        if unreachable:
            raise Transient(
                f"Compute Engine: instances in {', '.join(unreachable)} are unreachable; "
                "the list would be incomplete"
            )
        # A hashed or sanitised label can collide; the metadata copy cannot.
        instances = (to_instance(gce) for gce in found)
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
            op = self._insert(req, zone, insert_request_id(req, zone))
            failed = 0
            while op.status == compute_v1.Operation.Status.DONE and op.error.errors:
                # The answer to an insert that failed earlier (its failure
                # already reported): insert again, under a requestId every
                # attempt derives alike from the failed operation.
                failed += 1
                if failed >= MAX_FAILED_INSERTS:
                    raise operation_error(
                        op,
                        note=(
                            f"create {zone}/{req.name}: its last {failed} inserts failed and "
                            "Compute Engine remembers each requestId for at least 60 minutes; "
                            "no new insert until the first is forgotten. The latest: "
                        ),
                    )
                op = self._insert(req, zone, str(uuid.uuid5(REQUEST_ID_NAMESPACE, op.name)))
        except api_exceptions.Conflict:
            # Already exists: a retried create, or somebody else's VM.
            instance = self._adopt(req, zone, self._fetch(zone, req.name))
            self._remove_twins(req, instance)
            return instance
        except api_exceptions.NotFound as exc:
            # On insert, a 404 names what the request refers to (image family,
            # zone, network), never the instance: a config error, not a lost VM.
            raise normalise(exc, missing=Permanent) from exc
        done = wait_done(op, deadline, self._zone_waiter(zone), self._operation_timeout)
        if done.error.errors:
            self._wait_vanished(zone, req.name, deadline)
            raise operation_error(done)
        instance = self._with_readiness(zone, self._fetch(zone, req.name))
        self._remove_twins(req, instance)
        return instance

    def _insert(self, req: CreateRequest, zone: str, request_id: str) -> compute_v1.Operation:
        return self._instances.insert_unary(
            request=compute_v1.InsertInstanceRequest(
                project=self._project,
                zone=zone,
                instance_resource=self._instance_resource(req, zone),
                request_id=request_id,
            ),
            retry=None,
            timeout=CALL_TIMEOUT_SECONDS,
        )

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
        return adoption_mismatch(tags_of(gce), self._installation, req.tags)

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
        retried.

        A zone the list could not reach may hold a twin, which would bill
        unseen for as long as the generation lives: the create is Transient
        until every zone answers, and its retry adopts the VM kept here and
        checks again. Twins it can see are deleted first all the same.
        """
        zone = keep.provider_id.partition("/")[0]
        found, unreachable = self._aggregated(f'name = "{req.name}"')
        for gce in found:
            twin_zone = zone_of(gce)
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
        if unreachable:
            raise Transient(
                f"create {zone}/{req.name}: cannot check {', '.join(unreachable)} for a twin "
                "an earlier attempt may have left there (unreachable); trying again later"
            )

    def _delete(self, zone: str, name: str) -> None:
        op = self._instances.delete_unary(
            project=self._project,
            zone=zone,
            instance=name,
            retry=None,
            timeout=CALL_TIMEOUT_SECONDS,
        )
        deadline = time.monotonic() + self._operation_timeout
        wait_succeeded(op, deadline, self._zone_waiter(zone), self._operation_timeout)
        self._startup.drop(lambda key: key[:2] == (zone, name))

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
        instance = to_instance(gce)
        if instance.state is not InstanceState.RUNNING or not reports_readiness(gce):
            return instance
        report = self._startup_state(zone, gce)
        return with_report(instance, report, script="startup script", machine="VM")

    def _startup_state(self, zone: str, gce: compute_v1.Instance) -> str:
        """The startup script's last report ("booting" before its first), paced per VM."""
        key = (zone, gce.name, gce.id)
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
        self._startup.put(key, (state, time.monotonic()))
        return state

    # -- preemptions --------------------------------------------------------

    def _preemption(self, zone: str, name: str) -> str:
        """Why the VM was preempted, from its zone's operations; "" if it was not.

        A preemption found is kept; none found is asked again only after
        PREEMPTION_CHECK_SECONDS, so polling a VM we are deleting ourselves
        costs few list calls.
        """
        key = (zone, name)
        known = self._preempted.get(key)
        if known is not None and (
            known[0] or time.monotonic() - known[1] < self._preemption_interval
        ):
            return known[0]
        found = ""
        try:
            for op in self._operations.list(
                request=compute_v1.ListZoneOperationsRequest(
                    project=self._project,
                    zone=zone,
                    filter=f'operationType = "{PREEMPTED_OPERATION}"',
                ),
                retry=None,
                timeout=CALL_TIMEOUT_SECONDS,
            ):
                if op.target_link.rsplit("/", 1)[-1] == name:
                    found = (
                        f"preempted: Compute Engine reclaimed the Spot VM at {op.insert_time} "
                        f"({op.status_message or PREEMPTED_OPERATION})"
                    )
                    break
        except api_exceptions.GoogleAPICallError as err:
            # What the VM's state says stands (gone is gone), only the reason is
            # unknown: a worker without compute.zoneOperations.list (an older
            # role) or an API hiccup must not turn a deleted VM into an error.
            log.warning("cannot tell whether %s/%s was preempted: %s", zone, name, err)
        self._preempted.put(key, (found, time.monotonic()))
        return found

    # -- operations ---------------------------------------------------------

    def _zone_waiter(self, zone: str) -> Waiter:
        def wait(name: str, timeout: float) -> compute_v1.Operation:
            return self._operations.wait(
                project=self._project, zone=zone, operation=name, retry=None, timeout=timeout
            )

        return wait

    def _global_waiter(self, name: str, timeout: float) -> compute_v1.Operation:
        return self._global_operations.wait(
            project=self._project, operation=name, retry=None, timeout=timeout
        )
