"""Distributions of measured values: percentiles with the sample count, always reported together."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import msgspec


class Distribution(msgspec.Struct, frozen=True):
    """Summary of a sample. Every statistic is ``None`` when there are no samples."""

    count: int
    mean: float | None = None
    min: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of an ascending, non-empty sample, linearly interpolated.

    This is the usual definition (numpy's default, Hyndman-Fan type 7): rank ``q/100 * (n-1)`` between the two
    nearest order statistics.
    """
    if not sorted_values:
        raise ValueError("percentile of an empty sample")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} outside 0..100")
    rank = q / 100.0 * (len(sorted_values) - 1)
    lower = math.floor(rank)
    upper = math.ceil(rank)
    fraction = rank - lower
    return sorted_values[lower] + (sorted_values[upper] - sorted_values[lower]) * fraction


def distribution(values: Iterable[float]) -> Distribution:
    """Summarize a sample (order does not matter)."""
    ordered = sorted(values)
    if not ordered:
        return Distribution(count=0)
    return Distribution(
        count=len(ordered),
        mean=math.fsum(ordered) / len(ordered),
        min=ordered[0],
        p50=percentile(ordered, 50),
        p90=percentile(ordered, 90),
        p95=percentile(ordered, 95),
        p99=percentile(ordered, 99),
        max=ordered[-1],
    )


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or ``None`` when either is missing or the denominator is zero."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator
