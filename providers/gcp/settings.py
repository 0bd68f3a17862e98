"""The `gcp:` block of a provider entry, and what the whole config must get right for it.

Each entry is checked on its own by the model (zones fit the subnetwork);
`config_problems` checks what entries and the shared proxy defaults must
agree on (an IPv4 range to open, one firewall rule per network and tag).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Annotated

from pydantic import Field, model_validator

from providers.config import Config, ProviderSettings
from providers.gcp.naming import firewall_name

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


def network_path(project: str, network: str) -> str:
    """A network as `projects/<p>/global/networks/<n>`, however it was written."""
    path = network.split("/compute/v1/", 1)[-1]
    return path if path.startswith("projects/") else f"projects/{project}/{path}"


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
        if network_path(settings.project, settings.network) != network_path(
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
