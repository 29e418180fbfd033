"""Traces to report: TTFA reference, warm-up exclusion, counts that add up, JSON round trip."""

from __future__ import annotations

import msgspec
import pytest

from omnigate.loadtest.arrivals import ClosedLoop
from omnigate.loadtest.progress import turn_steps_text
from omnigate.loadtest.report import (
    REPORT_VERSION,
    LevelReport,
    LevelTraces,
    LoadTestReport,
    RunSettings,
    TargetSpec,
    comparison_ratios,
    consistency_problems,
    summarize_level,
)
from omnigate.loadtest.traces import SessionTrace, UtteranceTrace

SPEC = TargetSpec(label="ws-speech", target="ws-speech", url="ws://127.0.0.1:1")
CHUNK_BYTES = 1920  # 40 ms at 24 kHz


def stream_text(utterance: UtteranceTrace, start_s: float, words_per_second: float) -> float:
    """Record the text as sent word by word; returns when the last word left."""
    sent = 0
    now_s = start_s
    for index, word in enumerate(utterance.text.split(" ")):
        piece = word if index == len(utterance.text.split(" ")) - 1 else word + " "
        sent += len(piece)
        now_s = start_s + index / words_per_second
        utterance.text_sent(now_s, sent)
    return now_s


def receive_audio(utterance: UtteranceTrace, first_s: float, chunks: int, every_s: float = 0.04) -> float:
    for index in range(chunks):
        utterance.audio(first_s + index * every_s, CHUNK_BYTES)
    return first_s + (chunks - 1) * every_s


def completed_session(session_id: int, start_s: float, gap_s: float = 0.0) -> SessionTrace:
    trace = SessionTrace(session_id, start_s)
    trace.connected(start_s + 0.002)
    utterance = trace.begin_utterance(start_s + 0.002, "Hello there. How are you today?")
    stream_text(utterance, start_s + 0.002, words_per_second=10.0)
    utterance.unit_started("Hello there.", 24_000)
    # "there. " was the second word, sent 0.1 s after the first; first audio 30 ms after that.
    last = receive_audio(utterance, start_s + 0.002 + 0.1 + 0.03, chunks=10)
    utterance.unit_started("How are you today?", 24_000)
    last = receive_audio(utterance, last + 0.04 + gap_s, chunks=10)
    utterance.finish(last + 0.001, "completed")
    trace.end(last + 0.002)
    return trace


def build_level() -> tuple[LevelReport, list[SessionTrace]]:
    traces = [
        completed_session(0, start_s=100.0),  # inside the 1 s warm-up: not measured
        completed_session(1, start_s=101.5),
        completed_session(2, start_s=101.6, gap_s=1.0),  # one underrun
    ]
    failed = SessionTrace(3, 102.0)
    failed.error("http_503", "busy")
    failed.end(102.01)
    cut = SessionTrace(4, 103.0)
    cut.connected(103.001)
    running = cut.begin_utterance(103.001, "Still talking.")
    running.text_sent(103.001, 14)
    running.audio(103.05, CHUNK_BYTES)
    cut.cut_off(104.0)
    traces += [failed, cut]
    report = summarize_level(
        [LevelTraces(traces, 100.0, 5.0)],
        target=SPEC,
        arrival=ClosedLoop(sessions=2),
        round_index=None,
        duration_s=4.0,
        warmup_s=1.0,
        jitter_ms=100.0,
        slo_ttfa_ms=100.0,
        client_cpu_percent=12.0,
        server_metrics=[],
        metrics_error=None,
    )
    return report, traces


def test_ttfa_runs_from_the_end_of_the_first_unit_sent_to_the_first_audio_byte() -> None:
    trace = completed_session(0, start_s=0.0)
    assert trace.utterances[0].ttfa_ms() == pytest.approx(30.0)


def test_ttfa_reference_survives_whitespace_normalization_by_the_server() -> None:
    utterance = UtteranceTrace(0, "One  two.   Three four.", started_s=0.0)
    for index, sent in enumerate((5, 11, 17, 23)):
        utterance.text_sent(float(index), sent)
    utterance.unit_started("One two.", 24_000)
    utterance.audio(1.25, CHUNK_BYTES)
    assert utterance.ttfa_reference_s() == 1.0
    assert utterance.ttfa_ms() == pytest.approx(250.0)


