"""``WS /v1/realtime`` answering with an LLM that floods, bursts or fails, and a session whose own tasks die.

The gateway runs as ``omnigate serve --engine synthetic --llm-url ... --asr-url ...`` runs it; the LLM and the
recognizer are the OpenAI-compatible stand-ins on real sockets, switched into their failure modes. The client is the
``openai`` SDK's realtime client, every server event checked against the SDK's models.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from openai.resources.realtime.realtime import AsyncRealtimeConnection
from websockets.exceptions import ConnectionClosed

from omnigate.engines.piper import PiperEngine
from omnigate.gateway.realtime.connection import RealtimeConnection
from omnigate.gateway.settings import ResponderSettings, Settings
from omnigate.loadtest.openai_standins import ScriptedReply, ScriptedToolCall, StandinConfig, StandinServer
from omnigate.sessions.realtime.outbox import OutgoingEvent
from omnigate.sessions.realtime.session import RealtimeSession
from tests.integration.test_realtime_answer import WEATHER, ask_in_text, errors, opened, say, utterance
from tests.integration.test_realtime_threads import settled
from tests.integration.test_realtime_ws import pcm_of, realtime, recv, until
from tests.serving import RunningServer, serve

pytestmark = pytest.mark.integration

SHORT_REPLY = "A short answer."


@contextmanager
def responder_server(
    llm_url: str,
    asr_url: str | None = None,
    *,
    max_utterance_audio_s: float = 120.0,
    idle_timeout_s: float = 30.0,
    ms_per_char: float = 1.0,  # of the synthetic voice: a second of audio per 1,000 characters
    **responder: Any,
) -> Iterator[RunningServer]:
    settings = Settings(
        engine="synthetic",
        model=f"sample_rate=24000,ms_per_char={ms_per_char:g}",
        max_utterance_audio_s=max_utterance_audio_s,
        idle_timeout_s=idle_timeout_s,
        responder=ResponderSettings(llm_url=llm_url, asr_url=asr_url, **responder),
    )
    with serve(settings) as server:
        yield server


async def ask_with(connection: AsyncRealtimeConnection, text: str, **response: Any) -> list[dict[str, Any]]:
    await connection.conversation.item.create(
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    )
    await connection.response.create(response=response)  # type: ignore[arg-type]
    return await until(connection, "response.done")


@pytest.mark.parametrize(
    ("server_cap_s", "response"),
    [(120.0, {"max_output_tokens": 100}), (8.0, {})],
    ids=["max_output_tokens", "server_audio_cap"],
)
async def test_a_reply_cut_at_its_audio_cap_closes_its_llm_stream_and_the_next_reply_is_its_own(
    server_cap_s: float, response: dict[str, Any]
) -> None:
    # The LLM streams 50 MB as fast as it is read; the reply may speak 8 s (100 tokens, or the server's cap).
    async with StandinServer(StandinConfig(llm_mode="flood", flood_bytes=50 * 1024 * 1024)) as standins:
        with responder_server(standins.base_url, max_utterance_audio_s=server_cap_s) as server:
            async with realtime(server) as connection:
                await opened(connection)
                events = await ask_with(connection, "Talk to me.", **response)
                done = events[-1]["response"]
                assert done["status"] == "incomplete", done["status_details"]
                assert done["status_details"]["reason"] == "max_output_tokens"
                assert pcm_of(events)
                # The cut reply's request is closed, not read to its end.
                assert await standins.state.wait_for({"llm_disconnects": 1}, timeout_s=30)
                standins.state.config.llm_mode = "ok"
                standins.state.config.default_reply = SHORT_REPLY
                for turn in range(2):
                    events = await ask_with(connection, f"And now, {turn}?")
                    done = events[-1]["response"]
                    assert done["status"] == "completed", done
                    assert done["output"][0]["content"][0]["transcript"].strip() == SHORT_REPLY
                    assert all(e.get("response_id") in (None, done["id"]) for e in events)
                    assert pcm_of(events, done["id"])
                    assert errors(events) == []


BURST_ARGUMENTS = {"city": "Paris", "notes": "n" * 24_000}  # some 3,000 argument pieces of 8 characters


@pytest.mark.parametrize("modalities", [["audio"], ["text"]])
async def test_a_reply_of_thousands_of_tiny_chunks_in_one_read_is_delivered_whole(modalities: list[str]) -> None:
    # The LLM writes a tool call's arguments, then a text reply, each as thousands of small chunks at once.
    reply_text = " ".join(f"word{index}" for index in range(3000)) + "."
    config = StandinConfig(
        llm_mode="burst",
        replies=[
            ScriptedReply(tool_call=ScriptedToolCall(name="get_weather", arguments=BURST_ARGUMENTS)),
            ScriptedReply(text=reply_text),
        ],
    )
    async with StandinServer(config) as standins:
        with responder_server(standins.base_url) as server:
            async with realtime(server) as connection:
                await opened(connection, tools=[WEATHER], output_modalities=modalities)
                events = await ask_with(connection, "What is the weather in Paris?")
                done = events[-1]["response"]
                assert done["status"] == "completed", done
                call = next(item for item in done["output"] if item["type"] == "function_call")
                deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
                assert json.loads(deltas) == json.loads(call["arguments"]) == BURST_ARGUMENTS
                await connection.conversation.item.create(
                    item={"type": "function_call_output", "call_id": call["call_id"], "output": '{"sky": "clear"}'}
                )
                await connection.response.create()
                events = await until(connection, "response.done")
                done = events[-1]["response"]
                assert done["status"] == "completed", done
                if modalities == ["text"]:
                    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
                    assert text == done["output"][0]["content"][0]["text"] == reply_text
                else:
                    assert done["output"][0]["content"][0]["transcript"].startswith("word0 word1")
                    assert pcm_of(events, done["id"])
                assert errors(events) == []


@pytest.mark.parametrize(("mode", "code"), [("error", "asr_error"), ("garbage", "asr_bad_response")])
async def test_a_failed_transcription_is_reported_once(piper_engine: PiperEngine, mode: str, code: str) -> None:
    async with StandinServer(StandinConfig(asr_mode=mode)) as standins:  # type: ignore[arg-type]
        with responder_server(standins.base_url, standins.base_url) as server:
            async with realtime(server) as connection:
                await opened(connection)
                await say(connection, utterance(piper_engine, "Hello there, how are you?"))
                events = await until(connection, "response.done")
    failed = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.failed"]
    assert [e["error"]["code"] for e in failed] == [code]
    assert errors(events) == [code]
    done = events[-1]["response"]
    assert done["status"] == "failed" and done["status_details"]["error"]["code"] == code


async def test_a_first_token_timeout_names_the_configured_limit() -> None:
    # The LLM sends its headers at once and its first token never within the limit.
    async with StandinServer(StandinConfig(llm_first_token_ms=30_000)) as standins:
        with responder_server(standins.base_url, llm_first_token_timeout_s=0.5) as server:
            async with realtime(server) as connection:
                await opened(connection)
                events = await ask_with(connection, "Are you there?")
    (error,) = [e["error"] for e in events if e["type"] == "error"]
    assert error["code"] == "llm_timeout"
    assert error["message"] == "the first token took longer than 0.5 s"
    assert events[-1]["response"]["status_details"]["error"]["message"] == error["message"]


async def read_to_close(connection: AsyncRealtimeConnection) -> tuple[list[dict[str, Any]], ConnectionClosed]:
    """Every event until the server closes, and the close."""
    events: list[dict[str, Any]] = []
    while True:
        try:
            events.append(await recv(connection))
        except ConnectionClosed as closed:
            return events, closed


def _raise(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("injected fault")


def _writer_fault(original: Callable[..., Awaitable[object]]) -> Callable[..., Awaitable[object]]:
    """``next_output`` that fails when the response is about to be announced: the writer raises."""

    async def next_output(self: RealtimeConnection) -> object:
        output = await original(self)
        if isinstance(output, OutgoingEvent) and b'"response.created"' in output.payload:
            raise RuntimeError("injected fault")
        return output

    return next_output


FAULTS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    # The transcription task dies after its call: the response waiting for the transcript never hears of it.
    "transcription": lambda patch: patch.setattr(RealtimeSession, "transcribed", _raise),
    # The LLM task dies past its handlers (the core refuses the delta, then the failure too).
    "llm": lambda patch: (
        patch.setattr(RealtimeSession, "chat_delta", _raise),
        patch.setattr(RealtimeSession, "chat_failed", _raise),
    ),
    # The VAD's scores cannot be taken: no turn would ever end.
    "vad": lambda patch: patch.setattr(RealtimeSession, "speech_scored", _raise),
    # The speech pump dies on its first audio: the response would never end.
    "speech_pump": lambda patch: patch.setattr(RealtimeConnection, "response_audio", _raise),
    # The writer raises; and the reader's client event raises in the core.
    "writer": lambda patch: patch.setattr(
        RealtimeConnection, "next_output", _writer_fault(RealtimeConnection.next_output)
    ),
    "reader": lambda patch: patch.setattr(RealtimeSession, "_on_response_create", _raise),
}


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_a_session_task_that_dies_ends_the_session_typed_and_releases_it(
    piper_engine: PiperEngine, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    speech = utterance(piper_engine, "Hello there, how are you?")
    FAULTS[fault](monkeypatch)
    async with StandinServer(StandinConfig(default_reply=SHORT_REPLY)) as standins:
        # Without the guarantee the session would sit until its idle timeout: 5 s, then closed 4408.
        with responder_server(standins.base_url, standins.base_url, idle_timeout_s=5.0) as server:
            async with realtime(server) as connection:
                await opened(connection)
                if fault in ("transcription", "vad"):
                    await say(connection, speech)
                else:
                    await ask_in_text(connection, "Hello?")
                events, closed = await read_to_close(connection)
            assert closed.rcvd is not None and closed.rcvd.code == 1011
            assert errors(events)[-1] == "server_error"
            await settled(server)
