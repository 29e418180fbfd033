"""Percentiles and distributions of the load-test report."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnigate.loadtest.stats import Distribution, distribution, percentile, ratio


def test_percentiles_of_a_known_sample() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 100.0
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 90) == pytest.approx(90.1)


def test_percentile_of_one_value_is_that_value() -> None:
    assert percentile([7.0], 99) == 7.0


def test_percentile_rejects_empty_samples_and_bad_ranks() -> None:
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match="outside"):
        percentile([1.0], 101)


@given(
    values=st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=1, max_size=200),
    q=st.floats(min_value=0, max_value=100),
)
def test_percentile_matches_numpy_linear_interpolation(values: list[float], q: float) -> None:
    assert percentile(sorted(values), q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-6)


def test_distribution_reports_count_and_ordered_statistics() -> None:
    summary = distribution([5.0, 1.0, 3.0, 2.0, 4.0])
    assert summary.count == 5
    assert summary.min == 1.0
    assert summary.max == 5.0
    assert summary.mean == pytest.approx(3.0)
    assert summary.p50 == 3.0
    assert summary.p50 <= summary.p90 <= summary.p95 <= summary.p99 <= summary.max  # type: ignore[operator]


def test_distribution_of_nothing_has_a_zero_count_and_no_statistics() -> None:
    assert distribution([]) == Distribution(count=0)


def test_ratio_is_none_without_a_usable_denominator() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(3.0, 0.0) is None
    assert ratio(None, 2.0) is None
    assert ratio(3.0, None) is None
