"""Arrival models: seeded Poisson arrivals and closed-loop ramps."""

from __future__ import annotations

import itertools

import pytest

from omnigate.loadtest.arrivals import ClosedLoop, OpenLoop, arrival_label, poisson_arrivals


def test_poisson_arrivals_are_reproducible_by_seed() -> None:
    assert poisson_arrivals(5.0, 60.0, seed=7) == poisson_arrivals(5.0, 60.0, seed=7)
    assert poisson_arrivals(5.0, 60.0, seed=7) != poisson_arrivals(5.0, 60.0, seed=8)


def test_poisson_arrivals_are_ordered_inside_the_window() -> None:
    times = poisson_arrivals(3.0, 20.0, seed=1)
    assert times == sorted(times)
    assert all(0.0 <= t < 20.0 for t in times)


def test_poisson_arrival_count_and_gaps_follow_the_rate() -> None:
    # Seeded, so this is a fixed sample: 10/s over 2000 s gives 20000 +- a few hundred arrivals.
    times = poisson_arrivals(10.0, 2000.0, seed=3)
    assert abs(len(times) - 20_000) < 600
    gaps = [b - a for a, b in itertools.pairwise(times)]
    mean_gap = sum(gaps) / len(gaps)
    assert mean_gap == pytest.approx(0.1, rel=0.05)
    # Exponential gaps: about 1 - 1/e of them are shorter than the mean.
    share_short = sum(1 for g in gaps if g < 0.1) / len(gaps)
    assert share_short == pytest.approx(0.632, abs=0.02)


def test_poisson_rate_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(0.0, 10.0, seed=0)


def test_closed_loop_ramp_spreads_worker_starts_evenly() -> None:
    assert ClosedLoop(sessions=4, ramp_s=2.0).start_offsets() == [0.0, 0.5, 1.0, 1.5]
    assert ClosedLoop(sessions=3).start_offsets() == [0.0, 0.0, 0.0]
    assert ClosedLoop(sessions=0).start_offsets() == []


def test_arrival_labels() -> None:
    assert arrival_label(ClosedLoop(sessions=16)) == "16"
    assert arrival_label(OpenLoop(rate=2.5)) == "2.5/s"
