"""The benchmarks' one percentile: nearest rank, always a measured value."""

from __future__ import annotations

import math

import pytest

from bench.stats import percentile


def test_a_percentile_is_the_smallest_value_with_that_share_at_or_below_it() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # unsorted on purpose

    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile(values, 100) == 100
    # 7% of 100 is exactly rank 7, however 0.07 rounds in binary.
    assert percentile(values, 7) == 7


def test_a_percentile_is_never_a_value_between_two_measurements() -> None:
    assert percentile([10.0, 20.0], 50) == 10.0
    assert percentile([10.0, 20.0], 51) == 20.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 1000.0], 99) == 1000.0


def test_no_values_have_no_percentile() -> None:
    assert math.isnan(percentile([], 99))


@pytest.mark.parametrize("p", [0, -1, 101])
def test_a_percentile_outside_0_to_100_is_refused(p: float) -> None:
    with pytest.raises(ValueError, match="percentile must be in"):
        percentile([1.0], p)
