"""The duplex clock's counters reach ``/metrics``: ticks by how the model ran, lateness, sitting out, step times."""

from __future__ import annotations

from omnigate.engines.duplex.stats import STEP_BUCKETS_S, ClockStats
from omnigate.gateway.ops.metrics import Metrics
from omnigate.gateway.settings import Settings
from omnigate.gateway.state import Gateway
from omnigate.loadtest.metrics import parse_metrics


def test_the_clock_counters_are_exported() -> None:
    stats = ClockStats(ticks=5, late_ticks=2, missed_ticks=1, graph_ticks=4, eager_ticks=1, sat_out=3, sessions=7)
    stats.frames, stats.rows, stats.last_batch, stats.last_frames = 30, 40, 8, 6
    for seconds in (0.05, 0.075, 0.079, 0.3, 3.0):
        stats.observe_step(seconds)
    gateway = Gateway(Settings())
    assert "omnigate_duplex_ticks" not in Metrics(gateway).render().decode()  # no duplex engine: no series
    gateway.duplex_stats = stats
    samples = {key: value for key, (_, value) in parse_metrics(Metrics(gateway).render().decode()).items()}
    assert samples['omnigate_duplex_ticks_total{mode="graph"}'] == 4
    assert samples['omnigate_duplex_ticks_total{mode="eager"}'] == 1
    assert samples["omnigate_duplex_late_ticks_total"] == 2
    assert samples["omnigate_duplex_missed_ticks_total"] == 1
    assert samples["omnigate_duplex_sat_out_total"] == 3
    assert samples["omnigate_duplex_graph_captures_total"] == 0
    assert (samples["omnigate_duplex_frames_total"], samples["omnigate_duplex_rows_total"]) == (30, 40)
    assert (samples["omnigate_duplex_last_batch_size"], samples["omnigate_duplex_last_frames"]) == (8, 6)
    assert samples["omnigate_duplex_sessions"] == 7
    assert samples["omnigate_duplex_step_seconds_max"] == 3.0
    assert samples['omnigate_duplex_step_seconds_bucket{le="0.06"}'] == 1
    assert samples['omnigate_duplex_step_seconds_bucket{le="0.08"}'] == 3  # cumulative: 50, 75 and 79 ms
    assert samples[f'omnigate_duplex_step_seconds_bucket{{le="{STEP_BUCKETS_S[-1]}"}}'] == 4
    assert (
        samples['omnigate_duplex_step_seconds_bucket{le="+Inf"}'] == samples["omnigate_duplex_step_seconds_count"] == 5
    )
    assert abs(samples["omnigate_duplex_step_seconds_sum"] - 3.504) < 1e-9
