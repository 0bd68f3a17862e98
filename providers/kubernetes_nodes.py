"""The exit address of a Kubernetes proxy: its node's external IP, when the node has one.

A Pod's requests to the internet leave through its node: SNAT to the node's
address (most clusters' default), or a cluster NAT gateway when the nodes
have no external address, which no API of the cluster names. So the exit
the provider reports is the node's `ExternalIP`, or None when the node has
none or the worker may not read nodes. Reading nodes needs `get` on the
cluster-scoped `nodes` resource, which the default manifests do not grant
(deploy/kubernetes/node-addresses/ does, for operators who want it;
docs/providers.md, "Exit addresses"); without it every exit is None and
nothing else changes.
"""

from __future__ import annotations

import logging
import threading
import time

from kubernetes import client
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)

# The verbs this module uses, on top of the provider's namespaced ones; the
# optional ClusterRole grants exactly these (a test keeps the two identical).
NODE_RBAC_VERBS: dict[str, tuple[str, ...]] = {"nodes": ("get",)}
# A node's address is read again after this long: external IPs of cloud
# nodes rarely change, and a fleet of Pods on few nodes costs few reads.
NODE_CACHE_SECONDS = 300.0
_FORBIDDEN = 403


class NodeAddresses:
    """Node name -> external IP (or None), read with `get nodes` and cached."""

    def __init__(self, core: client.CoreV1Api, timeout: float) -> None:
        self._core = core
        self._timeout = timeout
        self._lock = threading.Lock()
        self._known: dict[str, tuple[str | None, float]] = {}
        # Set once the API server refused: never asked again by this worker.
        self._refused = False

    def exit_of(self, node_name: str) -> str | None:
        """The node's ExternalIP, or None (no such address, not allowed, or unreadable now)."""
        with self._lock:
            if self._refused:
                return None
            known = self._known.get(node_name)
            if known is not None and time.monotonic() - known[1] < NODE_CACHE_SECONDS:
                return known[0]
        try:
            node = self._core.read_node(node_name, _request_timeout=self._timeout)
        except ApiException as exc:
            if exc.status == _FORBIDDEN:
                log.info(
                    "exit addresses of Kubernetes proxies are unknown: the worker may not "
                    "get nodes (deploy/kubernetes/node-addresses grants it)"
                )
                with self._lock:
                    self._refused = True
            return None
        except Exception as exc:  # optional information: never fail a `get` for it
            log.debug("cannot read node %s: %s", node_name, exc)
            return None
        addresses = (node.status.addresses if node.status else None) or []
        external = next((a.address for a in addresses if a.type == "ExternalIP"), None)
        with self._lock:
            self._known[node_name] = (external, time.monotonic())
        return external
