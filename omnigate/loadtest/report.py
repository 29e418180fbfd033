"""The JSON report: one section per measured level, plus the capacity search and the comparison when run.

:func:`summarize_level` turns the traces of one level into its report section (sans-I/O), and
:func:`consistency_problems` checks that a section's counts add up.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import msgspec

from omnigate.loadtest.arrivals import ArrivalModel
from omnigate.loadtest.capacity import CapacityResult
from omnigate.loadtest.stats import Distribution, distribution, ratio
from omnigate.loadtest.traces import SessionStatus, SessionTrace, UtteranceStatus

REPORT_VERSION = 2
"""2: utterances are measured by when they began, unfinished ones fail the level, and what was negotiated is
recorded."""


class TargetSpec(msgspec.Struct, frozen=True):
    """What is measured: a target kind (``ws-speech``, ``http-speech`` ...) at a server URL."""

    label: str
    target: str
    url: str
    model: str | None = None
    voice: str | None = None


class TtfaSlo(msgspec.Struct, frozen=True):
    """The p99 TTFA limit a level is judged by, and why that limit: the option, the default or the target's own."""

    limit_ms: float
    basis: str


DEFAULT_SLO = TtfaSlo(limit_ms=100.0, basis="default: streamed speech's first audio")


class RunSettings(msgspec.Struct, frozen=True):
    """The command-line settings that shaped the run."""

    duration_s: float
    warmup_s: float
    ramp_s: float
    drain_s: float
    seed: int
    words_per_second: float
    utterances_per_session: int
    jitter_ms: float
    slo_ttfa_ms: float
    utterance_timeout_s: float
    corpus: str
    corpus_entries: int
    api_key_sent: bool = False
    """Whether the clients presented an API key (the key itself is never recorded)."""
    compression_offered: bool = True
    """Whether WebSocket handshakes offered ``permessage-deflate`` (what the server answered is per level)."""
    response_format: str | None = None
    """The audio format asked for; ``None``: each target's default."""
    slo_basis: str | None = None
    """Why ``slo_ttfa_ms`` is the limit (``--slo-ttfa-ms``, the default, or the target's own for what its TTFA
    measures); None in reports written before it was recorded."""


class UtteranceRecord(msgspec.Struct, frozen=True):
    index: int
    status: UtteranceStatus
    chars: int
    units: int
    chunks: int
    bytes: int
    audio_ms: float
    ttfa_ms: float | None
    rtf: float | None
    underruns: int
    stall_ms: float
    start_delay_ms: float
    max_gap_ms: float | None


class SessionRecord(msgspec.Struct, frozen=True):
    """One measured session. Times are seconds from the start of the level."""

    id: int
    status: SessionStatus
    start_s: float
    end_s: float | None
    connect_ms: float | None
    errors: dict[str, int]
    utterances: list[UtteranceRecord]


class SessionCounts(msgspec.Struct, frozen=True):
    """``started = warmup + measured`` and ``measured = completed + failed + cut_off``."""

    started: int
    warmup: int
    measured: int
    completed: int
    failed: int
    cut_off: int


class UtteranceCounts(msgspec.Struct, frozen=True):
    """Utterances of measured sessions: ``total = completed + failed + cut_off``."""

    total: int
    completed: int
    failed: int
    cut_off: int
    with_underruns: int


class ThroughputPoint(msgspec.Struct, frozen=True):
    """One wall-clock second of the level, over every session (warm-up included)."""

    second: int
    audio_s: float
    bytes: int
    mean_active_sessions: float
    """Sessions open, averaged over the second (time-weighted)."""
    utterances_done: int


class MetricSeries(msgspec.Struct, frozen=True):
    """One Prometheus sample series as scraped during the level (``delta`` = last - first, for counters)."""

    name: str
    kind: str
    first: float
    last: float
    min: float
    max: float
    mean: float
    delta: float


