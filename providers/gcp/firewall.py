"""The installation's firewall rule: the proxy port, open to `allowed_cidrs` only.

One VPC firewall rule per installation admits the proxy port for VMs carrying
the installation's network tag. It belongs to the installation, so a rule
widened by hand is put back, and a rule of that name on another network is
somebody else's.

A rule can change under a running worker: deleted by hand, or replaced by
another worker's update (firewall rules carry no fingerprint, and `update`
takes no precondition: firewall/docs/using-firewalls, and the API reference
of firewalls.update). So a check is trusted for a few minutes only, a VM's
failed probe makes the rule suspect at once (`doubt`), and every write is
read back until the rule is seen right.
"""

from __future__ import annotations

import contextlib
import ipaddress
import threading
import time

from google.api_core import exceptions as api_exceptions
from google.cloud import compute_v1

from providers.errors import Permanent, Transient
from providers.gcp.operations import CALL_TIMEOUT_SECONDS, Waiter, wait_succeeded
from providers.gcp.settings import network_path
from squid.conf import ProxySettings

# How long a check of the rule is trusted. A rule deleted or narrowed by
# hand, or by another writer, is put back by the first create after this.
RECHECK_SECONDS = 300.0
# A VM's failed probe makes the rule suspect; it is checked again at once,
# but at most this often, however many VMs fail at the same time (a fleet
# of 1,000 booting VMs costs two reads a minute, not a thousand).
DOUBT_INTERVAL_SECONDS = 30.0
# Firewall rules have no fingerprint and `update` takes no precondition, so
# two writers adding ports can each replace the other's: every write is read
# back, and a port a concurrent writer dropped is merged in and written
# again, at most this many writes per check.
MAX_WRITES = 3


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
        recheck_seconds: float = RECHECK_SECONDS,
        doubt_interval: float = DOUBT_INTERVAL_SECONDS,
    ) -> None:
        self._project = project
        self._name = name
        self._network = network
        self._target_tag = target_tag
        self._firewalls = firewalls
        self._wait = wait
        self._operation_timeout = operation_timeout
        self._recheck_seconds = recheck_seconds
        self._doubt_interval = doubt_interval
        # (port, IPv4 CIDRs) -> when the rule was last seen admitting them
        # (time.monotonic()). Trusted for `recheck_seconds`, and not past a doubt.
        self._checked: dict[tuple[int, tuple[str, ...]], float] = {}
        self._doubted_at = float("-inf")
        self._lock = threading.Lock()

    def ensure(self, proxy: ProxySettings, deadline: float) -> None:
        """Make the rule admit `proxy`'s port from its IPv4 CIDRs only.

        Checked when the last check is older than `recheck_seconds` or a VM
        has failed a probe since (`doubt`), so a rule deleted by hand is
        recreated and a port another writer dropped is put back.
        """
        key = (proxy.port, _admitted_ranges(proxy))
        with self._lock:
            checked = self._checked.get(key)
            if (
                checked is not None
                and checked > self._doubted_at
                and time.monotonic() - checked < self._recheck_seconds
            ):
                return
            self._converge(*key, deadline)

    def doubt(self, proxy: ProxySettings, deadline: float) -> None:
        """A VM on `proxy`'s port failed a probe: check the rule again now, if not just checked.

        The next `ensure` of every port checks it again too (the create of
        a replacement, say). Within `doubt_interval` of the last check, that
        is all: however many VMs fail at once, the rule is read once per
        interval.
        """
        key = (proxy.port, _admitted_ranges(proxy))
        with self._lock:
            now = time.monotonic()
            self._doubted_at = now
            if now - max(self._checked.values(), default=float("-inf")) >= self._doubt_interval:
                self._converge(*key, deadline)

    def _converge(self, port: int, cidrs: tuple[str, ...], deadline: float) -> None:
        """Insert the rule if missing, replace it if it differs, until a read shows it right.

        A 409 on insert (a racing worker inserted it) and an update a
        concurrent writer overwrote are both read again. Ports of earlier
        proxies, and of other writers, are kept, since running VMs may still
        listen on them; anything else the rule holds is put back (it belongs
        to the installation). A rule of that name on another network is
        somebody else's: Permanent. Still wrong after MAX_WRITES writes:
        Transient, and the next check starts over.
        """
        for writes in range(MAX_WRITES + 1):
            existing = self._get()
            if existing is not None:
                self._check_network(existing)
                wanted = self._rule(_tcp_ports(existing) | {port}, cidrs)
                if _rule_shape(existing) == _rule_shape(wanted):
                    self._checked[port, cidrs] = time.monotonic()
                    return
            if writes == MAX_WRITES:
                break
            if existing is None:
                with contextlib.suppress(api_exceptions.Conflict):
                    op = self._firewalls.insert_unary(
                        project=self._project,
                        firewall_resource=self._rule({port}, cidrs),
                        retry=None,
                        timeout=CALL_TIMEOUT_SECONDS,
                    )
                    wait_succeeded(op, deadline, self._wait, self._operation_timeout)
            else:
                op = self._firewalls.update_unary(
                    project=self._project,
                    firewall=self._name,
                    firewall_resource=wanted,
                    retry=None,
                    timeout=CALL_TIMEOUT_SECONDS,
                )
                wait_succeeded(op, deadline, self._wait, self._operation_timeout)
        raise Transient(
            f"firewall rule {self._name!r} still does not admit port {port} from "
            f"{', '.join(cidrs)} after {MAX_WRITES} writes, each read back: another writer "
            "keeps changing it"
        )

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


def _admitted_ranges(proxy: ProxySettings) -> tuple[str, ...]:
    """`proxy`'s IPv4 allowed CIDRs; Permanent if there are none."""
    cidrs = _ipv4_ranges(proxy.allowed_cidrs)
    if not cidrs:
        # An ingress rule without source ranges admits 0.0.0.0/0.
        raise Permanent(
            "proxy.allowed_cidrs has no IPv4 range: a GCP proxy VM is reachable on its "
            "IPv4 external address only, and refusing to open the proxy port to everyone"
        )
    return cidrs


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
