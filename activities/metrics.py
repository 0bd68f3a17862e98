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
