"""The soak's verdicts (upward trends) and the footprint parsed from ``/metrics``."""

from __future__ import annotations

import pytest

from omnigate.loadtest.footprint import FootprintUnavailable, parse_footprint
from omnigate.loadtest.trend import least_squares_slope, trend


def test_slope_of_a_line() -> None:
    assert least_squares_slope([1.0, 3.0, 5.0, 7.0]) == pytest.approx(2.0)
    assert least_squares_slope([5.0]) == 0.0


def test_steady_growth_is_upward() -> None:
    verdict = trend("rss", [100.0, 110.0, 120.0, 130.0, 140.0, 150.0], tolerance=20.0, warm_up=1)
    assert verdict.upward and verdict.rise == pytest.approx(40.0) and verdict.samples == 5


def test_flat_noise_and_warm_up_growth_are_not_upward() -> None:
    assert not trend("rss", [100.0, 104.0, 99.0, 103.0, 100.0, 102.0], tolerance=10.0).upward
    # Growth confined to the warm-up sample does not count.
    assert not trend("rss", [50.0, 100.0, 101.0, 100.0, 101.0], tolerance=10.0, warm_up=1).upward


def test_one_late_spike_alone_is_not_a_trend() -> None:
    assert not trend("ttfa", [100.0, 100.0, 100.0, 100.0, 100.0, 400.0], tolerance=60.0, warm_up=0).upward


def test_missing_samples_are_skipped_and_few_samples_never_trend() -> None:
    verdict = trend("fds", [None, 10.0, None, 30.0], tolerance=1.0, warm_up=0)
    assert verdict.samples == 2 and not verdict.upward


METRICS = """\
# TYPE omnigate_sessions_active gauge
omnigate_sessions_active{transport="ws-speech"} 2.0
omnigate_sessions_active{transport="http-speech"} 1.0
# TYPE omnigate_engine_streams_active gauge
omnigate_engine_streams_active 3.0
# TYPE omnigate_event_loop_tasks gauge
omnigate_event_loop_tasks 17.0
# TYPE process_open_fds gauge
process_open_fds 42.0
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 1.048576e+08
"""


def test_footprint_sums_sessions_over_transports() -> None:
    footprint = parse_footprint(METRICS)
    assert (footprint.sessions, footprint.engine_streams, footprint.tasks, footprint.open_fds) == (3, 3, 17, 42)
    assert footprint.rss_mib == pytest.approx(100.0)


def test_footprint_needs_the_process_series() -> None:
    with pytest.raises(FootprintUnavailable, match="process_open_fds"):
        parse_footprint("# TYPE omnigate_event_loop_tasks gauge\nomnigate_event_loop_tasks 1.0\n")
