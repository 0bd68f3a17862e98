"""The networks a gateway's members must be in: the second wall around membership.

Every member a gateway's router forwards to receives the fleet's Proxy-Authorization with
each request it carries. The pool's `endpoints` answer is meant to come only
from sources a namespace user cannot write (docs/security.md), but should a
forged endpoint get through, the gateway itself refuses to make it a parent
unless its address is in the networks the operator declared for members
(`--member-networks`, by default what the providers config says: the local
provider's bind address). A host that is not an IP address is refused too,
unless the operator allows hostnames: a name can resolve anywhere, and the
router resolves it after this check. Each refused endpoint is logged and counted
once, when it first appears in the pool's answer; the credentials are never
in the log line.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from gateway import metrics
from providers.config import Config
from squid.gateway import GatewayMember

log = logging.getLogger("proxy_operator.gateway")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# A pool's answer is not trusted: a member id in a log line is cut to this.
MAX_LOGGED_MEMBER = 80


def parse_networks(value: str, flag: str) -> tuple[Network, ...]:
    """`CIDR,CIDR,...` as networks; ValueError naming `flag` and every bad entry."""
    networks: list[Network] = []
    bad: list[str] = []
    for item in (part.strip() for part in value.split(",")):
        try:
            networks.append(ipaddress.ip_network(item, strict=True))
        except ValueError as err:
            bad.append(f"bad CIDR {item!r}: {err}")
    if bad:
        raise ValueError(f"{flag}: {'; '.join(bad)}")
    return tuple(networks)


def configured_networks(config: Config, flag: str) -> tuple[Network, ...]:
    """The member networks the providers config implies; ValueError if it cannot tell.

    Each provider type says where its instances get addresses
    (`ProviderSettings.member_networks`): the local provider its bind address.
    Pod IPs and VM addresses are nothing the config names, so a config with a
    Kubernetes or GCP entry needs `flag` set, and the error says which entries.
    """
    networks: list[Network] = []
    unknown: list[str] = []
    for i, entry in enumerate(config.providers):
        declared = entry.settings.member_networks()
        if declared is None:
            unknown.append(f"providers[{i}] ({entry.name}, type {entry.type})")
        else:
            networks += (ipaddress.ip_network(cidr) for cidr in declared)
    if unknown:
        raise ValueError(
            f"{flag} is required: the providers config does not say which addresses the "
            f"instances of {', '.join(unknown)} get (e.g. the cluster's Pod CIDR, the "
            "VMs' external ranges)"
        )
    return tuple(dict.fromkeys(networks))


@dataclass(frozen=True)
class MemberNetworks:
    """Where a parent may be: `networks`, and any hostname if `allow_hostnames`."""

    networks: tuple[Network, ...]
    allow_hostnames: bool = False

    def refusal(self, host: str) -> tuple[str, str] | None:
        """(metric reason, why) if a parent at `host` is refused, else None."""
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            if self.allow_hostnames:
                return None
            return (
                metrics.REFUSED_HOSTNAME,
                "a hostname, not an IP address (allow with --allow-member-hostnames)",
            )
        if any(address in network for network in self.networks):
            return None
        allowed = ", ".join(str(network) for network in self.networks)
        return metrics.REFUSED_NETWORK, f"outside the member networks ({allowed})"


class Gatekeeper:
    """Filters the pool's answers; reports each refused endpoint once while it stays."""

    def __init__(self, allowed: MemberNetworks) -> None:
        self.allowed = allowed
        self._refused: frozenset[GatewayMember] = frozenset()
        # Each host of the latest answer and its refusal (None: admitted). A pool's
        # answer changes by a member or two at a time, and parsing an address is
        # most of what admitting 1,000 members costs.
        self._verdicts: dict[str, tuple[str, str] | None] = {}

    def admit(self, members: Sequence[GatewayMember]) -> list[GatewayMember]:
        """The members whose endpoints may be parents."""
        admitted: list[GatewayMember] = []
        refused: set[GatewayMember] = set()
        known, verdicts = self._verdicts, {}
        for member in members:
            host = member.host
            refusal = known[host] if host in known else self.allowed.refusal(host)
            verdicts[host] = refusal
            if refusal is None:
                admitted.append(member)
                continue
            refused.add(member)
            if member not in self._refused:
                reason, why = refusal
                metrics.REFUSED_ENDPOINTS.labels(reason=reason).inc()
                log.warning(
                    "refusing member %r at %s:%d as a parent: %s",
                    member.member[:MAX_LOGGED_MEMBER],
                    member.host[:MAX_LOGGED_MEMBER],
                    member.port,
                    why,
                )
        # Only what the latest answer holds: bounded however many a forger sends.
        self._refused = frozenset(refused)
        self._verdicts = verdicts
        return admitted
