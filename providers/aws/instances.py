"""EC2 instances as the contract's `Instance`: the state table, the tags, the provider id.

Tags live on the instance itself (EC2 keeps them exactly: keys up to 128
characters, values up to 256), so `Instance.tags` round-trips what `create`
was given; the two tags the provider adds for itself are left out of it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from providers.base import Disruption, Instance, InstanceState, public_exit, state_table
from providers.errors import Permanent

if TYPE_CHECKING:
    from mypy_boto3_ec2.type_defs import InstanceTypeDef, TagTypeDef

# Tags this provider owns on every instance: the console shows `Name`.
NAME_TAG = "Name"
PORT_TAG = "proxy-operator/port"
PROVIDER_TAGS = frozenset({NAME_TAG, PORT_TAG})
# EC2's limits on tags (docs: "Tag restrictions").
MAX_TAGS = 50
MAX_TAG_KEY = 128
MAX_TAG_VALUE = 256

# EC2 instance state -> common state (docs: "Amazon EC2 instance state changes").
# RUNNING is only reported once the instance has a public IP and its user
# data reports Squid ready; see `to_instance` and `AwsProvider._with_readiness`.
# shutting-down is TERMINATED already: the instance never comes back from it.
INSTANCE_STATES = state_table(
    {
        InstanceState.PROVISIONING: ("pending",),
        InstanceState.RUNNING: ("running",),
        InstanceState.STOPPED: ("stopping", "stopped"),
        InstanceState.TERMINATED: ("shutting-down", "terminated"),
    }
)
# A state newer than this table is not usable yet, but not proof of death
# either: PROVISIONING lets the workflow's provisioning deadline decide.
_UNKNOWN_STATE = InstanceState.PROVISIONING
# The state reason EC2 gives a spot instance it reclaims (docs: "Spot
# Instance interruptions"; StateReason codes in the API reference).
SPOT_TERMINATION = "Server.SpotInstanceTermination"

INSTANCE_ID = re.compile(r"^i-[0-9a-f]{8}([0-9a-f]{9})?$")


def to_instance(ec2: InstanceTypeDef) -> Instance:
    """The state table applied; readiness is `AwsProvider._with_readiness`'s.

    A spot instance EC2 reclaimed is TERMINATED with the reason said, a
    disruption: its workflow replaces it without spending the crash budget.
    """
    tags = tag_dict(ec2.get("Tags", []))
    ip = ec2.get("PublicIpAddress", "")
    state = INSTANCE_STATES.get(ec2.get("State", {}).get("Name", ""), _UNKNOWN_STATE)
    reason = ""
    disruption: Disruption | None = None
    state_reason = ec2.get("StateReason", {})
    if state_reason.get("Code") == SPOT_TERMINATION:
        state = InstanceState.TERMINATED
        reason = f"spot interruption: {state_reason.get('Message', SPOT_TERMINATION)}"
        disruption = Disruption.SPOT_INTERRUPTED
    if state is InstanceState.RUNNING and not ip:
        state = InstanceState.PROVISIONING  # never publish an empty endpoint
    launched = ec2.get("LaunchTime")
    return Instance(
        provider_id=ec2.get("InstanceId", ""),
        name=tags.get(NAME_TAG, ""),
        state=state,
        ip=ip if state is InstanceState.RUNNING else "",
        port=int(tags.get(PORT_TAG, "0")) if tags.get(PORT_TAG, "").isdigit() else 0,
        tags=owner_tags_of(tags),
        created_at=launched if isinstance(launched, datetime) else datetime.now(UTC),
        reason=reason,
        disruption=disruption,
        # The subnet routes through an internet gateway: no NAT in between.
        exit_address=public_exit(ec2.get("PublicIpAddress", ""), state),
    )


def tag_dict(tags: list[TagTypeDef]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in tags if "Key" in t and "Value" in t}


def owner_tags_of(tags: Mapping[str, str]) -> dict[str, str]:
    """The tags `create` was given: all but the provider's own."""
    return {k: v for k, v in tags.items() if k not in PROVIDER_TAGS}


def tag_problems(tags: Mapping[str, str]) -> list[str]:
    """What EC2 would refuse in `tags`, each naming the tag (the provider adds two)."""
    problems = [
        f"tag {key[:40]!r}: key longer than {MAX_TAG_KEY} characters"
        for key in tags
        if len(key) > MAX_TAG_KEY
    ]
    problems += [
        f"tag {key!r}: value longer than {MAX_TAG_VALUE} characters"
        for key, value in tags.items()
        if len(value) > MAX_TAG_VALUE
    ]
    problems += [
        f"tag {key!r}: keys starting with 'aws:' are AWS's"
        for key in tags
        if key.lower().startswith("aws:")
    ]
    if len(tags) + len(PROVIDER_TAGS) > MAX_TAGS:
        problems.append(f"{len(tags)} tags: EC2 allows {MAX_TAGS} per instance, two are ours")
    return problems


def as_tag_list(tags: Mapping[str, str]) -> list[TagTypeDef]:
    return [{"Key": k, "Value": v} for k, v in sorted(tags.items())]


def parse_provider_id(provider_id: str) -> str:
    """The instance id, checked before it goes into a request."""
    if not INSTANCE_ID.fullmatch(provider_id):
        raise Permanent(f"malformed AWS provider_id {provider_id!r}: expected an instance id i-...")
    return provider_id


def first(reservations: list[Any]) -> InstanceTypeDef | None:
    """The first instance of a DescribeInstances answer's reservations, if any."""
    for reservation in reservations:
        for ec2 in reservation.get("Instances", []):
            found: InstanceTypeDef = ec2
            return found
    return None