class SloVerdict(msgspec.Struct, frozen=True):
    """Whether the level meets the realtime SLO: no errors, no underruns, p99 TTFA under the limit."""

    passed: bool
    reasons: list[str]


class LevelReport(msgspec.Struct, frozen=True):
    """One measured level: a target under one arrival model for one duration."""

    target: TargetSpec
    arrival: ArrivalModel
    round: int | None
    duration_s: float
    warmup_s: float
    wall_s: float
    client_cpu_percent: float | None
    sessions: SessionCounts
    utterances: UtteranceCounts
    ttfa_ms: Distribution
    gap_ms: Distribution
    stall_ms: Distribution
    start_delay_ms: Distribution
    rtf: Distribution
    connect_ms: Distribution
    underruns: int
    stalled_ms: float
    """Total stalled time over the completed utterances."""
    audio_s: float
    bytes: int
    errors: dict[str, int]
    error_examples: dict[str, str]
    """One message per error code, as the server or the client library worded it."""
    slo: SloVerdict
    throughput: list[ThroughputPoint]
    server_metrics: list[MetricSeries]
    metrics_error: str | None
    session_records: list[SessionRecord]
    negotiated: dict[str, dict[str, int]] = {}
    """What the servers answered, by key (``websocket_extensions``, ``format``, ``content_type`` ...): measured
    sessions per answer."""
    turn_steps_ms: dict[str, Distribution] = {}
    """Completed conversational turns step by step (the realtime target's talk mode, and turns a model answers
    itself: ``voice_to_voice``, ``end_of_turn``, ``transcription``, ``first_token``, ``first_audio``,
    ``turn_to_audio``; see its module)."""


class CapacityReport(msgspec.Struct, frozen=True):
    target: TargetSpec
    slo_ttfa_ms: float
    level_duration_s: float
    result: CapacityResult


class CompareLevel(msgspec.Struct, frozen=True):
    """Both sides at one arrival model, pooled over rounds; ``ratios`` are B / A."""

    arrival: ArrivalModel
    a: LevelReport
    b: LevelReport
    ratios: dict[str, float | None]
    round_ratios: list[dict[str, float | None]]


class CompareReport(msgspec.Struct, frozen=True):
    a: TargetSpec
    b: TargetSpec
    rounds: int
    levels: list[CompareLevel]


class LoadTestReport(msgspec.Struct, frozen=True):
    version: int
    created_at: str
    settings: RunSettings
    levels: list[LevelReport]
    capacity: CapacityReport | None = None
    compare: CompareReport | None = None


class LevelTraces(NamedTuple):
    """The sessions of one measured run and when that run started and how long it took (seconds)."""

    traces: Sequence[SessionTrace]
    start_s: float
    wall_s: float