def test_without_unit_text_the_reference_is_the_whole_text_sent() -> None:
    utterance = UtteranceTrace(0, "abc", started_s=0.0)
    utterance.text_sent(2.0, 3)
    utterance.audio(2.5, CHUNK_BYTES)
    assert utterance.ttfa_ms() == pytest.approx(500.0)


def test_session_that_ends_mid_utterance_is_failed_with_a_code() -> None:
    trace = SessionTrace(0, 0.0)
    trace.begin_utterance(0.0, "Hi.")
    trace.end(1.0)
    assert trace.status == "failed"
    assert trace.errors == {"utterance_incomplete": 1}
    assert trace.utterances[0].status == "failed"


def test_level_counts_add_up_and_warm_up_is_excluded() -> None:
    report, _ = build_level()
    assert report.sessions.started == 5
    assert report.sessions.warmup == 1
    assert report.sessions.measured == 4
    assert (report.sessions.completed, report.sessions.failed, report.sessions.cut_off) == (2, 1, 1)
    assert report.utterances.total == 3
    assert (report.utterances.completed, report.utterances.cut_off) == (2, 1)
    assert report.ttfa_ms.count == 2
    assert report.ttfa_ms.p50 == pytest.approx(30.0)
    assert report.underruns == 1
    assert report.utterances.with_underruns == 1
    assert report.errors == {"http_503": 1}
    assert report.error_examples == {"http_503": "busy"}
    assert report.bytes == 2 * 20 * CHUNK_BYTES
    assert report.audio_s == pytest.approx(2 * 20 * 0.04)
    assert not report.slo.passed
    assert consistency_problems(report) == []


def test_slo_passes_only_without_errors_and_underruns_and_with_low_ttfa() -> None:
    traces = [completed_session(i, start_s=0.1 * i) for i in range(3)]
    report = summarize_level(
        [LevelTraces(traces, 0.0, 2.0)],
        target=SPEC,
        arrival=ClosedLoop(sessions=3),
        round_index=None,
        duration_s=2.0,
        warmup_s=0.0,
        jitter_ms=100.0,
        slo_ttfa_ms=100.0,
        client_cpu_percent=None,
        server_metrics=[],
        metrics_error=None,
    )
    assert report.slo.passed, report.slo.reasons
    strict = summarize_level(
        [LevelTraces(traces, 0.0, 2.0)],
        target=SPEC,
        arrival=ClosedLoop(sessions=3),
        round_index=None,
        duration_s=2.0,
        warmup_s=0.0,
        jitter_ms=100.0,
        slo_ttfa_ms=30.0,
        client_cpu_percent=None,
        server_metrics=[],
        metrics_error=None,
    )
    assert not strict.slo.passed
    assert "p99 TTFA" in strict.slo.reasons[0]


def test_throughput_series_covers_every_second_and_sums_to_the_audio_received() -> None:
    report, traces = build_level()
    assert [point.second for point in report.throughput] == list(range(5))
    total_bytes = sum(u.bytes for t in traces for u in t.utterances)
    assert sum(point.bytes for point in report.throughput) == total_bytes
    # Session 0 is open from 100.0 to about 100.93 s, session 1 from 101.5 s: second 1 holds half of session 1.
    assert report.throughput[0].mean_active_sessions == pytest.approx(traces[0].ended_s - 100.0)  # type: ignore[operator]
    open_seconds = sum(point.mean_active_sessions for point in report.throughput)
    expected = sum(min(t.ended_s or 105.0, 105.0) - t.started_s for t in traces)
    assert open_seconds == pytest.approx(expected)


def test_tampered_counts_are_detected() -> None:
    report, _ = build_level()
    broken = msgspec.structs.replace(
        report,
        underruns=report.underruns + 1,
        sessions=msgspec.structs.replace(report.sessions, completed=report.sessions.completed + 1),
        errors={"http_503": 2},
    )
    problems = consistency_problems(broken)
    assert any("underruns" in p for p in problems)
    assert any("measured != completed" in p for p in problems)
    assert any("errors by code" in p for p in problems)


