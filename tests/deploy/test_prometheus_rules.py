"""deploy/prometheus/proxy-operator-rules.yml: alerts that can fire.

An alert over a series the worker does not export, or over a label value it
never sets (outcome="PermanentError"), is valid PromQL and silent forever. So
every expression is parsed and checked against what the worker really exports;
where promtool is installed (Debian's `prometheus` package), it checks the
file too and runs the unit tests in proxy-operator-rules.test.yml, which feed
worker-shaped series and say which alerts fire.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from activities.probe import FAILURES
from gateway.metrics import REFUSED_REASONS, RELOAD_OUTCOMES
from providers.errors import TAXONOMY
from tests.deploy.series import exported_series, matchers, selected_series

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = PROMETHEUS / "proxy-operator-rules.yml"
RULE_TESTS = PROMETHEUS / "proxy-operator-rules.test.yml"
# The compose Prometheus's jobs: the worker and the gateway. Rules outside
# compose keep these names.
SCRAPE_JOBS = {
    job["job_name"]
    for job in yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())["scrape_configs"]
}
# Label values the worker sets, per series and label.
LABEL_VALUES = {
    ("proxy_operator_provider_calls_total", "outcome"): {"ok", *(c.__name__ for c in TAXONOMY)},
    ("proxy_operator_probes_total", "outcome"): {"ok", *FAILURES},
    ("proxy_operator_gateway_reloads_total", "outcome"): set(RELOAD_OUTCOMES),
    ("proxy_operator_gateway_refused_endpoints_total", "reason"): set(REFUSED_REASONS),
    ("up", "job"): SCRAPE_JOBS,
}
SEVERITIES = {"critical", "warning", "info"}


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def unknown_label_values(expr: str) -> list[str]:
    """Equality and regex matchers naming a value the worker never sets."""
    problems = []
    for m in matchers(expr):
        known = LABEL_VALUES.get((m.series, m.label))
        if known is None:
            continue
        values = m.value.split("|") if m.op in ("=~", "!~") else [m.value]
        problems += [f"{m.series}{{{m.label}{m.op}{v!r}}}" for v in values if v not in known]
    return problems


def test_every_rule_is_a_documented_alert() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)), "alert names are unique"
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_every_alert_reads_series_the_worker_exports() -> None:
    exported = exported_series() | {"up"}  # `up` is Prometheus's own, per scrape target
    for rule in alert_rules():
        read = selected_series(rule["expr"])
        assert read, rule["alert"]
        assert read <= exported, f"{rule['alert']} reads {sorted(read - exported)}"


def test_every_label_value_an_alert_matches_is_one_the_worker_sets() -> None:
    for rule in alert_rules():
        assert unknown_label_values(rule["expr"]) == [], rule["alert"]


def test_the_label_check_catches_a_misspelt_outcome() -> None:
    expr = 'rate(proxy_operator_provider_calls_total{outcome=~"Transient|PermanentError"}[5m])'
    assert unknown_label_values(expr) == [
        "proxy_operator_provider_calls_total{outcome=~'PermanentError'}"
    ]
    assert unknown_label_values('up{job="worker"}') == ["up{job='worker'}"]
    assert unknown_label_values('proxy_operator_gateway_reloads_total{outcome="error"}') == [
        "proxy_operator_gateway_reloads_total{outcome='error'}"
    ]


def test_every_scrape_job_has_a_down_alert() -> None:
    watched = set()
    for rule in alert_rules():
        if selected_series(rule["expr"]) == {"up"}:
            match = re.fullmatch(r'up\{job="([^"]+)"\} == 0', rule["expr"].strip())
            assert match, rule["alert"]
            watched.add(match[1])
    assert watched == SCRAPE_JOBS == {"proxy-operator-worker", "proxy-operator-gateway"}


PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)"
)


@needs_promtool
@pytest.mark.parametrize(
    "args",
    [("check", "rules", RULES.name), ("test", "rules", RULE_TESTS.name)],
    ids=["check", "unit-tests"],
)
def test_promtool_accepts_the_rules(args: tuple[str, ...]) -> None:
    assert PROMTOOL is not None
    run = subprocess.run(
        [PROMTOOL, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
