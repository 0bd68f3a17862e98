"""Prometheus series for what activities do besides provider calls."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

PROBES = Counter(
    "proxy_operator_probes",
    "CONNECT probes by provider and outcome (ok or the failure class).",
    ("provider", "outcome"),
)
PROBE_SECONDS = Histogram(
    "proxy_operator_probe_seconds",
    "CONNECT probe latency, successful probes only.",
    ("provider",),
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
ORPHANS_FOUND = Counter(
    "proxy_operator_orphans_found",
    "Instances orphan GC confirmed nobody owns (dry runs included).",
    ("provider",),
)
ORPHANS_DELETED = Counter(
    "proxy_operator_orphans_deleted",
    "Orphaned instances orphan GC deleted and saw gone.",
    ("provider",),
)
POOL_MONITOR_LATE_SECONDS = Histogram(
    "proxy_operator_pool_monitor_late_seconds",
    "How late a pool shard's round of probes started, after its interval (0: on time).",
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60),
)
