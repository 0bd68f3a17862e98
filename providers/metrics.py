"""A decorator that meters any provider and normalises its errors at the edge.

Every call is counted and timed per provider, operation and outcome (`ok` or
the taxonomy class). An exception outside the taxonomy is wrapped as
Transient here, so callers only ever see the four classes of providers.errors.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from providers.base import CreateRequest, Instance, Provider
from providers.errors import classify

T = TypeVar("T")


class ProviderMetrics:
    """The Prometheus series; one set per registry (tests use a fresh one)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        labels = ("provider", "operation", "outcome")
        self.calls = Counter(
            "proxy_operator_provider_calls",
            "Provider operations by outcome (ok or the error class).",
            labels,
            registry=registry,
        )
        self.latency = Histogram(
            "proxy_operator_provider_call_seconds",
            "Provider operation latency.",
            labels,
            registry=registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )


_default_metrics: ProviderMetrics | None = None


def default_metrics() -> ProviderMetrics:
    global _default_metrics
    if _default_metrics is None:
        _default_metrics = ProviderMetrics()
    return _default_metrics


class MeteredProvider:
    """Wraps a provider; same contract, plus metrics and error normalisation."""

    def __init__(self, inner: Provider, name: str, metrics: ProviderMetrics | None = None) -> None:
        self.inner = inner
        self.name = name
        self._metrics = metrics or default_metrics()

    def create(self, req: CreateRequest) -> Instance:
        return self._call("create", lambda: self.inner.create(req))

    def get(self, provider_id: str) -> Instance:
        return self._call("get", lambda: self.inner.get(provider_id))

    def delete(self, provider_id: str) -> None:
        self._call("delete", lambda: self.inner.delete(provider_id))

    def list_by_tag(self, key: str, value: str) -> list[Instance]:
        return self._call("list_by_tag", lambda: self.inner.list_by_tag(key, value))

    def _call(self, operation: str, fn: Callable[[], T]) -> T:
        start = time.monotonic()
        outcome = "ok"
        try:
            return fn()
        except Exception as exc:
            error = classify(exc)
            outcome = type(error).__name__
            if error is exc:
                raise
            raise error from exc
        finally:
            labels = (self.name, operation, outcome)
            self._metrics.calls.labels(*labels).inc()
            self._metrics.latency.labels(*labels).observe(time.monotonic() - start)