def test_pooling_runs_adds_their_samples() -> None:
    single, traces = build_level()
    pooled = summarize_level(
        [LevelTraces(traces, 100.0, 5.0), LevelTraces(traces, 100.0, 5.0)],
        target=SPEC,
        arrival=ClosedLoop(sessions=2),
        round_index=None,
        duration_s=8.0,
        warmup_s=1.0,
        jitter_ms=100.0,
        slo_ttfa_ms=100.0,
        client_cpu_percent=None,
        server_metrics=[],
        metrics_error=None,
    )
    assert pooled.ttfa_ms.count == 2 * single.ttfa_ms.count
    assert pooled.underruns == 2 * single.underruns
    assert pooled.throughput == []
    assert consistency_problems(pooled) == []


def test_comparison_ratios_are_b_over_a() -> None:
    a, _ = build_level()
    b = msgspec.structs.replace(
        a, ttfa_ms=msgspec.structs.replace(a.ttfa_ms, p50=(a.ttfa_ms.p50 or 0) * 2), underruns=0
    )
    ratios = comparison_ratios(a, b)
    assert ratios["ttfa_p50"] == pytest.approx(2.0)
    assert ratios["underruns"] == 0.0
    assert comparison_ratios(b, a)["underruns"] is None


def test_report_round_trips_through_json() -> None:
    level, _ = build_level()
    report = LoadTestReport(
        version=REPORT_VERSION,
        created_at="2025-01-01T00:00:00+00:00",
        settings=RunSettings(
            duration_s=4.0,
            warmup_s=1.0,
            ramp_s=0.0,
            drain_s=5.0,
            seed=0,
            words_per_second=10.0,
            utterances_per_session=1,
            jitter_ms=100.0,
            slo_ttfa_ms=100.0,
            utterance_timeout_s=60.0,
            corpus="shipped",
            corpus_entries=50,
        ),
        levels=[level],
    )
    decoded = msgspec.json.decode(msgspec.json.encode(report), type=LoadTestReport)
    assert decoded == report


def summarize(traces: list[SessionTrace], warmup_s: float = 0.0, start_s: float = 0.0) -> LevelReport:
    return summarize_level(
        [LevelTraces(traces, start_s, 10.0)],
        target=SPEC,
        arrival=ClosedLoop(sessions=len(traces)),
        round_index=None,
        duration_s=10.0,
        warmup_s=warmup_s,
        jitter_ms=100.0,
        slo_ttfa_ms=100.0,
        client_cpu_percent=None,
        server_metrics=[],
        metrics_error=None,
    )


def test_an_utterance_cut_off_at_the_end_of_the_drain_fails_the_level() -> None:
    cut = SessionTrace(1, 0.5)
    cut.connected(0.501)
    slow = cut.begin_utterance(0.501, "Still talking.")
    slow.text_sent(0.501, 14)
    slow.audio(0.55, CHUNK_BYTES)
    cut.cut_off(9.0)
    report = summarize([completed_session(0, start_s=0.1), cut])
    assert report.utterances.cut_off == 1
    assert not report.slo.passed
    assert "1 utterances cut off at the end of the drain" in report.slo.reasons
    assert consistency_problems(report) == []


def test_a_session_still_connecting_at_the_end_of_the_drain_fails_the_level() -> None:
    connecting = SessionTrace(1, 0.5)
    connecting.cut_off(9.0)
    report = summarize([completed_session(0, start_s=0.1), connecting])
    assert report.sessions.cut_off == 1
    assert not report.slo.passed
    assert "1 sessions still connecting at the end of the drain" in report.slo.reasons


def test_a_session_cut_off_between_utterances_does_not_fail_the_level() -> None:
    closing = completed_session(1, start_s=0.2)
    closing.status = "running"  # the last utterance completed; the close handshake was still under way
    closing.cut_off(9.0)
    report = summarize([completed_session(0, start_s=0.1), closing])
    assert report.utterances.cut_off == 0
    assert report.slo.passed, report.slo.reasons


