"""AwsProvider: the provider contract on EC2, one instance per proxy.

The concerns it leans on live next to it in this package (see its
docstring): settings, the state table and tags, the user data, the security
group, and the error edge.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import ClientError

from providers.aws.consistency import CONSISTENCY_WINDOW_SECONDS, Sightings
from providers.aws.errors import (
    GROUP_NOT_FOUND,
    IDEMPOTENT_MISMATCH,
    INSTANCE_NOT_FOUND,
    NEXT_ZONE_CODES,
    UNSUPPORTED,
    code,
    edge,
)
from providers.aws.instance_type import offering_subnets
from providers.aws.instances import (
    NAME_TAG,
    PORT_TAG,
    as_tag_list,
    first,
    parse_provider_id,
    tag_dict,
    tag_problems,
    to_instance,
)
from providers.aws.security_group import InstallationGroup, group_name
from providers.aws.settings import AwsConfig, config_problems
from providers.aws.user_data import (
    REBALANCE_REASON,
    STARTUP_BOOTING,
    STARTUP_READY,
    ConsoleReport,
    console_report,
    interruption_notice,
    user_data,
)
from providers.base import Advice, CreateRequest, Disruption, Instance, InstanceState
from providers.boot_script import with_report
from providers.catalog import ProviderType
from providers.config import Config, ProviderEntry
from providers.errors import NotFound, Permanent, Transient
from providers.naming import INSTALLATION_KEY, OWNER_KEY, adoption_mismatch, ownership_mismatch

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client
    from mypy_boto3_ec2.type_defs import FilterTypeDef, InstanceTypeDef

PROVIDER_TYPE = ProviderType(
    name="aws",
    settings=AwsConfig,
    placement_keys=frozenset({"subnet"}),
    build=lambda entry, config: AwsProvider.from_config(entry, config),
    config_problems=config_problems,
)
log = logging.getLogger(__name__)
# The burstable families, the only ones with CPU credits (others refuse a
# CreditSpecification).
BURSTABLE = re.compile(r"t\d")

# The SDK's own retries are off (total_max_attempts 1): Temporal's activity
# retry policy is the one retry layer, derived from the error taxonomy.
SDK_CONFIG = BotoConfig(
    retries={"total_max_attempts": 1, "mode": "standard"}, connect_timeout=10, read_timeout=60
)
# GetConsoleOutput is throttled per account like every EC2 action; an
# instance not ready yet is asked at most this often, the answer in between reused.
CONSOLE_INTERVAL_SECONDS = 6.0
# A Ready spot instance's console is read for a rebalance recommendation at
# most this often: 1,000 spot proxies make about 8 GetConsoleOutput calls a
# second. The interruption notice needs no such read (the watcher stops
# Squid, and the failed probe reads it), so this only bounds how late a
# replacement starts before the notice. A pool's monitor also lists the
# installation's running spot instances at most this often, to find its
# members' instances by owner and endpoint (docs/providers.md, "Spot").
ADVICE_INTERVAL_SECONDS = 120.0
# DescribeInstances' largest page: a 1,000-member fleet is one call.
LISTING_PAGE = 1000
# The newest image of the configured name is looked up again after this long.
IMAGE_CACHE_SECONDS = 3600.0
# Every state but terminated: an instance in them still holds its name.
LIVE_STATES = ["pending", "running", "shutting-down", "stopping", "stopped"]


class AwsProvider:
    """The provider contract on EC2; `provider_id` is the instance id."""

    def __init__(
        self,
        settings: AwsConfig,
        installation: str,
        *,
        ec2: EC2Client,
        console_interval: float = CONSOLE_INTERVAL_SECONDS,
        advice_interval: float = ADVICE_INTERVAL_SECONDS,
        consistency_window: float = CONSISTENCY_WINDOW_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`clock` dates the security group's port timestamps (the revocation grace)."""
        self._settings = settings
        self._installation = installation
        self._ec2 = ec2
        self._console_interval = console_interval
        self._advice_interval = advice_interval
        self._group = InstallationGroup(
            ec2=ec2,
            name=settings.security_group or group_name(installation),
            installation=installation,
            clock=clock,
        )
        self._lock = threading.Lock()
        # Console state per instance id: "ready" is kept for good on an
        # on-demand instance; anything else (and a spot instance's "ready",
        # which a notice may follow) with when it was read, to pace the queries.
        self._console: dict[str, tuple[ConsoleReport, float]] = {}
        self._image: tuple[str, float] | None = None
        self._vpc: str | None = None
        # Image id -> its root device's name and size (GiB), if the image says.
        self._root_volumes: dict[str, tuple[str, int | None]] = {}
        # Subnet -> availability zone, read with the VPC.
        self._zones: dict[str, str] = {}
        # Per configured instance type, the subnets whose zone offers it, once checked.
        self._offered: dict[str, frozenset[str]] | None = None
        # How old each instance is, for what EC2 does not show yet.
        self._sightings = Sightings(consistency_window)
        # For pools' monitors: the installation's running spot instances by
        # (owner, endpoint), newest first, as last listed and when; and when
        # each one's console is next read for advice. One listing at a time.
        self._spot_listing: tuple[dict[tuple[str, str], list[str]], float] | None = None
        self._advice_due: dict[str, float] = {}
        self._listing_lock = threading.Lock()

    @classmethod
    def from_config(cls, entry: ProviderEntry, config: Config) -> AwsProvider:
        """A real client on the default AWS credential chain; never used by tests."""
        settings = PROVIDER_TYPE.settings_of(entry)
        ec2 = boto3.session.Session().client("ec2", region_name=settings.region, config=SDK_CONFIG)
        return cls(settings, config.installation, ec2=ec2)

    # -- the contract -------------------------------------------------------

    def create(self, req: CreateRequest) -> Instance:
        """Launch the instance (or adopt the one an earlier attempt made), trying each subnet.

        The client token is the instance name, so a retried RunInstances
        whose first answer was lost returns the instance it made instead of
        launching a second; an instance of that name already there is
        adopted if it is this request's. The security group's port and CIDRs
        come from `req.proxy`, the settings Squid is rendered from.
        """
        problems = self._settings.placement_problems(req.placement) + tag_problems(req.tags)
        if req.tags.get(INSTALLATION_KEY) != self._installation:
            # This installation's orphan GC could never find such an instance.
            problems.append(
                f"tag {INSTALLATION_KEY} must be {self._installation!r}, "
                f"got {req.tags.get(INSTALLATION_KEY)!r}"
            )
        if problems:
            raise Permanent(f"create {req.name}: {'; '.join(problems)}")
        with edge():
            existing = self._by_filter({"Name": f"tag:{NAME_TAG}", "Values": [req.name]})
            if existing is not None:
                return self._adopt(req, existing)
            vpc = self._vpc_of(self._settings.subnets)
            tries = self._offering(self._subnet_order(req))
            group = self._group.ensure(req.proxy, vpc)
            image = self._image_id()
            refused: list[ClientError] = []
            for instance_type, subnet in tries:
                try:
                    return self._launch(req, instance_type, subnet, group, image)
                except ClientError as exc:
                    if code(exc) == GROUP_NOT_FOUND:
                        self._group.forget(group)
                    if code(exc) not in NEXT_ZONE_CODES:
                        raise
                    log.info(
                        "%s in subnet %s refused %s: %s; trying the next",
                        instance_type,
                        subnet,
                        req.name,
                        exc,
                    )
                    refused.append(exc)
            raise self._no_zone_takes(tries, refused)

    def get(self, provider_id: str) -> Instance:
        """The instance's state; a terminated one is NotFound, with why it ended.

        EC2 lists a terminated instance for about an hour after, but it is
        gone for good (and no longer billed): for the contract, it no longer
        exists.
        """
        instance_id = parse_provider_id(provider_id)
        with edge():
            found = self._describe(instance_id)
        if found is None:
            self._unless_gone(instance_id)
            raise NotFound(f"EC2: instance {instance_id} is not listed")
        if found.get("State", {}).get("Name") == "terminated":
            ended = to_instance(found)
            why = f": {ended.reason}" if ended.reason else ""
            raise NotFound(
                f"EC2: instance {instance_id} is terminated{why}", disruption=ended.disruption
            )
        with edge():
            return self._with_readiness(found)

    def delete(self, provider_id: str) -> None:
        """Terminate our instance, and only that one; an instance already gone is success.

        The instance is read first and its tags checked: one of another
        installation, or one made by hand, is Permanent. Gone means gone
        only once EC2 could show it (providers.aws.consistency): while an
        instance not listed is young, its absence is Transient, so the
        delete is asked again (and finds it once EC2 lists it) instead of
        reported done.
        """
        instance_id = parse_provider_id(provider_id)
        with self._lock:
            self._console.pop(instance_id, None)
        with edge():
            found = self._describe(instance_id)
            if found is None:
                self._unless_gone(instance_id)
                return
            if found.get("State", {}).get("Name") == "terminated":
                return
            mismatch = ownership_mismatch(tag_dict(found.get("Tags", [])), self._installation)
            if mismatch:
                raise Permanent(f"delete instance {instance_id}: refused, {mismatch}")
            try:
                self._ec2.terminate_instances(InstanceIds=[instance_id])
            except ClientError as exc:
                if code(exc) != INSTANCE_NOT_FOUND:
                    raise
                # EC2 listed it a moment ago: a NotFound from TerminateInstances
                # means it "might still be running", never that it ended.
                raise Transient(
                    f"delete instance {instance_id}: TerminateInstances says it does not exist, "
                    "but EC2 listed it; terminating again"
                ) from exc

    def replacement_advised(self, provider_id: str) -> str | None:
        """REBALANCE_REASON once EC2 recommended rebalancing this spot instance, else None.

        EC2 says so inside the instance only (IMDS); the user data's watcher
        reports it on the serial console, read here at most every
        `advice_interval`. On-demand instances get none: no call is made.
        """
        if self._settings.market != "spot":
            return None
        instance_id = parse_provider_id(provider_id)
        with edge():
            report = self._console_report(instance_id, self._advice_interval)
        return REBALANCE_REASON if report.rebalance else None

    def replacements_advised(self, serving: Mapping[str, str]) -> dict[str, Advice]:
        """The spot instances serving these owners that EC2 recommended rebalancing, by owner.

        A pool's monitor knows its members by endpoint, not by instance id:
        the installation's running spot instances are listed (one paged
        DescribeInstances, again once `advice_interval` old, shared by every
        shard this worker runs) and matched by owner tag and endpoint; an
        owner's newest match first, the one it serves from once a rotation
        is done. Each instance's console is read at most every
        `advice_interval`, its first read at a random point within it, so a
        fleet listed at once is not read in the same second. On-demand
        instances get no advice, and no call is made.
        """
        if self._settings.market != "spot" or not serving:
            return {}
        advised: dict[str, Advice] = {}
        with edge():
            listed = self._spot_instances()
            for owner, endpoint in serving.items():
                for instance_id in listed.get((owner, endpoint), []):
                    report = self._advice_report(instance_id)
                    if report is not None and report.rebalance:
                        advised[owner] = Advice(instance_id, REBALANCE_REASON)
                        break
        return advised

    def list_by_tag(self, key: str, value: str) -> list[Instance]:
        """Every instance not yet terminated carrying `key=value`, in the provider's region.

        EC2 filter values take `*` and `?` as wildcards, so the exact tag is
        checked again here.
        """
        with edge():
            pages = self._ec2.get_paginator("describe_instances").paginate(
                Filters=[
                    {"Name": f"tag:{key}", "Values": [value]},
                    {"Name": "instance-state-name", "Values": LIVE_STATES},
                ]
            )
            found = [
                to_instance(ec2)
                for page in pages
                for reservation in page["Reservations"]
                for ec2 in reservation.get("Instances", [])
            ]
        return [inst for inst in found if inst.tags.get(key) == value]

    # -- advice for pools ----------------------------------------------------

    def _spot_instances(self) -> dict[tuple[str, str], list[str]]:
        """The installation's running spot instances by (owner, endpoint), newest first.

        Listed again once `advice_interval` old. EC2 filter values take `*`
        and `?` as wildcards, so the installation tag is checked again here.
        """
        with self._listing_lock:
            if (
                self._spot_listing is not None
                and time.monotonic() - self._spot_listing[1] < self._advice_interval
            ):
                return self._spot_listing[0]
            pages = self._ec2.get_paginator("describe_instances").paginate(
                Filters=[
                    {"Name": f"tag:{INSTALLATION_KEY}", "Values": [self._installation]},
                    {"Name": "instance-state-name", "Values": ["running"]},
                    {"Name": "instance-lifecycle", "Values": ["spot"]},
                ],
                PaginationConfig={"PageSize": LISTING_PAGE},
            )
            found = [
                to_instance(ec2)
                for page in pages
                for reservation in page["Reservations"]
                for ec2 in reservation.get("Instances", [])
            ]
            listed: dict[tuple[str, str], list[str]] = {}
            for instance in sorted(found, key=lambda i: i.created_at, reverse=True):
                owner = instance.tags.get(OWNER_KEY)
                ours = instance.tags.get(INSTALLATION_KEY) == self._installation
                if owner and instance.endpoint and ours:
                    listed.setdefault((owner, instance.endpoint), []).append(instance.provider_id)
            current = {instance_id for ids in listed.values() for instance_id in ids}
            with self._lock:
                # Instances no longer listed are forgotten: the schedule stays fleet-sized.
                self._advice_due = {i: due for i, due in self._advice_due.items() if i in current}
            self._spot_listing = (listed, time.monotonic())
            return listed

    def _advice_report(self, instance_id: str) -> ConsoleReport | None:
        """The instance's console as last read, read again when its advice read is due.

        None before its first read: an instance first listed waits a random
        part of `advice_interval` for it.
        """
        now = time.monotonic()
        with self._lock:
            due = self._advice_due.setdefault(
                instance_id, now + random.uniform(0, self._advice_interval)
            )
            if now < due:
                known = self._console.get(instance_id)
                return None if known is None else known[0]
            self._advice_due[instance_id] = now + self._advice_interval
        return self._console_report(instance_id, self._advice_interval)

    # -- instances ----------------------------------------------------------

    def _launch(
        self, req: CreateRequest, instance_type: str, subnet: str, group: str, image: str
    ) -> Instance:
        try:
            answer = self._ec2.run_instances(
                **self._run_params(req, instance_type, subnet, group, image)
            )
        except ClientError as exc:
            if code(exc) != IDEMPOTENT_MISMATCH:
                raise
            # The token launched an instance with other parameters (another
            # subnet, a newer image): that instance is this request's, in
            # whatever state. One that has ended is adopted TERMINATED, and
            # the workflow replaces it under a name (and token) of its own.
            made = self._by_token(req.name)
            if made is not None:
                return self._adopt(req, made)
            if self._sightings.young(f"client-token:{req.name}"):
                raise Transient(
                    f"create {req.name}: EC2 says its client token was used, but the instance "
                    "is not listed yet"
                ) from exc
            raise NotFound(
                f"create {req.name}: its client token was used by an instance EC2 no longer "
                "lists (it ended over an hour ago); the name cannot launch again"
            ) from exc
        return self._adopt(req, answer["Instances"][0])

    def _run_params(
        self, req: CreateRequest, instance_type: str, subnet: str, group: str, image: str
    ) -> Any:
        s = self._settings
        tags = as_tag_list({**req.tags, NAME_TAG: req.name, PORT_TAG: str(req.proxy.port)})
        params: dict[str, Any] = {
            "ClientToken": req.name,
            "ImageId": image,
            "InstanceType": instance_type,
            "MinCount": 1,
            "MaxCount": 1,
            "UserData": user_data(req.proxy, spot=s.market == "spot", name=req.name),
            "NetworkInterfaces": [
                {
                    "DeviceIndex": 0,
                    "SubnetId": subnet,
                    "Groups": [group],
                    "AssociatePublicIpAddress": True,
                    "DeleteOnTermination": True,
                }
            ],
            # IMDSv2 only, one hop: a token needs a PUT from the instance
            # itself, so nothing a proxy user sends can read the user data.
            "MetadataOptions": {
                "HttpTokens": "required",
                "HttpEndpoint": "enabled",
                "HttpPutResponseHopLimit": 1,
            },
            "InstanceInitiatedShutdownBehavior": "terminate",
            # The root volume said in full, not left to the AMI and the
            # account's defaults: a custom image could keep its volume
            # after termination (billing on) or leave it unencrypted.
            "BlockDeviceMappings": [self._root_volume(image)],
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": tags},
                # Billing and volume listings show whose disk it is.
                {"ResourceType": "volume", "Tags": tags},
            ],
            # No IAM instance profile: a proxy needs no AWS API access, so a
            # compromised one has no credentials to steal.
        }
        if BURSTABLE.match(instance_type):  # t2, t3, t3a, t4g; not trn1 (no credits)
            params["CreditSpecification"] = {"CpuCredits": s.cpu_credits}
        if s.market == "spot":
            spot: dict[str, Any] = {
                "SpotInstanceType": "one-time",
                "InstanceInterruptionBehavior": "terminate",
            }
            if s.max_price is not None:
                spot["MaxPrice"] = s.max_price
            params["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": spot}
        return params

    def _adopt(self, req: CreateRequest, ec2: InstanceTypeDef) -> Instance:
        """The instance of the requested name, if it is the one this request made."""
        mismatch = adoption_mismatch(tag_dict(ec2.get("Tags", [])), self._installation, req.tags)
        if mismatch:
            raise Permanent(
                f"create instance {req.name}: an instance of that name exists "
                f"({ec2.get('InstanceId')}) and is not this proxy's, {mismatch}"
            )
        self._sightings.seen(ec2.get("InstanceId", ""), ec2.get("LaunchTime"))
        return self._with_readiness(ec2)

    def _no_zone_takes(self, tries: list[tuple[str, str]], refused: list[ClientError]) -> Exception:
        """What to raise when every (type, subnet) refused the launch (`refused`, one each).

        Capacity and spot price change by the minute (QuotaExceeded, from
        the edge); a type offered in none of the zones is a config error.
        """
        waits = [exc for exc in refused if code(exc) != UNSUPPORTED]
        if waits:
            return waits[0]
        types = ", ".join(dict.fromkeys(instance_type for instance_type, _ in tries))
        subnets = ", ".join(dict.fromkeys(subnet for _, subnet in tries))
        return Permanent(
            f"aws.instance_type: {types} is not offered in the availability zone of any of "
            f"the subnets tried ({subnets}): "
            f"{refused[-1].response.get('Error', {}).get('Message', '')}",
            cause=refused[-1],
        )

    def _subnet_order(self, req: CreateRequest) -> list[str]:
        """The pinned subnet, or all of them starting at one derived from the name.

        Derived, so a retried create asks the same subnet first (and sends
        the same parameters with its client token), while a pool's members
        spread over the availability zones.
        """
        pinned = req.placement.get("subnet")
        if pinned:
            return [pinned]
        subnets = self._settings.subnets
        start = int.from_bytes(hashlib.sha256(req.name.encode()).digest()[:4], "big") % len(subnets)
        return subnets[start:] + subnets[:start]

    def _vpc_of(self, subnets: list[str]) -> str:
        """The VPC of the configured subnets; they must share one (the security group's).

        Their availability zones are kept too, for the instance type's offerings.
        """
        if self._vpc is not None:
            return self._vpc
        found = self._ec2.describe_subnets(SubnetIds=subnets)["Subnets"]
        vpcs = sorted({s["VpcId"] for s in found if "VpcId" in s})
        if len(vpcs) != 1:
            raise Permanent(
                f"aws.subnets: the subnets must be in one VPC, they are in {', '.join(vpcs)}"
            )
        self._zones = {
            s["SubnetId"]: s.get("AvailabilityZone", "") for s in found if "SubnetId" in s
        }
        self._vpc = vpcs[0]
        return self._vpc

    def _offering(self, subnets: list[str]) -> list[tuple[str, str]]:
        """What to try, in order: each configured type in `subnets` whose zone offers it.

        Type by type, so the first type is tried in every zone before the
        next. Each type is checked once per provider
        (providers.aws.instance_type): one that is not Nitro, or offered in
        no zone, fails the create as a config error naming `aws.instance_type`.
        """
        if self._offered is None:
            self._offered = {
                instance_type: frozenset(
                    offering_subnets(self._ec2, instance_type, self._zones, self._settings.region)
                )
                for instance_type in self._settings.instance_type
            }
        tries = [
            (instance_type, subnet)
            for instance_type, offered in self._offered.items()
            for subnet in subnets
            if subnet in offered
        ]
        if not tries:
            raise Permanent(
                f"placement.subnet: {subnets[0]} is in {self._zones.get(subnets[0])}, which "
                f"offers none of aws.instance_type {', '.join(self._settings.instance_type)}"
            )
        return tries

    def _image_id(self) -> str:
        """The configured image, or the newest available one of the owner and name."""
        s = self._settings
        if s.image_id is not None:
            return s.image_id
        with self._lock:
            if self._image is not None and time.monotonic() - self._image[1] < IMAGE_CACHE_SECONDS:
                return self._image[0]
        images = self._ec2.describe_images(
            Owners=[s.image_owner],
            Filters=[
                {"Name": "name", "Values": [s.image_name]},
                {"Name": "state", "Values": ["available"]},
            ],
        )["Images"]
        if not images:
            raise Permanent(
                f"aws.image_name: no available image named {s.image_name!r} owned by "
                f"{s.image_owner} in {s.region}"
            )
        newest = max(images, key=lambda image: image.get("CreationDate", ""))["ImageId"]
        with self._lock:
            self._image = (newest, time.monotonic())
        return newest

    def _root_volume(self, image: str) -> Any:
        """The image's root device as an encrypted gp3 volume deleted with the instance.

        Its name and size are the image's (`/dev/xvda` and 8 GiB on Debian's):
        a smaller size would be refused, the name is what the mapping replaces.
        """
        with self._lock:
            known = self._root_volumes.get(image)
        if known is None:
            images = self._ec2.describe_images(ImageIds=[image])["Images"]
            found = images[0] if images else {}
            device = found.get("RootDeviceName", "")
            if not device:
                raise Permanent(f"aws.image_id: image {image} has no root device EC2 describes")
            size = next(
                (
                    mapping.get("Ebs", {}).get("VolumeSize")
                    for mapping in found.get("BlockDeviceMappings", [])
                    if mapping.get("DeviceName") == device
                ),
                None,
            )
            known = (device, size)
            with self._lock:
                self._root_volumes[image] = known
        device, size = known
        ebs: dict[str, Any] = {"VolumeType": "gp3", "Encrypted": True, "DeleteOnTermination": True}
        if size:
            ebs["VolumeSize"] = size
        return {"DeviceName": device, "Ebs": ebs}

    def _describe(self, instance_id: str) -> InstanceTypeDef | None:
        """The instance as EC2 lists it, None if it does not (yet, or any more)."""
        try:
            answer = self._ec2.describe_instances(InstanceIds=[instance_id])
        except ClientError as exc:
            if code(exc) != INSTANCE_NOT_FOUND:
                raise
            return None
        found = first(list(answer["Reservations"]))
        if found is not None:
            self._sightings.seen(instance_id, found.get("LaunchTime"))
        return found

    def _unless_gone(self, instance_id: str) -> None:
        """Transient while EC2 may not show the instance yet; returns once it is gone for good."""
        if self._sightings.young(instance_id):
            raise Transient(
                f"EC2: instance {instance_id} is not listed yet (EC2 shows a new instance "
                f"within minutes; gone only after {self._sightings.window:g}s)"
            )

    def _by_token(self, token: str) -> InstanceTypeDef | None:
        """The instance RunInstances made with client token `token`, in any state."""
        answer = self._ec2.describe_instances(Filters=[{"Name": "client-token", "Values": [token]}])
        return first(list(answer["Reservations"]))

    def _by_filter(self, selector: FilterTypeDef) -> InstanceTypeDef | None:
        """The one instance not yet terminated that `selector` picks, if any."""
        answer = self._ec2.describe_instances(
            Filters=[selector, {"Name": "instance-state-name", "Values": LIVE_STATES}]
        )
        return first(list(answer["Reservations"]))

    # -- readiness ----------------------------------------------------------

    def _with_readiness(self, ec2: InstanceTypeDef) -> Instance:
        """The instance, RUNNING only once its user data reports Squid ready.

        A script that reports a failure ends the instance (TERMINATED with
        its reason), so the workflow replaces it at once instead of waiting
        out its deadline.
        """
        instance = to_instance(ec2)
        if instance.state is not InstanceState.RUNNING:
            return instance
        report = self._console_report(instance.provider_id, self._console_interval).state
        notice = interruption_notice(report)
        if notice is not None:
            # TERMINATED, not STOPPED or PROVISIONING: the monitor's check
            # after a failed probe (the script stops Squid on the notice) then
            # returns `gone` at once instead of after failure_threshold
            # probes, and the lifecycle retires it and brings up the next
            # generation, up to two minutes before EC2 reclaims it.
            return dataclasses.replace(
                instance,
                state=InstanceState.TERMINATED,
                ip="",
                exit_address=None,
                reason=notice,
                disruption=Disruption.SPOT_INTERRUPTED,
            )
        return with_report(instance, report, script="user data", machine="instance")

    def _console_report(self, instance_id: str, max_age: float) -> ConsoleReport:
        """The user data's last reports on the serial console, read again once `max_age` old."""
        with self._lock:
            known = self._console.get(instance_id)
        final = (
            known is not None
            and known[0].state == STARTUP_READY
            and self._settings.market != "spot"
        )
        if known is not None and (final or time.monotonic() - known[1] < max_age):
            return known[0]
        # Latest: the console as it is now (Nitro instances), not the buffer
        # EC2 posts at state transitions only.
        try:
            answer = self._ec2.get_console_output(InstanceId=instance_id, Latest=True)
        except ClientError as exc:
            if code(exc) != INSTANCE_NOT_FOUND:
                raise
            # DescribeInstances listed it: the console API does not show it yet.
            return known[0] if known is not None else ConsoleReport(STARTUP_BOOTING)
        report = console_report(answer.get("Output"))
        with self._lock:
            self._console[instance_id] = (report, time.monotonic())
        return report
