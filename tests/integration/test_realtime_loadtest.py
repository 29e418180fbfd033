"""The load-test ``realtime`` target against the real server: a TTS engine turn by turn, and a duplex engine."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from omnigate.gateway.settings import ResponderSettings, Settings
from omnigate.loadtest.openai_standins import StandinConfig, StandinServer
from omnigate.loadtest.report import LoadTestReport, TargetSpec
from omnigate.loadtest.targets import target_class
from omnigate.loadtest.targets.base import SessionSettings
from omnigate.loadtest.targets.realtime import (
    SPEECH_FILE,
    TALK_SLO,
    RealtimeOptions,
    RealtimeTarget,
    load_speech,
    split_options,
)
from omnigate.loadtest.traces import SessionTrace
from tests.audio_checks import speech_fraction
from tests.serving import RunningServer, serve

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def duplex_server() -> Iterator[RunningServer]:
    with serve(Settings(engine="duplex", model="preset:tiny", engine_options={"max_sessions": "2"})) as server:
        yield server


def test_options_come_from_the_fragment_and_the_speech_is_real() -> None:
    url, options = split_options("ws://h:1/v1/realtime?duplex=1#append_ms=20&barge_in_ms=500")
    assert url == "ws://h:1/v1/realtime?duplex=1"
    assert options == RealtimeOptions(append_ms=20, barge_in_ms=500.0)
    with pytest.raises(ValueError, match="append_ms"):
        split_options("ws://h:1/v1/realtime#append_ms=5")
    speech = load_speech(SPEECH_FILE)
    assert 1.8 < len(speech) / 48000 < 2.5  # 24 kHz s16le
    assert speech_fraction(speech, 24000) > 0.6
    assert target_class("realtime") is RealtimeTarget


async def test_a_voice_agent_turn_against_a_tts_engine(synthetic_server: RunningServer) -> None:
    spec = TargetSpec(label="rt", target="realtime", url=synthetic_server.http_url + "#append_ms=40")
    target = RealtimeTarget(spec, SessionSettings(utterance_timeout_s=30.0))
    trace = SessionTrace(0, time.perf_counter())
    await target.run_session(["Sure, a table for two at eight."], trace)
    trace.end(time.perf_counter())
    assert trace.status == "completed", dict(trace.errors)
    # The client offered permessage-deflate, as clients at their defaults do; media routes answer none.
    assert trace.negotiated == {"websocket_extensions": "none", "format": "audio/pcm 24000 Hz"}
    (utterance,) = trace.utterances
    assert utterance.status == "completed" and utterance.audio_ms > 1000.0
    latency = utterance.ttfa_ms()
    # Voice to voice: the server VAD needs its 500 ms of silence to end the turn before the reply starts.
    assert latency is not None and 300.0 < latency < 5000.0


async def test_barge_in_against_a_duplex_engine(duplex_server: RunningServer) -> None:
    spec = TargetSpec(label="rt", target="realtime", url=duplex_server.ws_url + "/v1/realtime#barge_in_ms=400")
    target = RealtimeTarget(spec, SessionSettings(utterance_timeout_s=60.0))
    trace = SessionTrace(0, time.perf_counter())
    await target.run_session(["(the model answers)"], trace)
    trace.end(time.perf_counter())
    assert trace.status == "completed", dict(trace.errors)
    assert len(target.barge_in_ms) == len(target.cancel_to_done_ms) == 1
    assert target.barge_in_ms[0] >= 0.0 and target.cancel_to_done_ms[0] > 0.0
    assert trace.utterances[0].audio_ms >= 400.0


async def test_the_cli_judges_talk_mode_by_its_voice_to_voice_slo(tmp_path: Path) -> None:
    """A talk-mode run of the real CLI against a server answering through its LLM (the stand-ins): without
    --slo-ttfa-ms the report applies talk mode's SLO and says so; a level that misses it names that limit."""
    out = tmp_path / "talk.json"
    config = StandinConfig(asr_delay_ms=50, llm_first_token_ms=50)
    async with StandinServer(config) as standins:
        settings = Settings(
            engine="synthetic",
            model="rtf=0.1",
            responder=ResponderSettings(llm_url=standins.base_url, asr_url=standins.base_url),
        )
        with serve(settings) as server:
            command = [str(Path(sys.executable).with_name("omnigate-loadtest")), server.http_url + "#talk=1"]
            command += ["--target", "realtime", "--sessions", "1", "--duration", "1", "--warmup", "0"]
            command += ["--drain", "60", "--no-metrics", "--quiet", "--out", str(out)]
            cli = await asyncio.create_subprocess_exec(*command, stderr=asyncio.subprocess.PIPE)
            async with asyncio.timeout(120):
                _, stderr = await cli.communicate()
    report = msgspec.json.decode(out.read_bytes(), type=LoadTestReport)
    assert (report.settings.slo_ttfa_ms, report.settings.slo_basis) == (TALK_SLO.limit_ms, TALK_SLO.basis)
    (level,) = report.levels
    assert level.errors == {}, level.error_examples
    assert level.utterances.completed == level.utterances.total > 0
    assert cli.returncode == (0 if level.slo.passed else 1), stderr.decode()
    assert all("ms >= 100 ms" not in reason for reason in level.slo.reasons)
