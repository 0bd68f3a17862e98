"""The Grafana dashboard only charts metrics the worker really exports."""

from __future__ import annotations

import json
from pathlib import Path

from tests.deploy.series import exported_series, selected_series

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "dashboards" / "proxy-operator.json"


def test_every_proxy_operator_series_charted_is_exported() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    charted = {s for e in expressions for s in selected_series(e)}
    ours = {s for s in charted if s.startswith("proxy_operator_")}
    assert ours, "the dashboard charts our own series"
    assert ours <= exported_series()