def summarize_level(
    runs: Sequence[LevelTraces],
    *,
    target: TargetSpec,
    arrival: ArrivalModel,
    round_index: int | None,
    duration_s: float,
    warmup_s: float,
    jitter_ms: float,
    slo_ttfa_ms: float,
    client_cpu_percent: float | None,
    server_metrics: list[MetricSeries],
    metrics_error: str | None,
) -> LevelReport:
    """Compute a level's report from the session traces of one run, or of several runs pooled.

    A level measures the utterances that begin after a run's warm-up, whatever session they belong to, so sessions
    longer than the level are measured too. A session is measured when it started after the warm-up or has such an
    utterance; every error it met counts (errors carry no time, and a level must not pass on a doubt). The
    per-second throughput is given for a single run only.
    """
    traces = [trace for run in runs for trace in run.traces]
    measured_runs = [(run, [t for t in run.traces if _is_measured(t, run.start_s + warmup_s)]) for run in runs]
    measured = [trace for _, run_measured in measured_runs for trace in run_measured]
    starts = {id(trace): run.start_s for run, run_measured in measured_runs for trace in run_measured}
    records: list[SessionRecord] = []
    ttfa: list[float] = []
    gaps: list[float] = []
    stalls: list[float] = []
    start_delays: list[float] = []
    rtfs: list[float] = []
    connects: list[float] = []
    errors: Counter[str] = Counter()
    error_examples: dict[str, str] = {}
    utterance_status: Counter[str] = Counter()
    with_underruns = 0
    underruns = 0
    audio_ms = 0.0
    total_bytes = 0
    turn_steps: dict[str, list[float]] = {}
    for trace in measured:
        errors.update(trace.errors)
        for code, detail in trace.error_details.items():
            error_examples.setdefault(code, detail)
        connect_ms = None
        if trace.connected_s is not None:
            connect_ms = (trace.connected_s - trace.started_s) * 1000.0
            connects.append(connect_ms)
        utterance_records: list[UtteranceRecord] = []
        warmup_end_s = starts[id(trace)] + warmup_s
        for utterance in trace.utterances:
            if utterance.started_s < warmup_end_s:
                continue
            utterance_status[utterance.status] += 1
            played = utterance.play(jitter_ms)
            utterance_gaps = utterance.gaps_ms()
            record = UtteranceRecord(
                index=utterance.index,
                status=utterance.status,
                chars=len(utterance.text),
                units=utterance.units,
                chunks=len(utterance.arrivals),
                bytes=utterance.bytes,
                audio_ms=played.audio_ms,
                ttfa_ms=utterance.ttfa_ms(),
                rtf=utterance.rtf(),
                underruns=played.underruns,
                stall_ms=played.stall_ms,
                start_delay_ms=played.start_delay_ms,
                max_gap_ms=max(utterance_gaps, default=None),
            )
            utterance_records.append(record)
            if utterance.status != "completed":
                continue
            for step, ms in utterance.steps.items():
                turn_steps.setdefault(step, []).append(ms)
            if record.ttfa_ms is not None:
                ttfa.append(record.ttfa_ms)
            if record.rtf is not None:
                rtfs.append(record.rtf)
            gaps.extend(utterance_gaps)
            stalls.append(record.stall_ms)
            if record.chunks:
                start_delays.append(record.start_delay_ms)
            underruns += record.underruns
            with_underruns += record.underruns > 0
            audio_ms += record.audio_ms
            total_bytes += record.bytes
        records.append(
            SessionRecord(
                id=trace.session_id,
                status=trace.status,
                start_s=trace.started_s - starts[id(trace)],
                end_s=None if trace.ended_s is None else trace.ended_s - starts[id(trace)],
                connect_ms=connect_ms,
                errors=dict(trace.errors),
                utterances=utterance_records,
            )
        )
    session_status = Counter(t.status for t in measured)
    ttfa_distribution = distribution(ttfa)
    negotiated: dict[str, Counter[str]] = {}
    for trace in measured:
        for key, value in trace.negotiated.items():
            negotiated.setdefault(key, Counter())[value] += 1
    unfinished = Unfinished(
        failed=utterance_status["failed"],
        cut_off=utterance_status["cut_off"],
        cut_off_connecting=sum(1 for t in measured if t.status == "cut_off" and t.connected_s is None),
    )
    return LevelReport(
        target=target,
        arrival=arrival,
        round=round_index,
        duration_s=duration_s,
        warmup_s=warmup_s,
        wall_s=sum(run.wall_s for run in runs),
        client_cpu_percent=client_cpu_percent,
        sessions=SessionCounts(
            started=len(traces),
            warmup=len(traces) - len(measured),
            measured=len(measured),
            completed=session_status["completed"],
            failed=session_status["failed"],
            cut_off=session_status["cut_off"],
        ),
        utterances=UtteranceCounts(
            total=sum(utterance_status.values()),
            completed=utterance_status["completed"],
            failed=utterance_status["failed"],
            cut_off=utterance_status["cut_off"],
            with_underruns=with_underruns,
        ),
        ttfa_ms=ttfa_distribution,
        gap_ms=distribution(gaps),
        stall_ms=distribution(stalls),
        start_delay_ms=distribution(start_delays),
        rtf=distribution(rtfs),
        connect_ms=distribution(connects),
        underruns=underruns,
        stalled_ms=math.fsum(stalls),
        audio_s=audio_ms / 1000.0,
        bytes=total_bytes,
        errors=dict(errors),
        error_examples=error_examples,
        slo=slo_verdict(
            ttfa_distribution, underruns, errors, slo_ttfa_ms, measured_sessions=len(measured), unfinished=unfinished
        ),
        throughput=throughput_series(runs[0].traces, runs[0].start_s, runs[0].wall_s) if len(runs) == 1 else [],
        server_metrics=server_metrics,
        metrics_error=metrics_error,
        session_records=records,
        negotiated={key: dict(sorted(values.items())) for key, values in sorted(negotiated.items())},
        turn_steps_ms={step: distribution(values) for step, values in turn_steps.items()},
    )


