"""``omnigate-loadtest``: measure TTFA, underruns and capacity of a speech server through its real transport.

Usage::

    omnigate-loadtest [run] [URL] [--target ws-speech] [--sessions 1,4,16 | --rate 2] [--duration 20] ...
    omnigate-loadtest run URL --find-capacity --slo-ttfa-ms 100
    omnigate-loadtest run --compare http://127.0.0.1:8000 ws://127.0.0.1:8765 --sessions 50 --rounds 2
    omnigate-loadtest baseline --port 8765 [--rtf 1.0]
    omnigate-loadtest standins --port 8090 [--llm-first-token-ms 200 --llm-tokens-per-s 30 --asr-delay-ms 150]

``run`` is the default command. Against a server that requires an API key, set ``OMNIGATE_API_KEY`` (or pass
``--api-key``): every request then carries ``Authorization: Bearer <key>``. ``run`` exits 0 when every level met its
SLO (with ``--find-capacity``: when at least one did), 1 when one missed it, no session connected, the server refused
the API key or the report is inconsistent, and 2 on a usage error (argparse's code).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import difflib
import os
import sys
from collections.abc import Coroutine, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import msgspec
from rich.console import Console

from omnigate.loadtest.api_key import ApiKey, add_api_key_option, auth_headers, auth_refusal_notice, resolve_api_key
from omnigate.loadtest.arrivals import ArrivalModel, ClosedLoop, OpenLoop, arrival_label
from omnigate.loadtest.baseline import BaselineSettings, run_baseline
from omnigate.loadtest.corpus import load_corpus
from omnigate.loadtest.metrics import process_exists
from omnigate.loadtest.progress import (
    ProgressDisplay,
    capacity_text,
    compare_table,
    negotiated_text,
    summary_table,
    turn_steps_text,
)
from omnigate.loadtest.report import (
    DEFAULT_SLO,
    REPORT_VERSION,
    CapacityReport,
    CompareReport,
    LevelReport,
    LevelTraces,
    LoadTestReport,
    RunSettings,
    TargetSpec,
    TtfaSlo,
    consistency_problems,
)
from omnigate.loadtest.runner import (
    LevelRun,
    LevelSettings,
    run_capacity_search,
    run_comparison,
    run_levels,
)
from omnigate.loadtest.targets import SessionSettings, Target, target_class, target_kinds
from omnigate.loadtest.targets.base import url_problem

DEFAULT_URL = "http://127.0.0.1:8000"
_SPEC_KEYS = frozenset({"label", "target", "url", "model", "voice"})
SUBCOMMANDS: dict[str, str] = {
    "run": "drive real clients against a server; report TTFA, underruns, capacity (the default subcommand)",
    "baseline": "serve the bare-websockets transport baseline: the speech stream with synthetic PCM",
    "standins": "serve OpenAI-compatible stand-ins for an LLM and a speech recognizer, with realistic delays",
    "soak": "hold sessions for a long time; fail if memory, descriptors, tasks or latency trend upward",
}
EXIT_STATUS = """\
exit status of run:
  0  every level met its SLO (--find-capacity: at least one level did)
  1  a level missed its SLO, no session connected, the server refused the API key, or the report is inconsistent
  2  usage error: an unknown option or subcommand, a URL without a scheme or host"""


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(value < 1 for value in values):
        raise argparse.ArgumentTypeError("session counts must be >= 1")
    return values


def _positive_floats(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(value <= 0 for value in values):
        raise argparse.ArgumentTypeError("rates must be > 0")
    return values


def top_parser() -> argparse.ArgumentParser:
    """``omnigate-loadtest --help``: every subcommand; also words usage errors made before a subcommand is known."""
    commands = "\n".join(f"  {name:<10}{summary}" for name, summary in SUBCOMMANDS.items())
    return argparse.ArgumentParser(
        prog="omnigate-loadtest",
        usage="omnigate-loadtest [run] [URL] [options]\n       omnigate-loadtest {baseline,standins,soak} [options]",
        description="Measure a speech server through its real transports.",
        epilog=f"subcommands:\n{commands}\n\n'omnigate-loadtest SUBCOMMAND --help' shows each one's options.\n\n"
        + EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnigate-loadtest run",
        description="Drive real clients against a speech server and report TTFA, gaps, underruns and capacity.",
        epilog="The other subcommands: omnigate-loadtest --help\n\n" + EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("url", nargs="?", default=DEFAULT_URL, help=f"server base URL (default {DEFAULT_URL})")
    target = parser.add_argument_group("target")
    target.add_argument(
        "--target",
        default="ws-speech",
        help=f"client kind: {', '.join(target_kinds())} (webrtc: the speech channel of POST /v1/realtime/calls; "
        "realtime-webrtc: voice sessions on its oai-events channel, the microphone on the audio track)",
    )
    target.add_argument("--model", help="model id sent to the server (server default when omitted)")
    target.add_argument("--voice", help="voice sent to the server (server default when omitted)")
    target.add_argument(
        "--format",
        dest="response_format",
        help="audio format asked for (default: what the target's real clients ask for: mp3 on http-speech, pcm on "
        "ws-speech and realtime)",
    )
    target.add_argument(
        "--no-compression",
        dest="compression",
        action="store_false",
        help="do not offer permessage-deflate on WebSocket handshakes (browsers and websockets clients offer it)",
    )
    add_api_key_option(parser)
    load = parser.add_argument_group("load")
    load.add_argument(
        "--sessions", type=_positive_ints, default=[1], help="closed loop: concurrent sessions, e.g. 1,4,16"
    )
    load.add_argument("--rate", type=_positive_floats, help="open loop: Poisson arrivals per second, e.g. 0.5,2")
    load.add_argument("--max-in-flight", type=int, default=1000, help="open loop: client-side session cap")
    load.add_argument("--duration", type=float, default=20.0, help="seconds new sessions start per level")
    load.add_argument("--warmup", type=float, default=2.0, help="sessions started in the first seconds are ignored")
    load.add_argument("--ramp", type=float, default=0.0, help="closed loop: spread session starts over seconds")
    load.add_argument("--drain", type=float, default=15.0, help="seconds to let sessions finish after --duration")
    load.add_argument("--seed", type=int, default=0, help="seed for texts and arrivals")
    load.add_argument("--words-per-second", type=float, default=20.0, help="text pace; 0 sends each text at once")
    load.add_argument("--utterances-per-session", type=int, default=1)
    load.add_argument("--corpus", type=Path, help="a .txt file or folder of them (entries split by blank lines)")
    load.add_argument("--utterance-timeout", type=float, default=60.0)
    load.add_argument("--connect-timeout", type=float, default=10.0)
    robot = parser.add_argument_group("robot target (each utterance is one control tick; TTFA is inference latency)")
    robot.add_argument("--control-rate", type=float, default=10.0, help="observations per second of each robot")
    robot.add_argument("--robot-image-size", type=int, help="camera image side in pixels (default: the policy's)")
    load.add_argument("--video-fps", type=float, default=2.0, help="video-chat: camera frames per second")
    load.add_argument(
        "--query-every", type=float, default=5.0, help="video-chat: seconds after an answer before the next question"
    )
    measure = parser.add_argument_group("measurement")
    measure.add_argument("--jitter-ms", type=float, default=100.0, help="audio the simulated player buffers first")
    measure.add_argument(
        "--slo-ttfa-ms",
        type=float,
        help=f"p99 TTFA limit for pass/fail (default {DEFAULT_SLO.limit_ms:g}; the realtime target's talk mode, "
        "whose TTFA is a whole voice-to-voice turn: 1500)",
    )
    measure.add_argument("--metrics-interval", type=float, default=1.0, help="seconds between /metrics scrapes")
    measure.add_argument("--no-metrics", action="store_true", help="do not scrape /metrics")
    measure.add_argument(
        "--server-pid", type=int, help="also sample this local server process's memory and CPU (psutil)"
    )
    modes = parser.add_argument_group("modes")
    modes.add_argument("--find-capacity", action="store_true", help="search the largest N meeting the SLO")
    modes.add_argument("--max-sessions", type=int, default=256, help="capacity search ceiling")
    modes.add_argument(
        "--capacity-tolerance", type=float, default=0.05, help="stop bisecting within this fraction of N"
    )
    modes.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        help="measure two targets alternately: each a URL or key=value pairs (label,target,url,model,voice)",
    )
    modes.add_argument("--rounds", type=int, default=2, help="--compare: alternating rounds per level")
    output = parser.add_argument_group("output")
    output.add_argument("--out", type=Path, help="write the JSON report here")
    output.add_argument("--plots", type=Path, help="write PNG plots into this folder")
    output.add_argument("--quiet", action="store_true", help="print nothing but problems")
    return parser


def baseline_parser() -> argparse.ArgumentParser:
    defaults = BaselineSettings()
    parser = argparse.ArgumentParser(
        prog="omnigate-loadtest baseline",
        description="Bare-websockets server speaking the speech stream with synthetic PCM (the transport limit).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765, help="0 picks a free port (printed at start)")
    parser.add_argument("--rtf", type=float, default=defaults.rtf, help="production time / audio time; 0 = flat out")
    parser.add_argument("--first-chunk-ms", type=float, default=defaults.first_chunk_ms)
    parser.add_argument("--chunk-ms", type=int, default=defaults.chunk_ms)
    parser.add_argument("--ms-per-char", type=float, default=defaults.ms_per_char)
    parser.add_argument("--sample-rate", type=int, default=defaults.sample_rate)
    parser.add_argument(
        "--compression",
        action="store_true",
        help="accept permessage-deflate when offered, as a websockets server at its defaults does (default: answer "
        "no extension, like the gateway's media routes)",
    )
    return parser


def parse_target_spec(text: str, fallback: TargetSpec, label: str) -> TargetSpec:
    """A ``--compare`` side: a bare URL, or ``key=value`` pairs separated by commas."""
    if "=" not in text:
        return msgspec.structs.replace(fallback, url=text, label=f"{label} {text}")
    fields: dict[str, str] = {}
    for pair in text.split(","):
        key, _, value = pair.partition("=")
        key = key.strip()
        if key not in _SPEC_KEYS:
            raise ValueError(f"unknown key {key!r} in {text!r}; use {', '.join(sorted(_SPEC_KEYS))}")
        fields[key] = value.strip()
    spec = msgspec.structs.replace(fallback, **fields)
    if "label" not in fields:
        spec = msgspec.structs.replace(spec, label=f"{label} {spec.url}")
    return spec


def target_specs(args: argparse.Namespace) -> list[TargetSpec]:
    """What the run measures: the target at the URL, or the two ``--compare`` sides; raises ``ValueError`` for a
    side that is not a target at a server URL."""
    main_spec = TargetSpec(label=args.target, target=args.target, url=args.url, model=args.model, voice=args.voice)
    specs = [main_spec]
    if args.compare:
        specs = [parse_target_spec(text, main_spec, side) for text, side in zip(args.compare, "AB", strict=True)]
    for spec in specs:
        if (problem := url_problem(spec.url, target_class(spec.target).schemes)) is not None:
            raise ValueError(f"{spec.url!r} is not a server URL for the {spec.target} target: {problem}")
    return specs


def resolve_slo(option_ms: float | None, specs: Sequence[TargetSpec]) -> TtfaSlo:
    """The SLO the run's levels are judged by: ``--slo-ttfa-ms`` when given, else the targets' own (talk mode's
    voice to voice) or the default. Raises ``ValueError`` when compared targets would be judged differently."""
    if option_ms is not None:
        return TtfaSlo(limit_ms=option_ms, basis="--slo-ttfa-ms")
    slos = {target_class(spec.target).default_slo(spec) or DEFAULT_SLO for spec in specs}
    if len(slos) > 1:
        limits = " and ".join(f"{slo.limit_ms:g} ms ({slo.basis})" for slo in sorted(slos, key=lambda s: s.limit_ms))
        raise ValueError(f"the compared targets have different default SLOs, {limits}: pass --slo-ttfa-ms")
    (slo,) = slos
    return slo


def unknown_subcommand_message(word: str, problem: str) -> str:
    """A first argument that is neither a subcommand nor a server URL, and the subcommand it may be a typo of."""
    message = f"{word!r} is neither a subcommand ({', '.join(SUBCOMMANDS)}) nor a server URL ({problem})"
    close = difflib.get_close_matches(word, SUBCOMMANDS, n=1)
    return message + (f"; did you mean {close[0]!r}?" if close else "")


def _arrivals(args: argparse.Namespace) -> list[ArrivalModel]:
    if args.rate:
        return [OpenLoop(rate=rate, max_in_flight=args.max_in_flight) for rate in args.rate]
    return [ClosedLoop(sessions=sessions, ramp_s=args.ramp) for sessions in args.sessions]


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.find_capacity and args.compare:
        parser.error("--find-capacity and --compare are separate runs")
    if args.find_capacity and args.rate:
        parser.error("--find-capacity searches closed-loop concurrency; drop --rate")
    if args.duration <= 0 or args.warmup < 0 or args.drain < 0 or args.ramp < 0:
        parser.error("--duration must be > 0 and --warmup, --drain, --ramp >= 0")
    if args.warmup >= args.duration:
        parser.error("--warmup must be shorter than --duration")
    if min(args.utterances_per_session, args.rounds, args.max_sessions, args.max_in_flight) < 1:
        parser.error("--utterances-per-session, --rounds, --max-sessions and --max-in-flight must be >= 1")
    if args.control_rate <= 0 or (args.robot_image_size is not None and args.robot_image_size < 1):
        parser.error("--control-rate and --robot-image-size must be positive")
    if args.words_per_second < 0 or args.jitter_ms < 0:
        parser.error("--words-per-second and --jitter-ms must be >= 0")
    if args.video_fps <= 0 or args.query_every < 0:
        parser.error("--video-fps must be > 0 and --query-every >= 0")
    if args.metrics_interval <= 0:
        parser.error("--metrics-interval must be > 0")
    if args.server_pid is not None and not process_exists(args.server_pid):
        parser.error(f"--server-pid {args.server_pid}: no such process on this machine")


async def _run(
    args: argparse.Namespace,
    specs: Sequence[TargetSpec],
    slo: TtfaSlo,
    api_key: ApiKey | None,
    console: Console,
    errors: Console,
) -> int:
    corpus = load_corpus(args.corpus)
    session_settings = SessionSettings(
        words_per_second=args.words_per_second,
        utterance_timeout_s=args.utterance_timeout,
        connect_timeout_s=args.connect_timeout,
        video_fps=args.video_fps,
        query_every_s=args.query_every,
        api_key=api_key,
        compression=args.compression,
        response_format=args.response_format,
        control_rate_hz=args.control_rate,
        robot_image_px=args.robot_image_size,
    )
    level_settings = LevelSettings(
        duration_s=args.duration,
        warmup_s=args.warmup,
        drain_s=args.drain,
        seed=args.seed,
        utterances_per_session=args.utterances_per_session,
        jitter_ms=args.jitter_ms,
        slo_ttfa_ms=slo.limit_ms,
        metrics_interval_s=args.metrics_interval,
        scrape_metrics=not args.no_metrics,
        server_pid=args.server_pid,
    )
    display = ProgressDisplay(errors, live=not args.quiet and errors.is_terminal, jitter_ms=args.jitter_ms)
    levels: list[LevelReport] = []
    capacity: CapacityReport | None = None
    compare: CompareReport | None = None
    async with AsyncExitStack() as stack:
        targets: list[Target] = []
        for spec in specs:
            target = target_class(spec.target)(spec, session_settings)
            await target.open()
            stack.push_async_callback(target.close)
            targets.append(target)
        metrics_client = None
        if not args.no_metrics:
            metrics_client = httpx.AsyncClient(timeout=5.0, trust_env=False, headers=auth_headers(api_key))
            stack.push_async_callback(metrics_client.aclose)

        async def observe(level: LevelRun) -> tuple[LevelReport, LevelTraces]:
            if args.quiet:
                return await level.run(metrics_client)
            return await display.observe(level, metrics_client)

        if args.compare:
            compare, levels = await run_comparison(
                targets[0], targets[1], _arrivals(args), level_settings, corpus, observe, rounds=args.rounds
            )
        elif args.find_capacity:
            capacity, levels = await run_capacity_search(
                targets[0],
                level_settings,
                corpus,
                observe,
                max_sessions=args.max_sessions,
                tolerance=args.capacity_tolerance,
                ramp_s=args.ramp,
            )
        else:
            levels = await run_levels(targets[0], _arrivals(args), level_settings, corpus, observe)
    report = LoadTestReport(
        version=REPORT_VERSION,
        created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        settings=RunSettings(
            duration_s=args.duration,
            warmup_s=args.warmup,
            ramp_s=args.ramp,
            drain_s=args.drain,
            seed=args.seed,
            words_per_second=args.words_per_second,
            utterances_per_session=args.utterances_per_session,
            jitter_ms=args.jitter_ms,
            slo_ttfa_ms=slo.limit_ms,
            utterance_timeout_s=args.utterance_timeout,
            corpus=str(args.corpus) if args.corpus else "shipped",
            corpus_entries=len(corpus),
            api_key_sent=api_key is not None,
            compression_offered=args.compression,
            response_format=args.response_format,
            slo_basis=slo.basis,
        ),
        levels=levels,
        capacity=capacity,
        compare=compare,
    )
    return _finish(report, args, api_key, console, errors)


def _finish(
    report: LoadTestReport, args: argparse.Namespace, api_key: ApiKey | None, console: Console, errors: Console
) -> int:
    if not args.quiet:
        console.print(summary_table(report.levels))
        console.print(f"SLO: p99 TTFA < {report.settings.slo_ttfa_ms:g} ms ({report.settings.slo_basis})")
        console.print(negotiated_text(report.levels))
        if (steps := turn_steps_text(report.levels)) is not None:
            console.print(steps)
        if report.capacity is not None:
            console.print(capacity_text(report.capacity))
        if report.compare is not None:
            console.print(compare_table(report.compare))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        encoded = msgspec.json.format(msgspec.json.encode(report), indent=2)
        args.out.write_bytes(api_key.redact_json(encoded) if api_key is not None else encoded)
        if not args.quiet:
            console.print(f"report written to {args.out}")
    if args.plots is not None:
        from omnigate.loadtest.plots import write_plots

        written = write_plots(report, args.plots)
        if not args.quiet:
            console.print(f"plots written: {', '.join(str(path) for path in written)}")
    pooled = [side for level in report.compare.levels for side in (level.a, level.b)] if report.compare else []
    problems = [
        f"{level.target.label}: {problem}"
        for level in report.levels + pooled
        for problem in consistency_problems(level)
    ]
    for problem in problems:
        errors.print(f"[red]report inconsistency[/red] {problem}")
    refusals = [
        f"{level.target.label}: {notice}"
        for level in report.levels
        if (notice := auth_refusal_notice((s.errors for s in level.session_records), api_key is not None))
    ]
    for refusal in refusals:
        errors.print(f"[red]not authorized[/red] {refusal}")
    unreached = not refusals and _nothing_connected(report)
    if unreached:
        examples = "; ".join(f"{code}: {text}" for code, text in report.levels[0].error_examples.items())
        errors.print(f"[red]no session connected[/red] to {report.levels[0].target.url} ({examples or 'no error'})")
    missed = [] if unreached else _missed_slo(report)
    for miss in missed:
        errors.print(f"[red]SLO missed[/red] {miss}")
    return 1 if problems or refusals or unreached or missed else 0


def _nothing_connected(report: LoadTestReport) -> bool:
    records = [record for level in report.levels for record in level.session_records]
    return bool(records) and all(record.connect_ms is None for record in records)


def _missed_slo(report: LoadTestReport) -> list[str]:
    """What fails the run's verdict: a level that missed the SLO (a comparison's sides pooled over its rounds),
    or a capacity search in which no level met it."""
    if report.capacity is not None:
        if report.capacity.result.capacity == 0:
            return [f"{report.capacity.target.label}: no level met it, down to 1 session"]
        return []
    judged = [side for level in report.compare.levels for side in (level.a, level.b)] if report.compare else []
    return [
        f"{level.target.label} @ {arrival_label(level.arrival)}: {'; '.join(level.slo.reasons)}"
        for level in judged or report.levels
        if not level.slo.passed
    ]


def _event_loop_runner() -> asyncio.Runner:
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


def _run_coroutine(coroutine: Coroutine[Any, Any, int]) -> int:
    with _event_loop_runner() as runner:
        return runner.run(coroutine)


async def _baseline_until_stopped(args: argparse.Namespace) -> int:
    settings = BaselineSettings(
        sample_rate=args.sample_rate,
        chunk_ms=args.chunk_ms,
        ms_per_char=args.ms_per_char,
        rtf=args.rtf,
        first_chunk_ms=args.first_chunk_ms,
        compression=args.compression,
    )
    await run_baseline(args.host, args.port, settings)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``omnigate-loadtest`` console script."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["soak"]:
        from omnigate.loadtest.soak import main as soak_main

        return soak_main(arguments[1:])
    if arguments[:1] == ["baseline"]:
        baseline_args = baseline_parser().parse_args(arguments[1:])
        return _run_coroutine(_baseline_until_stopped(baseline_args))
    if arguments[:1] == ["standins"]:
        from omnigate.loadtest.openai_standins import serve_standins, standins_parser

        return _run_coroutine(serve_standins(standins_parser().parse_args(arguments[1:])))
    if arguments[:1] in (["-h"], ["--help"]):
        top_parser().print_help()
        return 0
    if arguments[:1] == ["run"]:
        arguments = arguments[1:]
    elif arguments and not arguments[0].startswith("-") and (problem := url_problem(arguments[0])) is not None:
        # A mistyped subcommand is refused here, before it is taken for the URL of a run.
        top_parser().error(unknown_subcommand_message(arguments[0], problem))
    parser = run_parser()
    args = parser.parse_args(arguments)
    _validate(parser, args)
    try:
        formats = target_class(args.target).formats
        if args.response_format is not None and args.response_format not in formats:
            raise ValueError(f"--format: the {args.target} target measures {', '.join(formats)}")
        specs = target_specs(args)
        slo = resolve_slo(args.slo_ttfa_ms, specs)
        api_key = resolve_api_key(args.api_key, os.environ)
    except ValueError as exc:
        parser.error(str(exc))
    # Off a terminal rich assumes 80 columns, too narrow for the summary table.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    errors = Console(stderr=True)
    try:
        return _run_coroutine(_run(args, specs, slo, api_key, console, errors))
    except KeyboardInterrupt:
        errors.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
