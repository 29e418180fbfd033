"""``omnigate-loadtest soak``: hold N sessions (a fraction of measured capacity) against a server for a long time,
sample it every interval, and fail if memory, file descriptors, tasks or latency trend upward.

Usage::

    omnigate-loadtest soak URL --capacity 10 --load 0.8 --duration 3600 --interval 60 --out soak.json
    omnigate-loadtest soak URL --find-capacity --slo-ttfa-ms 300 --duration 3600
    omnigate-loadtest soak URL --sessions 8 --duration 600

Every interval it records the server's footprint from ``/metrics`` (resident memory, open file descriptors,
event-loop tasks, live sessions) and, for the utterances that ended in the interval, TTFA percentiles, underruns
of the simulated player and errors. The verdicts are :mod:`omnigate.loadtest.trend`'s. ``--api-key`` (default:
``$OMNIGATE_API_KEY``) is presented on every session and every ``/metrics`` read.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from omnigate.loadtest.api_key import ApiKey, add_api_key_option, auth_headers, auth_refusal_notice, resolve_api_key
from omnigate.loadtest.arrivals import ClosedLoop
from omnigate.loadtest.corpus import load_corpus
from omnigate.loadtest.footprint import Footprint, FootprintUnavailable, read_footprint
from omnigate.loadtest.report import LevelReport, LevelTraces, TargetSpec
from omnigate.loadtest.runner import LevelRun, LevelSettings, run_capacity_search
from omnigate.loadtest.stats import Distribution, distribution
from omnigate.loadtest.targets import SessionSettings, Target, target_class
from omnigate.loadtest.targets.base import http_url, url_problem
from omnigate.loadtest.traces import SessionTrace
from omnigate.loadtest.trend import Trend, trend

DEFAULT_URL = "http://127.0.0.1:8000"


class SoakSample(msgspec.Struct, frozen=True):
    """One interval: when it ended (seconds into the soak), what the server held, what the clients measured."""

    at_s: float
    footprint: Footprint | None
    utterances: int
    ttfa_ms: Distribution
    underruns: int
    errors: int


class SoakReport(msgspec.Struct, frozen=True):
    created_at: str
    url: str
    target: str
    sessions: int
    capacity: int | None
    load: float | None
    duration_s: float
    interval_s: float
    warm_up_intervals: int
    samples: list[SoakSample]
    trends: list[Trend]
    problems: list[str]
    passed: bool
    api_key_sent: bool = False
    """Whether the clients presented an API key (the key itself is never recorded)."""


def soak_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnigate-loadtest soak",
        description="Hold N sessions against a server for a long time; fail if memory, file descriptors, tasks or "
        "latency trend upward.",
    )
    parser.add_argument("url", nargs="?", default=DEFAULT_URL)
    parser.add_argument("--target", default="ws-speech", help="client kind (see omnigate-loadtest run --help)")
    parser.add_argument("--model")
    parser.add_argument("--voice")
    parser.add_argument("--format", dest="response_format", help="audio format asked for (default: the target's)")
    parser.add_argument(
        "--no-compression",
        dest="compression",
        action="store_false",
        help="do not offer permessage-deflate on WebSocket handshakes",
    )
    add_api_key_option(parser)
    size = parser.add_argument_group("how many sessions (one of)")
    size.add_argument("--sessions", type=int, help="exactly this many concurrent sessions")
    size.add_argument("--capacity", type=int, help="measured capacity; the soak runs --load of it")
    size.add_argument("--find-capacity", action="store_true", help="measure capacity first (closed-loop search)")
    parser.add_argument("--load", type=float, default=0.8, help="fraction of capacity to hold")
    parser.add_argument("--max-sessions", type=int, default=256, help="capacity search ceiling")
    parser.add_argument("--capacity-level-duration", type=float, default=30.0, help="seconds per search level")
    parser.add_argument("--duration", type=float, default=3600.0, help="seconds of soak")
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--warm-up-intervals", type=int, default=1, help="first samples left out of the verdicts")
    parser.add_argument("--words-per-second", type=float, default=20.0)
    parser.add_argument("--utterances-per-session", type=int, default=1)
    parser.add_argument("--jitter-ms", type=float, default=100.0)
    parser.add_argument("--slo-ttfa-ms", type=float, default=300.0, help="used by --find-capacity")
    parser.add_argument("--seed", type=int, default=0)
    tolerance = parser.add_argument_group("what counts as an upward trend (rise over the soak)")
    tolerance.add_argument("--rss-tolerance-mib", type=float, default=32.0)
    tolerance.add_argument("--fd-tolerance", type=float, default=4.0)
    tolerance.add_argument("--task-tolerance", type=float, default=8.0)
    tolerance.add_argument(
        "--ttfa-tolerance", type=float, default=0.25, help="fraction of the early p99 TTFA (at least 25 ms)"
    )
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    return parser


def interval_sample(
    traces: Sequence[SessionTrace], since_s: float, until_s: float, at_s: float, jitter_ms: float
) -> tuple[int, Distribution, int, int]:
    """Utterances that completed in (since, until], their TTFA, their underruns; errors of sessions ended then."""
    ttfas: list[float] = []
    underruns = 0
    completed = 0
    errors = 0
    for session in traces:
        for utterance in session.utterances:
            done = utterance.completed_s
            if utterance.status != "completed" or done is None or not since_s < done <= until_s:
                continue
            completed += 1
            ttfa = utterance.ttfa_ms()
            if ttfa is not None:
                ttfas.append(ttfa)
            underruns += utterance.play(jitter_ms).underruns
        if session.ended_s is not None and since_s < session.ended_s <= until_s:
            errors += sum(session.errors.values())
    return completed, distribution(ttfas), underruns, errors


def verdicts(samples: Sequence[SoakSample], args: argparse.Namespace) -> list[Trend]:
    warm = args.warm_up_intervals
    feet = [s.footprint for s in samples]
    p99 = [s.ttfa_ms.p99 for s in samples]
    p50 = [s.ttfa_ms.p50 for s in samples]

    def latency_tolerance(values: list[float | None]) -> float:
        """A fraction of the series' early median (its first three measured intervals), at least 25 ms."""
        early = sorted([v for v in values[warm:] if v is not None][:3])
        fraction: float = args.ttfa_tolerance
        return max(25.0, fraction * (early[len(early) // 2] if early else 0.0))

    return [
        trend("rss_mib", [f.rss_mib if f else None for f in feet], args.rss_tolerance_mib, warm),
        trend("open_fds", [float(f.open_fds) if f else None for f in feet], args.fd_tolerance, warm),
        trend("event_loop_tasks", [float(f.tasks) if f else None for f in feet], args.task_tolerance, warm),
        trend("ttfa_p99_ms", p99, latency_tolerance(p99), warm),
        trend("ttfa_p50_ms", p50, latency_tolerance(p50), warm),
    ]


async def _capacity(target: Target, args: argparse.Namespace, corpus: list[str]) -> int:
    settings = _level_settings(args, args.capacity_level_duration)
    key_sent = target.settings.api_key is not None

    async def observe(level: LevelRun) -> tuple[LevelReport, LevelTraces]:
        report = await level.run(None)
        notice = auth_refusal_notice((s.errors for s in report[0].session_records), key_sent)
        if notice is not None:
            raise SystemExit(f"capacity search: {notice}")
        print(f"capacity search: {level.label}: slo {'met' if report[0].slo.passed else 'missed'}", flush=True)
        return report

    capacity, _ = await run_capacity_search(
        target, settings, corpus, observe, max_sessions=args.max_sessions, tolerance=0.05, ramp_s=0.0
    )
    found = capacity.result.capacity
    if found < 1:
        raise SystemExit("the capacity search found no level that meets the SLO")
    return found


def _level_settings(args: argparse.Namespace, duration_s: float) -> LevelSettings:
    return LevelSettings(
        duration_s=duration_s,
        warmup_s=0.0,
        drain_s=30.0,
        seed=args.seed,
        utterances_per_session=args.utterances_per_session,
        jitter_ms=args.jitter_ms,
        slo_ttfa_ms=args.slo_ttfa_ms,
        metrics_interval_s=args.interval,
        scrape_metrics=False,  # the soak reads /metrics itself, once per interval
    )


async def run_soak(args: argparse.Namespace, api_key: ApiKey | None) -> SoakReport:
    corpus = load_corpus()
    spec = TargetSpec(label=args.target, target=args.target, url=args.url, model=args.model, voice=args.voice)
    settings = SessionSettings(
        words_per_second=args.words_per_second,
        api_key=api_key,
        compression=args.compression,
        response_format=args.response_format,
    )
    target = target_class(args.target)(spec, settings)
    await target.open()
    try:
        capacity = args.capacity
        if args.find_capacity:
            capacity = await _capacity(target, args, corpus)
        sessions = args.sessions if args.sessions is not None else max(1, math.floor(capacity * args.load))
        print(f"soak: {sessions} sessions for {args.duration:g} s, sampled every {args.interval:g} s", flush=True)
        level = LevelRun(target, ClosedLoop(sessions=sessions), _level_settings(args, args.duration), corpus)
        samples = await _sample_while_running(level, args, auth_headers(api_key))
    finally:
        await target.close()
    trends = verdicts(samples, args)
    problems = [
        f"{t.name} trends upward: +{t.rise:.1f} over the soak (tolerance {t.tolerance:.1f})" for t in trends if t.upward
    ]
    refusal = auth_refusal_notice((trace.errors for trace in level.traces), api_key is not None)
    if refusal is not None:
        problems.insert(0, refusal)
    if any(s.footprint is None for s in samples[args.warm_up_intervals :]):
        problems.append("the server footprint could not be read from /metrics in every interval")
    if len([s for s in samples[args.warm_up_intervals :] if s.utterances]) < 3:
        problems.append("fewer than three measured intervals: run longer or sample more often")
    return SoakReport(
        created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        url=args.url,
        target=args.target,
        sessions=sessions,
        capacity=capacity,
        load=args.load if args.sessions is None else None,
        duration_s=args.duration,
        interval_s=args.interval,
        warm_up_intervals=args.warm_up_intervals,
        samples=samples,
        trends=trends,
        problems=problems,
        passed=not problems,
        api_key_sent=api_key is not None,
    )


async def _sample_while_running(level: LevelRun, args: argparse.Namespace, headers: dict[str, str]) -> list[SoakSample]:
    metrics_url = http_url(args.url, "/metrics")
    running = asyncio.create_task(level.run(None))
    samples: list[SoakSample] = []
    started = time.perf_counter()
    since = started
    intervals = max(1, math.ceil(args.duration / args.interval))
    try:
        for index in range(1, intervals + 1):
            await asyncio.sleep(max(0.0, started + index * args.interval - time.perf_counter()))
            now = time.perf_counter()
            try:
                footprint: Footprint | None = await read_footprint(metrics_url, headers)
            except FootprintUnavailable as exc:
                print(f"footprint unavailable: {exc}", file=sys.stderr, flush=True)
                footprint = None
            count, ttfa, underruns, errors = interval_sample(level.traces, since, now, now - started, args.jitter_ms)
            since = now
            sample = SoakSample(round(now - started, 1), footprint, count, ttfa, underruns, errors)
            samples.append(sample)
            print(_describe(sample), flush=True)
        await running
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    return samples


def _describe(sample: SoakSample) -> str:
    feet = sample.footprint.describe() if sample.footprint else "footprint unavailable"
    ttfa = sample.ttfa_ms
    p50 = f"{ttfa.p50:.0f}" if ttfa.p50 is not None else "-"
    p99 = f"{ttfa.p99:.0f}" if ttfa.p99 is not None else "-"
    return (
        f"[{sample.at_s:7.0f} s] {feet}; {sample.utterances} utterances, TTFA p50 {p50} ms p99 {p99} ms, "
        f"{sample.underruns} underruns, {sample.errors} errors"
    )


def main(argv: Sequence[str]) -> int:
    parser = soak_parser()
    args = parser.parse_args(argv)
    if sum(x is not None and x is not False for x in (args.sessions, args.capacity, args.find_capacity or None)) != 1:
        parser.error("give exactly one of --sessions, --capacity, --find-capacity")
    if args.duration <= 0 or args.interval <= 0 or not 0 < args.load <= 1:
        parser.error("--duration and --interval must be > 0 and --load within (0, 1]")
    try:
        target = target_class(args.target)
        if (problem := url_problem(args.url, target.schemes)) is not None:
            raise ValueError(f"{args.url!r} is not a server URL for the {args.target} target: {problem}")
        formats = target.formats
        if args.response_format is not None and args.response_format not in formats:
            raise ValueError(f"--format: the {args.target} target measures {', '.join(formats)}")
        api_key = resolve_api_key(args.api_key, os.environ)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        import uvloop

        report = uvloop.run(run_soak(args, api_key))
    except ImportError:
        report = asyncio.run(run_soak(args, api_key))
    for item in report.trends:
        print(
            f"{item.name}: {item.first} -> {item.last}, fitted rise {item.rise:+.2f} (tolerance {item.tolerance:.1f})"
            f"{'  UPWARD' if item.upward else ''}"
        )
    for problem in report.problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    print("soak passed" if report.passed else "soak failed")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        encoded = msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n"
        args.out.write_bytes(api_key.redact_json(encoded) if api_key is not None else encoded)
    return 0 if report.passed else 1
