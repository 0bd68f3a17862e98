"""The configured instance type, checked once against what EC2 says of it.

Readiness is read from the serial console with GetConsoleOutput
`Latest=True`, which EC2 serves for instances built on the Nitro System
only ("Instance console output", EC2 User Guide): on a Xen type (t2, m4,
c4, ...) the user data's "ready" never shows, and every proxy would be
written off after its wait. And a type not offered in a subnet's
availability zone fails every launch there with `Unsupported`. Both are
config errors the first create finds with two describe calls, instead of a
crash loop per proxy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from botocore.exceptions import ClientError

from providers.aws.errors import code
from providers.errors import Permanent

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client

# DescribeInstanceTypes' answer for a type that does not exist in the region.
INVALID_INSTANCE_TYPE = "InvalidInstanceType"
NITRO = "nitro"
FIELD = "aws.instance_type"


def offering_subnets(
    ec2: EC2Client, instance_type: str, zones: Mapping[str, str], region: str
) -> list[str]:
    """The subnets (of `zones`, subnet -> availability zone) whose zone offers the type.

    Permanent, naming `aws.instance_type`, for a type the region does not
    have, one not built on Nitro, or one offered in none of the zones.
    """
    try:
        [described] = ec2.describe_instance_types(InstanceTypes=[instance_type])[  # type: ignore[list-item]
            "InstanceTypes"
        ]
    except ClientError as exc:
        if code(exc) != INVALID_INSTANCE_TYPE:
            raise
        raise Permanent(
            f"{FIELD}: {instance_type} is not an instance type EC2 offers in {region}",
            cause=exc,
        ) from exc
    # Bare metal types run on Nitro hardware without a hypervisor, so EC2
    # reports no Hypervisor for them.
    hypervisor = described.get("Hypervisor", "")
    if hypervisor != NITRO and not described.get("BareMetal", False):
        raise Permanent(
            f"{FIELD}: {instance_type} is not built on the Nitro System (hypervisor "
            f"{hypervisor or 'unknown'}); readiness is read from the serial console, whose "
            "latest output EC2 serves on Nitro types only. Choose a Nitro type such as "
            "t3.micro, t3a.micro or m7i.large"
        )
    offerings = ec2.get_paginator("describe_instance_type_offerings").paginate(
        LocationType="availability-zone",
        Filters=[{"Name": "instance-type", "Values": [instance_type]}],
    )
    offered = {
        offering.get("Location", "")
        for page in offerings
        for offering in page["InstanceTypeOfferings"]
    }
    subnets = [subnet for subnet, zone in zones.items() if zone in offered]
    if not subnets:
        where = ", ".join(f"{subnet} ({zone})" for subnet, zone in zones.items())
        raise Permanent(
            f"{FIELD}: {instance_type} is not offered in the availability zone of any "
            f"configured subnet: {where}; it is offered in {', '.join(sorted(offered)) or 'none'}"
        )
    return subnets
