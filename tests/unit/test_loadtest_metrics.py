"""Reading the server's Prometheus metrics back."""

from __future__ import annotations

import os

from omnigate.loadtest.metrics import MetricsSampler, parse_metrics, process_exists, summarize_series

EXPOSITION = """\
# HELP omnigate_sessions_active Live sessions
# TYPE omnigate_sessions_active gauge
omnigate_sessions_active{transport="ws-speech"} 3.0
# HELP omnigate_engine_aborted_total Engine streams aborted
# TYPE omnigate_engine_aborted_total counter
omnigate_engine_aborted_total{engine="synthetic"} 5.0
omnigate_engine_aborted_created{engine="synthetic"} 1.7e9
# HELP omnigate_ttfa_seconds TTFA
# TYPE omnigate_ttfa_seconds histogram
omnigate_ttfa_seconds_bucket{le="0.1",transport="ws-speech"} 2.0
omnigate_ttfa_seconds_bucket{le="+Inf",transport="ws-speech"} 3.0
omnigate_ttfa_seconds_count{transport="ws-speech"} 3.0
omnigate_ttfa_seconds_sum{transport="ws-speech"} 0.4
"""


def test_parse_metrics_keys_series_by_name_and_sorted_labels() -> None:
    samples = parse_metrics(EXPOSITION)
    assert samples['omnigate_sessions_active{transport="ws-speech"}'] == ("gauge", 3.0)
    assert samples['omnigate_engine_aborted_total{engine="synthetic"}'] == ("counter", 5.0)
    assert samples['omnigate_ttfa_seconds_bucket{le="0.1",transport="ws-speech"}'] == ("histogram", 2.0)
    assert not any("_created" in key for key in samples)


def test_series_summaries_over_scrapes() -> None:
    first = parse_metrics(EXPOSITION)
    second = parse_metrics(
        EXPOSITION.replace('"ws-speech"} 3.0', '"ws-speech"} 7.0').replace('"synthetic"} 5.0', '"synthetic"} 9.0')
    )
    series = {s.name: s for s in summarize_series([first, second, first | {}])}
    active = series['omnigate_sessions_active{transport="ws-speech"}']
    assert (active.first, active.max, active.last, active.mean) == (3.0, 7.0, 3.0, (3.0 + 7.0 + 3.0) / 3)
    aborted = series['omnigate_engine_aborted_total{engine="synthetic"}']
    assert aborted.kind == "counter"
    assert aborted.delta == 0.0
    assert summarize_series([first, second])[1].delta == 4.0


def test_no_scrapes_give_no_series() -> None:
    assert summarize_series([]) == []


async def test_a_local_server_process_is_sampled_with_psutil() -> None:
    sampler = MetricsSampler(None, "http://unused/metrics", 1.0, server_pid=os.getpid())
    await sampler.scrape()
    await sampler.scrape()
    series = {s.name: s for s in sampler.summary()}
    assert series["server_process_resident_memory_bytes"].last > 0
    assert series["server_process_cpu_seconds_total"].delta >= 0
    assert series["server_process_threads"].min >= 1
    assert sampler.error == "not scraped"
    assert process_exists(os.getpid())
