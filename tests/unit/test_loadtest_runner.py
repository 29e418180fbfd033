"""Levels run by the runner against fake targets: long sessions are measured, unfinished ones fail the level.

The fake targets pace utterances with short sleeps of their own (the stand-in for a server's reply time); nothing is
synchronized on time, and no assertion depends on how long anything took.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from omnigate.loadtest.arrivals import ClosedLoop
from omnigate.loadtest.report import TargetSpec, consistency_problems
from omnigate.loadtest.runner import LevelRun, LevelSettings
from omnigate.loadtest.targets.base import SessionSettings, Target
from omnigate.loadtest.traces import SessionTrace

CHUNK_BYTES = 1920  # 40 ms at 24 kHz


def level_settings(duration_s: float, warmup_s: float, drain_s: float) -> LevelSettings:
    return LevelSettings(
        duration_s=duration_s,
        warmup_s=warmup_s,
        drain_s=drain_s,
        seed=0,
        utterances_per_session=1_000,
        jitter_ms=0.0,
        slo_ttfa_ms=10_000.0,
        metrics_interval_s=1.0,
        scrape_metrics=False,
    )


class LongCallTarget(Target):
    """A call that talks as long as it may: one 40 ms reply per utterance, until the level stops new ones."""

    kind = "test-long-call"

    async def run_session(self, texts: Sequence[str], trace: SessionTrace) -> None:
        trace.connected(time.perf_counter())
        for text in texts:
            if not trace.may_begin_utterance(time.perf_counter()):
                return
            utterance = trace.begin_utterance(time.perf_counter(), text)
            utterance.text_sent(time.perf_counter(), len(text))
            await asyncio.sleep(0.02)
            utterance.audio(time.perf_counter(), CHUNK_BYTES)
            utterance.finish(time.perf_counter(), "completed")


class StuckTarget(Target):
    """Every utterance waits for audio that never comes."""

    kind = "test-stuck"

    async def run_session(self, texts: Sequence[str], trace: SessionTrace) -> None:
        trace.connected(time.perf_counter())
        trace.begin_utterance(time.perf_counter(), texts[0])
        await asyncio.Event().wait()


def target(kind: type[Target]) -> Target:
    return kind(TargetSpec(label=kind.kind, target=kind.kind, url="ws://127.0.0.1:1"), SessionSettings())


async def test_a_level_whose_sessions_all_start_during_the_ramp_still_measures() -> None:
    arrival = ClosedLoop(sessions=4, ramp_s=0.1)
    level = LevelRun(target(LongCallTarget), arrival, level_settings(1.0, 0.4, 5.0), ["Hello there."])
    report, traces = await level.run(None)
    assert report.sessions.started == 4, "every session lasted the whole level"
    assert all(trace.started_s - traces.start_s < 0.4 for trace in traces.traces)
    assert report.sessions.measured == 4
    assert report.utterances.completed == report.utterances.total > 0
    assert report.utterances.cut_off == 0, "sessions stop beginning utterances when the level stops"
    assert report.slo.passed, report.slo.reasons
    assert consistency_problems(report) == []


async def test_utterances_still_running_at_the_end_of_the_drain_fail_the_level() -> None:
    level = LevelRun(target(StuckTarget), ClosedLoop(sessions=2), level_settings(0.3, 0.0, 0.1), ["Hello there."])
    report, _ = await level.run(None)
    assert report.utterances.cut_off == 2
    assert report.sessions.cut_off == 2
    assert not report.slo.passed
    assert "2 utterances cut off at the end of the drain" in report.slo.reasons