def test_an_utterance_that_ended_early_fails_the_level_even_without_an_error() -> None:
    trace = completed_session(1, start_s=0.2)
    trace.utterances[0].status = "failed"
    report = summarize([completed_session(0, start_s=0.1), trace])
    assert report.utterances.failed == 1
    assert "1 utterances ended before completing" in report.slo.reasons


def long_session(session_id: int, start_s: float, utterances: int, every_s: float) -> SessionTrace:
    """A session that speaks ``utterances`` one after another, each ``every_s`` long."""
    trace = SessionTrace(session_id, start_s)
    trace.connected(start_s + 0.001)
    for index in range(utterances):
        begin_s = start_s + 0.001 + index * every_s
        utterance = trace.begin_utterance(begin_s, "Hello there.")
        utterance.text_sent(begin_s, len("Hello there."))
        last = receive_audio(utterance, begin_s + 0.03, chunks=5)
        utterance.finish(last + 0.001, "completed")
    trace.end(start_s + utterances * every_s)
    return trace


def test_sessions_that_all_started_during_the_ramp_are_measured_by_their_later_utterances() -> None:
    # Every session starts in the first second (the ramp), well inside a 4 s warm-up, and speaks for 10 s.
    traces = [long_session(i, start_s=0.25 * i, utterances=20, every_s=0.5) for i in range(4)]
    report = summarize(traces, warmup_s=4.0)
    assert report.sessions.warmup == 0
    assert report.sessions.measured == 4
    begun_after_warmup = sum(1 for t in traces for u in t.utterances if u.started_s >= 4.0)
    assert report.utterances.total == report.utterances.completed == begun_after_warmup > 0
    assert report.ttfa_ms.count == begun_after_warmup
    assert all(r.index >= 7 for s in report.session_records for r in s.utterances)
    assert report.slo.passed, report.slo.reasons
    assert consistency_problems(report) == []


def test_a_level_with_nothing_begun_after_the_warm_up_says_so() -> None:
    report = summarize([long_session(0, start_s=0.0, utterances=2, every_s=0.5)], warmup_s=4.0)
    assert report.sessions.warmup == 1
    assert not report.slo.passed
    assert report.slo.reasons[0].startswith("no utterance began after the warm-up")


def test_the_negotiated_answers_are_counted_per_measured_session() -> None:
    traces = [completed_session(i, start_s=0.1 * i) for i in range(3)]
    for trace in traces[:2]:
        trace.record_negotiated("websocket_extensions", "none")
    traces[2].record_negotiated("websocket_extensions", "permessage-deflate; server_max_window_bits=12")
    traces[2].record_negotiated("websocket_extensions", "ignored: the first answer is kept")
    for trace in traces:
        trace.record_negotiated("format", "pcm 24000 Hz")
    report = summarize(traces)
    assert report.negotiated == {
        "format": {"pcm 24000 Hz": 3},
        "websocket_extensions": {"none": 2, "permessage-deflate; server_max_window_bits=12": 1},
    }
    decoded = msgspec.json.decode(msgspec.json.encode(report), type=LevelReport)
    assert decoded.negotiated == report.negotiated


def test_conversational_turns_are_split_step_by_step_over_the_measured_completed_turns() -> None:
    traces = [completed_session(i, start_s=float(i)) for i in range(4)]
    for index, trace in enumerate(traces):
        trace.utterances[0].steps.update({"voice_to_voice": 800.0 + 100 * index, "transcription": 50.0 + index})
    failed = completed_session(4, start_s=4.0)
    failed.utterances[0].status = "failed"
    failed.utterances[0].steps["voice_to_voice"] = 9000.0  # a failed turn is not a turn's timing
    report = summarize([*traces, failed], warmup_s=1.0)  # the first session is warm-up
    steps = report.turn_steps_ms
    assert set(steps) == {"voice_to_voice", "transcription"}
    assert (steps["voice_to_voice"].count, steps["voice_to_voice"].min, steps["voice_to_voice"].max) == (
        3,
        900.0,
        1100.0,
    )
    assert steps["transcription"].p50 == 52.0
    text = turn_steps_text([report])
    assert text is not None and "voice_to_voice 1000.0 / " in text.plain and "transcription 52.0 / " in text.plain
    assert turn_steps_text([summarize([completed_session(0, 0.0)])]) is None  # no talk-mode turns: no line
