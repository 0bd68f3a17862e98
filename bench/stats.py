"""The one percentile every benchmark reports.

Nearest rank (the definition in Hyndman & Fan 1996 type 1, and the one the
"p99" of latency SLOs usually means): the p-th percentile of n values is the
smallest value with at least p% of the values at or below it, the value of
rank ceil(p/100 * n) in ascending order. Why this one rather than an
interpolating formula: it is always a value that was measured (a probe that
took 812 ms, not a blend of two), and it never reports a tail better than the
data: with 100 gaps, p99 is the 99th smallest, so "p99 <= 11 s" means 99 of
the 100 gaps really were. `statistics.quantiles` interpolates and so does not
have either property.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], p: float) -> float:
    """The nearest-rank `p`-th percentile (0 < p <= 100) of `values`; NaN for no values."""
    if not 0 < p <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {p}")
    if not values:
        return float("nan")
    ordered = sorted(values)
    # p * n first: p / 100 * n loses exactness (0.07 * 100 == 7.000000000000001).
    rank = math.ceil(p * len(ordered) / 100)
    return ordered[max(1, rank) - 1]
