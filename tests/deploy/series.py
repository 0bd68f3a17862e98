"""The series the worker and the gateway export, and the series a PromQL expression reads.

Shared by the checks on what charts and alerts query (the Grafana dashboard,
the Prometheus rules): a query that names a series nobody exports shows an
empty panel or an alert that can never fire, and nothing else would say so.
Expressions are parsed with a real PromQL parser, not matched with regexes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import promql_parser
from prometheus_client import REGISTRY

import activities.metrics  # noqa: F401  (registers the activity series)
import gateway.metrics  # noqa: F401  (registers the gateway's series)
from providers.metrics import default_metrics

# The series the worker re-exports from the Temporal SDK on its /metrics
# (worker.py, `_SdkMetrics`) that charts and alerts read: sdk-core's names
# with the `temporal_` prefix, durations in seconds (`durations_as_seconds`),
# as a worker's scrape shows them once an activity has started; and the
# workflows' own, which the SDK exports as named (tests/test_worker.py).
SDK_SERIES = frozenset(
    {
        "temporal_activity_schedule_to_start_latency_bucket",
        # A pool's own counter (workflows/pool.py), exported through the SDK.
        "proxy_operator_pool_reports_refused_total",
    }
)
# The names Prometheus stores for each metric type prometheus_client exports.
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
# Children of a PromQL AST node that can hold selectors.
_CHILDREN = ("lhs", "rhs", "expr", "args", "vector_selector", "param")


def exported_series() -> set[str]:
    """Every series name the worker's or the gateway's /metrics can serve."""
    default_metrics()
    names = set(SDK_SERIES)
    for family in REGISTRY.collect():
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names


@dataclass(frozen=True)
class Matcher:
    """One label matcher of one selector, e.g. outcome=~"Transient|Permanent"."""

    series: str
    label: str
    op: str  # "=", "!=", "=~" or "!~"
    value: str


def _selectors(node: Any) -> Iterator[Any]:
    if isinstance(node, promql_parser.VectorSelector):
        yield node
    for child in _CHILDREN:
        value = getattr(node, child, None)
        for item in value if isinstance(value, list) else [value]:
            if item is not None:
                yield from _selectors(item)


def _name(selector: Any) -> str:
    if selector.name:
        return str(selector.name)
    (name,) = [m.value for m in selector.matchers.matchers if m.name == "__name__"]
    return str(name)


_OPS = {"Equal": "=", "NotEqual": "!=", "Re": "=~", "NotRe": "!~"}


def selected_series(expr: str) -> set[str]:
    """The series names an expression reads (raises ValueError if it does not parse)."""
    return {_name(s) for s in _selectors(promql_parser.parse(expr))}


def matchers(expr: str) -> list[Matcher]:
    """Every label matcher in an expression, with the series it selects on."""
    return [
        Matcher(_name(s), m.name, _OPS[str(m.op).rsplit(".", 1)[-1]], m.value)
        for s in _selectors(promql_parser.parse(expr))
        for m in s.matchers.matchers
        if m.name != "__name__"
    ]
