"""The provider contract every backend implements (docs/architecture.md, "Providers").

Providers are synchronous, like the cloud SDKs they wrap; activities run them
in threads so the worker's event loop never blocks. Every operation is
idempotent, because Temporal retries activities after crashes and timeouts.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol, runtime_checkable

from squid.conf import ProxySettings


class InstanceState(enum.StrEnum):
    """Common lifecycle states every provider maps its own states onto."""

    PROVISIONING = "PROVISIONING"
    RUNNING = "RUNNING"
    STOPPED = "STOPPED"
    TERMINATED = "TERMINATED"


class Disruption(enum.StrEnum):
    """How a platform took away an instance that did nothing wrong.

    Not the proxy's failure: its workflow replaces the instance without
    spending the crash budget, counts it apart (`status.disruptions`) and
    names it in the reason. An instance gone for a reason its provider cannot
    tell (a VM deleted by hand, or one that crashed) is no disruption.
    """

    # Compute Engine reclaimed a Spot or preemptible VM (a `compute.instances.preempted` operation).
    PREEMPTED = "preempted"
    # EC2 reclaimed a spot instance (its notice, or `Server.SpotInstanceTermination`).
    SPOT_INTERRUPTED = "spot interruption"
    # Kubernetes evicted the Pod (node pressure, a drain, the scheduler's preemption),
    # or a client other than the provider deleted it.
    EVICTED = "evicted"


def state_table(meaning: Mapping[InstanceState, Iterable[str]]) -> dict[str, InstanceState]:
    """A provider's `INSTANCE_STATES`, written as each common state and the states it covers."""
    return {name: state for state, names in meaning.items() for name in names}


@dataclass(frozen=True)
class Instance:
    """One proxy instance as a provider sees it.

    `ip` is empty until a client could use it, and a provider only reports
    RUNNING once `ip` is set, so an empty endpoint is never published.
    """

    provider_id: str
    name: str
    state: InstanceState
    ip: str
    port: int
    tags: dict[str, str]
    created_at: datetime
    # Why the instance is in its state, when the provider knows more than the
    # state says ("image pull failed: ..."); shown to users as is.
    reason: str = ""
    # The address the proxy's traffic leaves from, as the provider knows it
    # (a VM's public IP, a Pod's node's external IP), or None when it does
    # not (a local proxy, a Pod behind a cluster NAT). What a request through
    # the proxy actually shows may differ (a NAT the provider cannot see).
    exit_address: str | None = None
    # Set when the platform is taking (or took) the instance away: a
    # STOPPED or TERMINATED instance that is no failure of the proxy's.
    disruption: Disruption | None = None

    @property
    def endpoint(self) -> str:
        return endpoint(self.ip, self.port)


def public_exit(public_ip: str, state: InstanceState) -> str | None:
    """A VM's exit address: its public IP, while it holds one (not once stopped or ended).

    For providers whose instances send their requests from their own public
    address, with no NAT in between (GCP's external IP, EC2's public IPv4).
    """
    if not public_ip or state in (InstanceState.STOPPED, InstanceState.TERMINATED):
        return None
    return public_ip


def endpoint(ip: str, port: int) -> str:
    """`ip:port` for clients, `[ip]:port` for IPv6 (RFC 3986), "" without an address.

    Brackets keep an IPv6 address's colons apart from the port's, as
    `http_proxy` URLs and `host:port` parsers expect.
    """
    if not ip:
        return ""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


# What str.isspace calls whitespace: a gateway splits every member's endpoint
# at each change of its pool, 1,000 at a time.
_WHITESPACE = re.compile(r"\s")


def split_endpoint(endpoint: str) -> tuple[str, int] | None:
    """`host:port` or `[v6]:port` as (host, port); None if it is neither."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or _WHITESPACE.search(host):
        return None
    return host, int(port)


@dataclass(frozen=True)
class CreateRequest:
    """Everything a provider needs to create one proxy instance.

    `proxy` carries the credentials; it is built inside the worker from its
    config and never travels through a workflow payload.
    """

    name: str
    proxy: ProxySettings
    tags: dict[str, str]
    placement: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class Provider(Protocol):
    """Four idempotent operations; errors are only those of providers.errors."""

    def create(self, req: CreateRequest) -> Instance:
        """Create the instance named `req.name`, or return it if it already exists."""
        ...

    def get(self, provider_id: str) -> Instance:
        """Return the current state; raise NotFound when the instance is gone.

        A NotFound for an instance its platform took away says so
        (`NotFound.disruption`), when the provider can tell.
        """
        ...

    def delete(self, provider_id: str) -> None:
        """Start deleting the instance; an instance already gone is success."""
        ...

    def list_by_tag(self, key: str, value: str) -> list[Instance]:
        """Every instance carrying tag `key=value`, in every zone or namespace it may use."""
        ...


@runtime_checkable
class NamedLookup(Protocol):
    """A provider that can look an instance up by the name `create` gave it.

    Optional: where the platform's list calls cost more quota than a read
    (Compute Engine's aggregated list against a zonal `get`), callers that
    know the name ask this first and list only when it finds nothing.
    """

    def find(self, name: str, placement: Mapping[str, str]) -> Instance | None:
        """The instance named `name` where a create with `placement` may have put it, or None."""
        ...


@runtime_checkable
class AccessCheck(Protocol):
    """A provider that keeps what admits clients to its instances (a cloud firewall rule).

    Optional: such a rule can be deleted or narrowed behind the provider's
    back, and a proxy behind it fails its probes however healthy it is.
    Callers tell the provider when an instance's probe fails, and it checks
    (and repairs) the rule then instead of waiting for its next create.
    """

    def recheck_access(self, provider_id: str, proxy: ProxySettings) -> None:
        """The instance failed a probe on `proxy`'s port: check that clients are admitted."""
        ...


@dataclass(frozen=True)
class Advice:
    """The platform advises replacing this instance soon, and why (the rotation's reason)."""

    provider_id: str
    reason: str


@runtime_checkable
class ReplacementAdvice(Protocol):
    """A provider whose platform may warn that a healthy instance will soon be taken away.

    Optional: the monitor of a Ready instance asks it after its successful
    probes, and on advice asks the proxy's workflow for a make-before-break
    rotation, so the replacement serves before the platform acts. A pool's
    monitor, which knows its members only by their endpoints, asks about a
    whole shard of them at once. The provider paces its platform calls:
    asking often costs nothing more.
    """

    def replacement_advised(self, provider_id: str) -> str | None:
        """Why the platform advises replacing the instance now, or None."""
        ...

    def replacements_advised(self, serving: Mapping[str, str]) -> dict[str, Advice]:
        """Of the instances serving each owner (owner id -> endpoint), those the
        platform advises replacing now, by owner id."""
        ...