def _is_measured(trace: SessionTrace, warmup_end_s: float) -> bool:
    return trace.started_s >= warmup_end_s or any(u.started_s >= warmup_end_s for u in trace.utterances)


class Unfinished(NamedTuple):
    """Measured work that did not complete: each fails the level, as an error does."""

    failed: int = 0
    """Utterances that ended early (a non-completed terminal status, a cut-short body, an error)."""
    cut_off: int = 0
    """Utterances still running when the drain ended."""
    cut_off_connecting: int = 0
    """Sessions still connecting when the drain ended."""


_ALL_FINISHED = Unfinished()


def slo_verdict(
    ttfa: Distribution,
    underruns: int,
    errors: Counter[str] | dict[str, int],
    slo_ttfa_ms: float,
    measured_sessions: int,
    unfinished: Unfinished = _ALL_FINISHED,
) -> SloVerdict:
    """Pass only with measured utterances, all completed, no errors, no underruns and p99 TTFA strictly under the
    SLO. Utterances that failed or were cut off at the end of the drain, and sessions that never connected, fail the
    level: under overload they are the slowest sessions, and leaving them out would flatter it."""
    reasons: list[str] = []
    if measured_sessions == 0:
        reasons.append("no utterance began after the warm-up (lengthen --duration or shorten --warmup)")
    elif ttfa.count == 0 or ttfa.p99 is None:
        reasons.append("no utterance completed with audio")
    elif ttfa.p99 >= slo_ttfa_ms:
        reasons.append(f"p99 TTFA {ttfa.p99:.1f} ms >= {slo_ttfa_ms:g} ms")
    if underruns:
        reasons.append(f"{underruns} underruns")
    if unfinished.failed:
        reasons.append(f"{unfinished.failed} utterances ended before completing")
    if unfinished.cut_off:
        reasons.append(f"{unfinished.cut_off} utterances cut off at the end of the drain")
    if unfinished.cut_off_connecting:
        reasons.append(f"{unfinished.cut_off_connecting} sessions still connecting at the end of the drain")
    error_count = sum(errors.values())
    if error_count:
        reasons.append(f"{error_count} errors")
    return SloVerdict(passed=not reasons, reasons=reasons)


