"""The `aws:` block of a provider entry, and what the whole config must get right for it."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from providers.config import Config, ProviderSettings

# Region names such as `eu-west-1`, `us-gov-west-1`, `ap-southeast-4`.
REGION_NAME = r"^[a-z]{2}(-[a-z]+)+-[0-9]$"
# Resource ids: a prefix and 8 or 17 hex digits (EC2 "Resource IDs").
SUBNET_ID = r"^subnet-[0-9a-f]{8}([0-9a-f]{9})?$"
AMI_ID = r"^ami-[0-9a-f]{8}([0-9a-f]{9})?$"
# `t3.micro`, `m7g.large`, `c6in.xlarge`.
INSTANCE_TYPE = r"^[a-z][a-z0-9-]*\.[a-z0-9]+$"
# An AWS account id (the image owner), or an owner alias.
IMAGE_OWNER = r"^([0-9]{12}|amazon|aws-marketplace|self)$"
# Debian's own account, which publishes the official Debian AMIs
# (https://wiki.debian.org/Cloud/AmazonEC2Image).
DEBIAN_OWNER = "136693071363"
DEBIAN_12_AMD64 = "debian-12-amd64-*"
# Security group names: up to 255 ASCII characters; kept to a safe subset.
GROUP_NAME = r"^[A-Za-z0-9][A-Za-z0-9 ._\-:/()#,@\[\]+=&;{}!$*]{0,254}$"
# Subnets a create may try, the first one derived from the instance name.
MAX_SUBNETS = 6
# Instance types a create may try, in order, in each subnet.
MAX_INSTANCE_TYPES = 6

SubnetId = Annotated[str, Field(pattern=SUBNET_ID)]


class AwsConfig(ProviderSettings):
    """EC2 instances with public IPs; credentials come from the default AWS chain only."""

    region: Annotated[str, Field(pattern=REGION_NAME)]
    # One VPC; each subnet in its availability zone. Instances spread over
    # them, and a create that finds no capacity in one tries the next.
    subnets: Annotated[list[SubnetId], Field(min_length=1, max_length=MAX_SUBNETS)]
    # One type, or several to try in order: a launch that meets no capacity,
    # `Unsupported` or a spot price above `max_price` in every subnet with one
    # type tries the next (spot capacity differs by type). Given as a string
    # or a list; read as a list.
    instance_type: Annotated[
        list[Annotated[str, Field(pattern=INSTANCE_TYPE)]],
        Field(default_factory=lambda: ["t3.micro"], min_length=1, max_length=MAX_INSTANCE_TYPES),
    ]
    # A fixed image, or the newest image of `image_owner` named `image_name`
    # (Debian 12 for x86_64 by default; `debian-12-arm64-*` for Graviton types).
    image_id: Annotated[str, Field(pattern=AMI_ID)] | None = None
    image_owner: Annotated[str, Field(pattern=IMAGE_OWNER)] = DEBIAN_OWNER
    image_name: Annotated[str, Field(min_length=1, max_length=128)] = DEBIAN_12_AMD64
    market: Literal["on-demand", "spot"] = "on-demand"
    # Burstable (T family) types launch with this CPU-credit mode. EC2's
    # default for t3, t3a and t4g is unlimited, which bills surplus credits
    # when a busy proxy runs above its baseline; standard throttles instead.
    cpu_credits: Literal["standard", "unlimited"] = "standard"
    # The most to pay per instance hour, in USD; unset pays up to the
    # on-demand price (the EC2 default and AWS's recommendation).
    max_price: str | None = None
    # The installation's security group. Default `proxy-operator-<installation>`.
    security_group: Annotated[str, Field(pattern=GROUP_NAME)] | None = None

    @field_validator("instance_type", mode="before")
    @classmethod
    def _one_or_several(cls, types: object) -> object:
        return [types] if isinstance(types, str) else types

    @field_validator("subnets", "instance_type")
    @classmethod
    def _distinct(cls, subnets: list[str]) -> list[str]:
        repeated = sorted({s for s in subnets if subnets.count(s) > 1})
        if repeated:
            raise ValueError(f"listed more than once: {', '.join(repeated)}")
        return subnets

    @field_validator("max_price")
    @classmethod
    def _a_price(cls, price: str | None) -> str | None:
        if price is None:
            return None
        try:
            value = Decimal(price)
        except InvalidOperation:
            raise ValueError(f"{price!r} is not a price in USD such as '0.0050'") from None
        if not value.is_finite() or value <= 0 or price.strip() != price or "e" in price.lower():
            raise ValueError(f"{price!r} is not a positive price in USD such as '0.0050'")
        return price

    @model_validator(mode="after")
    def _price_needs_spot(self) -> AwsConfig:
        if self.max_price is not None and self.market != "spot":
            raise ValueError("max_price: only for market: spot (on-demand has a fixed price)")
        return self

    def placement_problems(self, placement: Mapping[str, str]) -> list[str]:
        """A workflow may pin one of the configured subnets, nothing else."""
        subnet = placement.get("subnet")
        if subnet is None or subnet in self.subnets:
            return []
        return [f"placement.subnet: {subnet!r} is not one of this provider's subnets"]


def config_problems(config: Config) -> list[str]:
    """EC2 instances get a public IPv4 address only: some client must reach them on IPv4."""
    if any(ipaddress.ip_network(c).version == 4 for c in config.proxy.allowed_cidrs):
        return []
    return [
        f"proxy.allowed_cidrs: no IPv4 range, but providers[{i}] ({entry.name}) is of type "
        "aws, whose instances are reachable on a public IPv4 address only"
        for i, entry in enumerate(config.providers)
        if isinstance(entry.settings, AwsConfig)
    ]
