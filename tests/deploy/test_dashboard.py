"""The Grafana dashboard only charts metrics the worker really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

import activities.metrics  # noqa: F401  (registers the activity series)
from providers.metrics import default_metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "dashboards" / "proxy-operator.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}


def exported_series() -> set[str]:
    default_metrics()
    names = set()
    for family in REGISTRY.collect():
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names


def test_every_proxy_operator_series_charted_is_exported() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    charted = {m for e in expressions for m in re.findall(r"\bproxy_operator_\w+", e)}
    assert charted, "the dashboard charts our own series"
    assert charted <= exported_series()