def throughput_series(traces: Sequence[SessionTrace], level_start_s: float, wall_s: float) -> list[ThroughputPoint]:
    """Audio received, sessions active and utterances finished in each second of the level."""
    seconds = max(1, math.ceil(wall_s))
    audio_ms = [0.0] * seconds
    received = [0] * seconds
    done = [0] * seconds
    open_s = [0.0] * seconds

    def bucket(at_s: float) -> int:
        return min(seconds - 1, max(0, int(at_s - level_start_s)))

    for trace in traces:
        start_s = trace.started_s - level_start_s
        end_s = (trace.ended_s if trace.ended_s is not None else level_start_s + wall_s) - level_start_s
        for second in range(bucket(trace.started_s), bucket(end_s + level_start_s) + 1):
            open_s[second] += max(0.0, min(end_s, second + 1.0) - max(start_s, float(second)))
        for utterance in trace.utterances:
            for arrival_s, chunk_ms, chunk_bytes in utterance.arrivals:
                audio_ms[bucket(arrival_s)] += chunk_ms
                received[bucket(arrival_s)] += chunk_bytes
            if utterance.status == "completed" and utterance.completed_s is not None:
                done[bucket(utterance.completed_s)] += 1
    return [
        ThroughputPoint(
            second=second,
            audio_s=audio_ms[second] / 1000.0,
            bytes=received[second],
            mean_active_sessions=open_s[second],
            utterances_done=done[second],
        )
        for second in range(seconds)
    ]


def comparison_ratios(a: LevelReport, b: LevelReport) -> dict[str, float | None]:
    """B over A for the numbers that decide a comparison (``None`` where A is zero or missing)."""
    a_wall = a.wall_s or None
    b_wall = b.wall_s or None
    return {
        "ttfa_p50": ratio(b.ttfa_ms.p50, a.ttfa_ms.p50),
        "ttfa_p99": ratio(b.ttfa_ms.p99, a.ttfa_ms.p99),
        "gap_p99": ratio(b.gap_ms.p99, a.gap_ms.p99),
        "rtf_p50": ratio(b.rtf.p50, a.rtf.p50),
        "underruns": ratio(b.underruns, a.underruns),
        "audio_s_per_wall_s": ratio(
            ratio(b.audio_s, b_wall),
            ratio(a.audio_s, a_wall),
        ),
        "client_cpu_percent": ratio(b.client_cpu_percent, a.client_cpu_percent),
    }


def consistency_problems(level: LevelReport) -> list[str]:
    """Every way the level's counts fail to add up (empty when the report is consistent)."""
    problems: list[str] = []
    s = level.sessions
    u = level.utterances
    records = level.session_records
    completed_utterances = [r for rec in records for r in rec.utterances if r.status == "completed"]

    def check(condition: bool, message: str) -> None:
        if not condition:
            problems.append(message)

    check(s.started == s.warmup + s.measured, "sessions: started != warmup + measured")
    check(s.measured == s.completed + s.failed + s.cut_off, "sessions: measured != completed + failed + cut_off")
    check(len(records) == s.measured, "session records != measured sessions")
    check(
        s.failed == sum(1 for r in records if r.errors and r.status == "failed"),
        "failed sessions != records with errors",
    )
    check(all(not r.errors for r in records if r.status == "completed"), "a completed session has errors")
    check(u.total == u.completed + u.failed + u.cut_off, "utterances: total != completed + failed + cut_off")
    check(u.total == sum(len(r.utterances) for r in records), "utterance records != utterance total")
    check(u.completed == len(completed_utterances), "completed utterances != completed records")
    check(
        level.ttfa_ms.count == sum(1 for r in completed_utterances if r.ttfa_ms is not None),
        "TTFA count != completed utterances with a TTFA",
    )
    check(level.underruns == sum(r.underruns for r in completed_utterances), "underruns != sum of records")
    check(u.with_underruns == sum(1 for r in completed_utterances if r.underruns), "utterances with underruns mismatch")
    check(level.bytes == sum(r.bytes for r in completed_utterances), "bytes != sum of records")
    check(
        math.isclose(level.stalled_ms, math.fsum(r.stall_ms for r in completed_utterances), abs_tol=1e-6),
        "stalled ms != sum of records",
    )
    recorded_errors: Counter[str] = Counter()
    for record in records:
        recorded_errors.update(record.errors)
    check(dict(recorded_errors) == level.errors, "errors by code != sum of session records")
    check(level.slo.passed == (not level.slo.reasons), "SLO verdict disagrees with its reasons")
    return problems
