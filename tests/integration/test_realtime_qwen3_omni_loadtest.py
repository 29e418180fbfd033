"""The load test's ``realtime`` target against ``serve --engine qwen3-omni`` (``preset:tiny`` on the CPU): spoken
turns answered by the model itself, ended by the server's VAD or by the client's commit, through the real CLI."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from omnigate.gateway.settings import Settings
from omnigate.loadtest.report import LoadTestReport, TargetSpec
from omnigate.loadtest.targets.base import SessionSettings
from omnigate.loadtest.targets.realtime import RealtimeTarget
from omnigate.loadtest.traces import SessionTrace
from tests.serving import RunningServer, serve

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def omni_server() -> Iterator[RunningServer]:
    settings = Settings(
        engine="qwen3-omni", model="preset:tiny", engine_options={"max_sessions": "2", "max_context": "512"}
    )
    with serve(settings) as server:
        yield server


async def test_a_spoken_turn_the_server_vad_ends_is_answered_and_timed(omni_server: RunningServer) -> None:
    spec = TargetSpec(label="rt", target="realtime", url=omni_server.http_url + "#max_output_tokens=4")
    target = RealtimeTarget(spec, SessionSettings(utterance_timeout_s=60.0))
    trace = SessionTrace(0, time.perf_counter())
    await target.run_session(["(the model answers)"], trace)
    trace.end(time.perf_counter())
    # The client asked for no answer itself: the model answered the speech, capped as the client set.
    assert trace.status == "completed", dict(trace.errors)
    (utterance,) = trace.utterances
    assert utterance.status == "completed" and utterance.audio_ms > 0
    assert utterance.steps["end_of_turn"] > 0 and utterance.steps["turn_to_audio"] > 0
    assert [set(t) >= {"client_voice_to_voice", "client_turn_to_audio"} for t in target.turn_timings] == [True]


async def test_the_cli_measures_turns_the_client_commits(omni_server: RunningServer, tmp_path: Path) -> None:
    out = tmp_path / "omni.json"
    command = [str(Path(sys.executable).with_name("omnigate-loadtest"))]
    command += [omni_server.http_url + "#commit=1&max_output_tokens=4", "--target", "realtime", "--sessions", "2"]
    command += ["--duration", "1", "--warmup", "0", "--drain", "90", "--utterance-timeout", "90", "--no-metrics"]
    command += ["--quiet", "--slo-ttfa-ms", "60000", "--out", str(out)]
    cli = await asyncio.create_subprocess_exec(*command, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(200):
        _, stderr = await cli.communicate()
    report = msgspec.json.decode(out.read_bytes(), type=LoadTestReport)
    (level,) = report.levels
    assert level.errors == {}, level.error_examples
    assert level.utterances.completed == level.utterances.total >= 2
    # From the commit to the answer's first audio, per turn; the player's underruns and the streaming RTF too.
    assert level.ttfa_ms.count == level.utterances.completed and (level.ttfa_ms.p50 or 0) > 0
    assert level.rtf.count == level.utterances.completed
    # Whether it passes is the machine's (the CPU plays the tiny model slower than real time): it ran and judged.
    assert cli.returncode in (0, 1) and level.slo.passed == (cli.returncode == 0), stderr.decode()
