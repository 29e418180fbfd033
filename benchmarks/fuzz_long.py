"""The long fuzzing run: a million generated messages (and some HTTP bodies) against a server in its own process.

Same generators and properties as ``tests/fuzz`` (see ``tests/fuzz/harness.py``), without shrinking; stops at the
first violation and prints it. Afterwards the server must be alive, hold no session or engine stream, and have
logged no error. Run from the repository root:

    .venv/bin/python -m benchmarks.fuzz_long --messages 1000000 --out docs/reliability/results/fuzz-long.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from omnigate.loadtest.footprint import settled_footprint
from omnigate.loadtest.server_process import server_process
from tests.fuzz.harness import (
    FuzzMessage,
    HttpRequest,
    HttpTarget,
    Tally,
    WsTarget,
    run_http_case,
    run_ws_case,
    transport_expectation,
)
from tests.fuzz.server import fuzz_settings
from tests.fuzz.targets import all_targets

LONG = settings(
    deadline=None,
    database=None,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)


def serve_args() -> list[str]:
    """``omnigate serve`` options equal to :func:`tests.fuzz.server.fuzz_settings` (the harness's expectations)."""
    s = fuzz_settings()
    return [
        "--engine",
        s.engine,
        "--model",
        str(s.model),
        "--ws-max-message-bytes",
        str(s.ws_max_message_bytes),
        "--idle-timeout",
        str(s.idle_timeout_s),
        "--config-timeout",
        str(s.config_timeout_s),
        "--log-level",
        "warning",
        "--video-model",
        str(s.video_model),
        *[arg for key, value in s.video_options.items() for arg in ("--video-option", f"{key}={value}")],
        "--omni-model",
        str(s.omni_model),
    ]


def closing_last(target: WsTarget, batch: list[FuzzMessage]) -> list[FuzzMessage]:
    """The batch with the messages that end a session moved to the end (only the first of them is ever sent), so
    sessions are long and the run spends its time on messages rather than on handshakes."""
    limits = fuzz_settings()

    def closes(message: FuzzMessage) -> bool:
        expectation = transport_expectation(message, limits) or target.expect(message, limits)
        return expectation.outcome == "close"

    return [m for m in batch if not closes(m)] + [m for m in batch if closes(m)][:1]


def fuzz_ws(runner: asyncio.Runner, url: str, target: WsTarget, messages: int, chunk: int, tally: Tally) -> None:
    generated = target.generated()
    round_index = 0
    while tally.messages < messages:

        @seed(round_index)
        @settings(LONG, max_examples=chunk)
        @given(st.lists(generated, min_size=16, max_size=64))
        def fuzz(batch: list[FuzzMessage]) -> None:
            tally.add(runner.run(run_ws_case(url, target, closing_last(target, batch), fuzz_settings())))

        fuzz()
        round_index += 1
        print(
            f"{target.name}: {tally.messages} messages, {tally.errors} typed errors, {tally.closes} closes", flush=True
        )


def fuzz_http(runner: asyncio.Runner, url: str, target: HttpTarget, requests: int, tally: Tally) -> None:
    generated = target.generated()

    async def case(batch: list[HttpRequest]) -> Tally:
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
            return await run_http_case(client, target, batch)

    @seed(0)
    @settings(LONG, max_examples=max(1, requests // 8))
    @given(st.lists(generated, min_size=1, max_size=16))
    def fuzz(batch: list[HttpRequest]) -> None:
        tally.add(runner.run(case(batch)))

    fuzz()
    print(f"{target.name}: {tally.requests} requests {dict(sorted(tally.by_status.items()))}", flush=True)


def server_errors(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if " ERROR " in line]


def main(args: argparse.Namespace) -> dict[str, Any]:
    targets = all_targets()
    ws_targets = [t for t in targets if isinstance(t, WsTarget)]
    http_targets = [t for t in targets if isinstance(t, HttpTarget)]
    per_ws_target = args.messages // max(1, len(ws_targets))
    tallies: dict[str, Tally] = {}
    failure: str | None = None
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, asyncio.Runner() as runner:
        log = Path(tmp) / "server.log"
        server_cm = server_process(serve_args(), log)
        server = runner.run(server_cm.__aenter__())
        try:
            before = runner.run(settled_footprint(server.url + "/metrics"))
            try:
                for ws_target in ws_targets:
                    tallies[ws_target.name] = Tally()
                    ws_url = server.url.replace("http://", "ws://")
                    fuzz_ws(runner, ws_url, ws_target, per_ws_target, args.chunk, tallies[ws_target.name])
                for http_target in http_targets:
                    tallies[http_target.name] = Tally()
                    fuzz_http(runner, server.url, http_target, args.http_requests, tallies[http_target.name])
            except Exception as exc:  # the property violation, with hypothesis's falsifying example in its notes
                notes = "\n".join(getattr(exc, "__notes__", []))
                failure = f"{type(exc).__name__}: {exc}\n{notes}"
            after = runner.run(settled_footprint(server.url + "/metrics", limit_s=60.0))
            alive = server.process.returncode is None
        finally:
            runner.run(server_cm.__aexit__(None, None, None))
        errors = server_errors(log)
    elapsed = time.perf_counter() - started
    total = Tally()
    for tally in tallies.values():
        total.add(tally)
    return {
        "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "messages": total.messages,
        "ws_sessions": total.sessions,
        "typed_errors": total.errors,
        "typed_closes": total.closes,
        "http_requests": total.requests,
        "http_statuses": dict(sorted(total.by_status.items())),
        "per_target": {name: dataclasses.asdict(t) for name, t in tallies.items()},
        "property_violations": [failure] if failure else [],
        "server_alive": alive,
        "server_errors_logged": errors[:20],
        "footprint_before": before,
        "footprint_after": after,
        "seconds": round(elapsed, 1),
        "messages_per_second": round(total.messages / elapsed, 1) if elapsed else None,
        "crashes": int(not alive) + len(errors) + int(failure is not None),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=1_000_000, help="WebSocket messages, over all WS targets")
    parser.add_argument("--http-requests", type=int, default=20_000, help="requests per HTTP target")
    parser.add_argument("--chunk", type=int, default=500, help="hypothesis examples per seed round")
    parser.add_argument("--out", type=Path)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    report = main(arguments)
    text = msgspec.json.format(msgspec.json.encode(report), indent=2)
    print(text.decode())
    if arguments.out is not None:
        arguments.out.parent.mkdir(parents=True, exist_ok=True)
        arguments.out.write_bytes(text + b"\n")
    raise SystemExit(1 if report["crashes"] else 0)
