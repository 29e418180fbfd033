"""The bare-websockets baseline: its sentence cutting, audio, and one session on loopback."""

from __future__ import annotations

import json
import time

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from omnigate.loadtest.baseline import BaselineSettings, baseline_server, bound_address, split_units, tone_chunk
from omnigate.loadtest.report import TargetSpec
from omnigate.loadtest.targets.base import SessionSettings
from omnigate.loadtest.targets.ws_connect import EXTENSIONS_KEY, connect_traced
from omnigate.loadtest.targets.ws_speech import WsSpeechTarget
from omnigate.loadtest.traces import SessionTrace


def test_sentences_are_released_at_punctuation_followed_by_whitespace() -> None:
    assert split_units("Hello there. How", 120) == (["Hello there."], "How")
    assert split_units("Pi is 3.14 ok", 120) == ([], "Pi is 3.14 ok")
    assert split_units('He said "stop!" Then', 120) == (['He said "stop!"'], "Then")
    assert split_units("One. Two? Three! ", 120) == (["One.", "Two?", "Three!"], "")


def test_long_text_without_punctuation_is_released_at_the_limit() -> None:
    units, rest = split_units("word " * 30, 120)
    assert units == [("word " * 30).strip()]
    assert rest == ""


def test_tone_chunk_is_forty_milliseconds_of_s16le() -> None:
    chunk = tone_chunk(24_000, 40)
    assert len(chunk) == 960 * 2
    assert chunk != bytes(len(chunk))


async def test_one_utterance_gets_the_protocol_events_and_audio_of_its_length() -> None:
    settings = BaselineSettings(rtf=0.0)
    async with baseline_server("127.0.0.1", 0, settings) as server:
        host, port = bound_address(server)
        async with connect(f"ws://{host}:{port}/v1/audio/speech/stream", compression=None) as ws:
            await ws.send(json.dumps({"type": "session.config", "response_format": "pcm", "stream_audio": True}))
            await ws.send(json.dumps({"type": "input.text", "text": "Hello there. Bye"}))
            await ws.send(json.dumps({"type": "input.done"}))
            events: list[dict[str, object]] = []
            audio_bytes = 0
            async for message in ws:
                if isinstance(message, bytes):
                    audio_bytes += len(message)
                    continue
                event = json.loads(message)
                events.append(event)
                if event["type"] == "session.done":
                    break
            await ws.send(json.dumps({"type": "session.close"}))
    types = [event["type"] for event in events]
    assert types == ["audio.start", "audio.done", "audio.start", "audio.done", "session.done"]
    assert events[0]["sentence_text"] == "Hello there."
    assert events[2]["sentence_text"] == "Bye"
    expected = round(len("Hello there.") * 60 * 24) * 2 + round(len("Bye") * 60 * 24) * 2
    assert audio_bytes == expected
    assert events[1]["total_bytes"] == round(len("Hello there.") * 60 * 24) * 2
    assert events[4] == {"type": "session.done", "total_sentences": 2, "utterance_index": 0, "status": "completed"}


async def test_other_paths_are_refused() -> None:
    async with baseline_server("127.0.0.1", 0, BaselineSettings()) as server:
        host, port = bound_address(server)
        with pytest.raises(InvalidStatus) as refused:
            await connect(f"ws://{host}:{port}/elsewhere")
    assert refused.value.response.status_code == 404


@pytest.mark.parametrize(
    ("server_accepts", "client_offers", "answer"),
    [
        (False, True, "none"),
        (True, True, "permessage-deflate"),
        (True, False, "none"),
    ],
)
async def test_the_load_test_offers_compression_by_default_and_records_the_answer(
    server_accepts: bool, client_offers: bool, answer: str
) -> None:
    settings = BaselineSettings(rtf=0.0, compression=server_accepts)
    async with baseline_server("127.0.0.1", 0, settings) as server:
        host, port = bound_address(server)
        spec = TargetSpec(label="baseline", target="ws-speech", url=f"ws://{host}:{port}")
        target = WsSpeechTarget(spec, SessionSettings(words_per_second=0, compression=client_offers))
        trace = SessionTrace(0, time.perf_counter())
        await target.run_session(["Hello there."], trace)
        trace.end(time.perf_counter())
    assert trace.status == "completed", trace.errors
    assert trace.negotiated[EXTENSIONS_KEY].split(";")[0] == answer
    assert trace.negotiated["format"] == "pcm 24000 Hz"


async def test_a_client_at_the_default_offers_permessage_deflate() -> None:
    async with baseline_server("127.0.0.1", 0, BaselineSettings(rtf=0.0)) as server:
        host, port = bound_address(server)
        trace = SessionTrace(0, 0.0)
        connection = await connect_traced(f"ws://{host}:{port}/v1/audio/speech/stream", 5.0, trace)
        assert connection is not None
        async with connection:
            assert connection.request is not None
            assert "permessage-deflate" in connection.request.headers["Sec-WebSocket-Extensions"]
    assert trace.negotiated == {EXTENSIONS_KEY: "none"}
