"""The installation's firewall rule: the proxy port, open to `allowed_cidrs` only.

One VPC firewall rule per installation admits the proxy port for VMs carrying
the installation's network tag. It belongs to the installation, so a rule
widened by hand is put back, and a rule of that name on another network is
somebody else's.
"""

from __future__ import annotations

import ipaddress
import threading

from google.api_core import exceptions as api_exceptions
from google.cloud import compute_v1

from providers.errors import Permanent
from providers.gcp.operations import CALL_TIMEOUT_SECONDS, Waiter, wait_succeeded
from providers.gcp.settings import network_path
from providers.squid import ProxySettings


class InstallationFirewall:
    """Keeps the rule `name` admitting every proxy port asked for, from IPv4 CIDRs only."""

    def __init__(
        self,
        *,
        project: str,
        name: str,
        network: str,
        target_tag: str,
        firewalls: compute_v1.FirewallsClient,
        wait: Waiter,
        operation_timeout: float,
    ) -> None:
        self._project = project
        self._name = name
        self._network = network
        self._target_tag = target_tag
        self._firewalls = firewalls
        self._wait = wait
        self._operation_timeout = operation_timeout
        # (port, IPv4 CIDRs) pairs the rule is known to admit. The rule is
        # checked once per pair and provider object, not per create.
        self._ensured: set[tuple[int, tuple[str, ...]]] = set()
        self._lock = threading.Lock()

    def ensure(self, proxy: ProxySettings, deadline: float) -> None:
        """Make the rule admit `proxy`'s port from its IPv4 CIDRs only.

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
        with self._lock:
            if key in self._ensured:
                return
            existing = self._get()
            if existing is None:
                try:
                    op = self._firewalls.insert_unary(
                        project=self._project,
                        firewall_resource=self._rule({proxy.port}, cidrs),
                        retry=None,
                        timeout=CALL_TIMEOUT_SECONDS,
                    )
                    wait_succeeded(op, deadline, self._wait, self._operation_timeout)
                except api_exceptions.Conflict:
                    existing = self._get()
            if existing is not None:
                self._check_network(existing)
                wanted = self._rule(_tcp_ports(existing) | {proxy.port}, cidrs)
                if _rule_shape(existing) != _rule_shape(wanted):
                    op = self._firewalls.update_unary(
                        project=self._project,
                        firewall=self._name,
                        firewall_resource=wanted,
                        retry=None,
                        timeout=CALL_TIMEOUT_SECONDS,
                    )
                    wait_succeeded(op, deadline, self._wait, self._operation_timeout)
            self._ensured.add(key)

    def _check_network(self, rule: compute_v1.Firewall) -> None:
        theirs = network_path(self._project, rule.network)
        ours = network_path(self._project, self._network)
        if theirs != ours:
            raise Permanent(
                f"firewall rule {self._name!r} is on network {theirs!r}, but this "
                f"provider's VMs are on {ours!r}; rule names are unique per project: set "
                "gcp.firewall_rule to a name of its own"
            )

    def _get(self) -> compute_v1.Firewall | None:
        try:
            return self._firewalls.get(
                project=self._project,
                firewall=self._name,
                retry=None,
                timeout=CALL_TIMEOUT_SECONDS,
            )
        except api_exceptions.NotFound:
            return None

    def _rule(self, ports: set[int], cidrs: tuple[str, ...]) -> compute_v1.Firewall:
        return compute_v1.Firewall(
            name=self._name,
            description="proxy-operator: the proxy port, from allowed_cidrs only",
            network=self._network,
            direction="INGRESS",
            allowed=[compute_v1.Allowed(I_p_protocol="tcp", ports=[str(p) for p in sorted(ports)])],
            source_ranges=list(cidrs),
            target_tags=[self._target_tag],
            disabled=False,
        )


def _ipv4_ranges(cidrs: tuple[str, ...]) -> tuple[str, ...]:
    """The IPv4 ranges, sorted: a VPC firewall rule holds one family only
    ("either IPv4 or IPv6 ranges, but not both", firewall/docs/using-firewalls),
    and the VMs have an IPv4 external address only."""
    return tuple(sorted(c for c in cidrs if ipaddress.ip_network(c).version == 4))


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
