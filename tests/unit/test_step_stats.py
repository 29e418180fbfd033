"""The engine step counts that cross from the engine core to the gateways' ``/metrics``."""

from __future__ import annotations

import pytest

from omnigate.engines.step_stats import BATCH_BUCKETS, STEP_BUCKETS_S, BusyWindow, StepCounts


def test_steps_land_in_their_buckets() -> None:
    counts = StepCounts()
    counts.observe(0.004, 3)
    counts.observe(0.03, 600)
    counts.observe(9.0, 5000)
    assert counts.step_counts[STEP_BUCKETS_S.index(0.005)] == 1
    assert counts.step_counts[STEP_BUCKETS_S.index(0.05)] == 1
    assert counts.step_counts[-1] == 1  # +Inf
    assert counts.batch_counts[BATCH_BUCKETS.index(4)] == 1
    assert counts.batch_counts[BATCH_BUCKETS.index(1024)] == 1
    assert counts.batch_counts[-1] == 1
    assert counts.step_seconds_total == pytest.approx(9.034) and counts.batch_total == 5603


def test_the_busy_fraction_covers_the_last_window() -> None:
    window = BusyWindow(window_s=5.0, workers=2)
    assert window.sample(0.0, 0.0) == 0.0
    assert window.sample(1.0, 1.0) == pytest.approx(0.5)  # one step-second over one second of two workers
    for t in range(2, 11):
        fraction = window.sample(float(t), 1.0 + 2.0 * (t - 1))  # both workers busy from t=1
    assert fraction == pytest.approx(1.0)  # the idle start has left the window
    assert window.sample(20.0, 19.0) == pytest.approx(0.0)  # idle since t=10: nothing stepped in the window
