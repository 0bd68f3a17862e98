"""The installation's security group: the proxy port, open to `allowed_cidrs` only.

One security group per installation (and VPC) admits TCP on the proxy ports
from `allowed_cidrs`; every proxy instance is launched in it and in nothing
else. It belongs to the installation (tagged like its instances), so an
ingress rule added by hand is revoked, and a group of that name without the
installation's tags is somebody else's.

The group's proxy ports shrink with the config, but never under an instance:
a port is revoked only when no instance in the group listens on it (each is
tagged with its port) and no worker has asked for it for PORT_GRACE_SECONDS,
which each port's own timestamp tag records. The grace covers what a listing
cannot show: an instance another worker launched a moment ago, which EC2 may
not list yet ("Eventual consistency in the Amazon EC2 API").
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from botocore.exceptions import ClientError

from providers.aws.errors import code
from providers.aws.instances import PORT_TAG, as_tag_list, tag_dict
from providers.errors import Permanent, Transient
from providers.naming import (
    INSTALLATION_KEY,
    MANAGED_BY_KEY,
    MANAGED_BY_VALUE,
    ownership_mismatch,
)
from squid.conf import ProxySettings

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client
    from mypy_boto3_ec2.type_defs import IpPermissionOutputTypeDef, SecurityGroupTypeDef

GROUP_PREFIX = "proxy-operator-"
DESCRIPTION = "proxy-operator: the proxy port, from allowed_cidrs only"
# The proxy ports the group admits, as a comma-separated list (the format
# every worker version reads): the ports asked for within the grace period,
# and those instances in the group listen on.
PORTS_TAG = "proxy-operator/ports"
# `proxy-operator/ports/<port>`: when a worker last asked for the port (Unix
# seconds). One tag per port, so workers refreshing different ports never
# overwrite each other's timestamps.
PORT_ASKED_PREFIX = f"{PORTS_TAG}/"
# How long a port stays open after a worker last asked for it, even with no
# instance listed on it; a worker asks again at least every quarter of it.
PORT_GRACE_SECONDS = 3600.0
# The instances whose ports the group must keep admitting.
LISTENING_STATES = ["pending", "running", "stopping", "stopped"]
# One ingress rule: TCP on one port from one network.
Rule = tuple[int, str]
# What another worker (or provider entry) sharing the group may have done
# between this one's describe and its change: the rule is already there, or
# already gone. Either is the state asked for.
RULE_THERE = "InvalidPermission.Duplicate"
RULE_GONE = "InvalidPermission.NotFound"


def group_name(installation: str) -> str:
    return f"{GROUP_PREFIX}{installation}"


class InstallationGroup:
    """Keeps security group `name` in `vpc_id` admitting exactly the proxy ports asked for."""

    def __init__(
        self,
        *,
        ec2: EC2Client,
        name: str,
        installation: str,
        grace: float = PORT_GRACE_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._ec2 = ec2
        self._name = name
        self._installation = installation
        self._grace = grace
        self._clock = clock
        # (vpc, port, CIDRs) made true by this provider object -> (group id,
        # when): checked again once a quarter of the grace has passed, which
        # also renews the port's timestamp while this worker still uses it.
        self._ensured: dict[tuple[str, int, tuple[str, ...]], tuple[str, float]] = {}
        self._lock = threading.Lock()

    def ensure(self, proxy: ProxySettings, vpc_id: str) -> str:
        """The group's id, once it admits `proxy`'s port from its CIDRs and nothing else.

        Other proxy ports are kept while an instance in the group listens on
        them or a worker asked for them within the grace period; any other
        ingress (another port, protocol, source or port range) is revoked.
        """
        cidrs = tuple(sorted(proxy.allowed_cidrs))
        key = (vpc_id, proxy.port, cidrs)
        with self._lock:
            now = self._clock()
            known = self._ensured.get(key)
            if known is not None and now - known[1] < self._grace / 4:
                return known[0]
            group = self._get(vpc_id) or self._create(vpc_id)
            mismatch = ownership_mismatch(tag_dict(group.get("Tags", [])), self._installation)
            if mismatch:
                raise Permanent(
                    f"security group {self._name!r} in {vpc_id} is not this installation's "
                    f"({mismatch}): set aws.security_group to a name of its own"
                )
            group_id = group["GroupId"]
            have = list(group.get("IpPermissions", []))
            ports = self._ports_to_keep(group, vpc_id, proxy.port, now)
            # Recorded before the rules change: a port is only ever opened
            # once the group says it is the proxies'.
            self._record(group, ports, proxy.port, now)
            wanted = {(port, cidr) for port in ports for cidr in cidrs}
            unwanted = [p for p in (_without(perm, wanted) for perm in have) if p]
            if unwanted:
                self._each_unless(
                    self._ec2.revoke_security_group_ingress, group_id, unwanted, RULE_GONE
                )
            missing = wanted - _rules(have)
            if missing:
                self._each_unless(
                    self._ec2.authorize_security_group_ingress,
                    group_id,
                    [_permission(rule) for rule in sorted(missing)],
                    RULE_THERE,
                )
            self._ensured[key] = (group_id, now)
            return group_id

    def forget(self, group_id: str) -> None:
        """EC2 does not know `group_id` (any more): the next `ensure` looks for the group again."""
        with self._lock:
            for key in [k for k, known in self._ensured.items() if known[0] == group_id]:
                del self._ensured[key]

    def _ports_to_keep(
        self, group: SecurityGroupTypeDef, vpc_id: str, port: int, now: float
    ) -> set[int]:
        """`port`, the ports asked for within the grace, and the listed ones instances
        listen on.

        A listed port without a timestamp was recorded by a worker that
        keeps none: its grace starts now. An instance without a port tag
        could listen on any listed port, so then every listed port stays.
        Only listed ports are kept: an instance in another group (another
        entry's) keeps a port open here, never opens one.
        """
        listed = _ports_of(group)
        asked = _asked_of(group)
        recent = {p for p, at in asked.items() if now - at < self._grace}
        in_use = self._ports_in_use(vpc_id)
        in_use_here = listed if in_use is None else listed & in_use
        return {port} | recent | (listed - asked.keys()) | in_use_here

    def _ports_in_use(self, vpc_id: str) -> set[int] | None:
        """The ports of the installation's live instances in the VPC; None if one does not say.

        Every instance of the installation in the VPC (of any provider
        entry) counts, so an entry naming another group keeps its listed
        ports open here at worst, never closes one.
        """
        ports: set[int] = set()
        pages = self._ec2.get_paginator("describe_instances").paginate(
            Filters=[
                {"Name": f"tag:{INSTALLATION_KEY}", "Values": [self._installation]},
                {"Name": "vpc-id", "Values": [vpc_id]},
                {"Name": "instance-state-name", "Values": LISTENING_STATES},
            ]
        )
        for page in pages:
            for reservation in page.get("Reservations", []):
                for instance in reservation.get("Instances", []):
                    port = tag_dict(instance.get("Tags", [])).get(PORT_TAG, "")
                    if not port.isdigit():
                        return None
                    ports.add(int(port))
        return ports

    def _record(self, group: SecurityGroupTypeDef, ports: set[int], port: int, now: float) -> None:
        """Tag the group with `ports`, `port` asked for now, and no timestamps of dropped ports.

        A dropped port's timestamp is deleted only if it still has the value
        read (DeleteTags with a value deletes only on a match), so a worker
        that asked for the port again meanwhile keeps its claim.
        """
        group_id = group["GroupId"]
        asked = _asked_tags(group)
        tags = {
            f"{PORT_ASKED_PREFIX}{p}": str(int(now))
            for p in ports
            if p == port or f"{PORT_ASKED_PREFIX}{p}" not in asked
        }
        if ports != _ports_of(group):
            tags[PORTS_TAG] = ",".join(map(str, sorted(ports)))
        self._ec2.create_tags(Resources=[group_id], Tags=as_tag_list(tags))
        stale = {
            key: value
            for key, value in asked.items()
            if int(key.removeprefix(PORT_ASKED_PREFIX)) not in ports
        }
        if stale:
            self._ec2.delete_tags(Resources=[group_id], Tags=as_tag_list(stale))

    @staticmethod
    def _each_unless(call: Any, group_id: str, permissions: list[Any], done: str) -> None:
        """`call` for all `permissions`; one by one if EC2 answers `done` for the lot.

        EC2 refuses the whole request when one rule is already as asked
        (another worker got there first), so each is then sent alone and
        `done` taken for success.
        """
        try:
            call(GroupId=group_id, IpPermissions=permissions)
        except ClientError as exc:
            if code(exc) != done:
                raise
            for permission in permissions:
                try:
                    call(GroupId=group_id, IpPermissions=[permission])
                except ClientError as each:
                    if code(each) != done:
                        raise

    def _get(self, vpc_id: str) -> SecurityGroupTypeDef | None:
        groups = self._ec2.describe_security_groups(
            Filters=[
                {"Name": "group-name", "Values": [self._name]},
                {"Name": "vpc-id", "Values": [vpc_id]},
            ]
        )["SecurityGroups"]
        return groups[0] if groups else None

    def _create(self, vpc_id: str) -> SecurityGroupTypeDef:
        """The new group as CreateSecurityGroup made it: its id, its tags, no ingress.

        Not described again: EC2 may not list a group for a while after
        creating it ("Eventual consistency in the Amazon EC2 API"), and its
        id is good from the start. Calls naming the id may still answer
        InvalidGroup.NotFound meanwhile, which is Transient (errors.py).
        """
        tags = as_tag_list({MANAGED_BY_KEY: MANAGED_BY_VALUE, INSTALLATION_KEY: self._installation})
        try:
            made = self._ec2.create_security_group(
                GroupName=self._name,
                Description=DESCRIPTION,
                VpcId=vpc_id,
                TagSpecifications=[{"ResourceType": "security-group", "Tags": tags}],
            )
        except ClientError as exc:
            if code(exc) != "InvalidGroup.Duplicate":  # a racing worker made it
                raise
            group = self._get(vpc_id)
            if group is None:
                raise Transient(
                    f"security group {self._name!r} in {vpc_id} exists, but EC2 does not list "
                    "it yet"
                ) from exc
            return group
        return {"GroupId": made["GroupId"], "GroupName": self._name, "Tags": tags}


def _family(cidr: str) -> int:
    return ipaddress.ip_network(cidr).version


def _rules(perms: Iterable[IpPermissionOutputTypeDef]) -> set[Rule]:
    """Single-port TCP rules from networks; everything else is not ours."""
    found: set[Rule] = set()
    for perm in perms:
        if perm.get("IpProtocol") != "tcp" or perm.get("FromPort") != perm.get("ToPort"):
            continue
        port = int(perm.get("FromPort", -1))
        found.update((port, r["CidrIp"]) for r in perm.get("IpRanges", []) if "CidrIp" in r)
        found.update((port, r["CidrIpv6"]) for r in perm.get("Ipv6Ranges", []) if "CidrIpv6" in r)
    return found


def _ports_of(group: SecurityGroupTypeDef) -> set[int]:
    """The proxy ports the group's PORTS_TAG records (rules alone cannot tell ours apart)."""
    recorded = tag_dict(group.get("Tags", [])).get(PORTS_TAG, "")
    return {int(p) for p in recorded.split(",") if _port(p)}


def _asked_tags(group: SecurityGroupTypeDef) -> dict[str, str]:
    """The group's per-port timestamp tags that name a port, by key."""
    return {
        key: value
        for key, value in tag_dict(group.get("Tags", [])).items()
        if key.startswith(PORT_ASKED_PREFIX) and _port(key.removeprefix(PORT_ASKED_PREFIX))
    }


def _asked_of(group: SecurityGroupTypeDef) -> dict[int, float]:
    """Port -> when a worker last asked for it; an unreadable time counts as long ago."""
    return {
        int(key.removeprefix(PORT_ASKED_PREFIX)): float(value) if value.isdigit() else 0.0
        for key, value in _asked_tags(group).items()
    }


def _port(text: str) -> bool:
    return text.isdigit() and 0 < int(text) < 65536


def _without(perm: IpPermissionOutputTypeDef, wanted: set[Rule]) -> Any:
    """The part of `perm` not in `wanted`, as a permission to revoke (None if all wanted)."""
    single_tcp = perm.get("IpProtocol") == "tcp" and perm.get("FromPort") == perm.get("ToPort")
    port = int(perm.get("FromPort", -1))
    extra: dict[str, Any] = {}

    v4 = [r["CidrIp"] for r in perm.get("IpRanges", []) if "CidrIp" in r]
    v6 = [r["CidrIpv6"] for r in perm.get("Ipv6Ranges", []) if "CidrIpv6" in r]
    if unwanted_v4 := [c for c in v4 if not (single_tcp and (port, c) in wanted)]:
        extra["IpRanges"] = [{"CidrIp": c} for c in unwanted_v4]
    if unwanted_v6 := [c for c in v6 if not (single_tcp and (port, c) in wanted)]:
        extra["Ipv6Ranges"] = [{"CidrIpv6": c} for c in unwanted_v6]
    for field in ("UserIdGroupPairs", "PrefixListIds"):
        if perm.get(field):
            extra[field] = perm[field]
    if not extra:
        return None
    revoke: dict[str, Any] = {"IpProtocol": perm.get("IpProtocol", "-1"), **extra}
    if "FromPort" in perm:
        revoke["FromPort"] = perm["FromPort"]
        revoke["ToPort"] = perm.get("ToPort", perm["FromPort"])
    return revoke


def _permission(rule: Rule) -> Any:
    """One TCP permission per port and network, the family's range field set."""
    port, cidr = rule
    field, key = ("IpRanges", "CidrIp") if _family(cidr) == 4 else ("Ipv6Ranges", "CidrIpv6")
    return {"IpProtocol": "tcp", "FromPort": port, "ToPort": port, field: [{key: cidr}]}
