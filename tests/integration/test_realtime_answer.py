"""``WS /v1/realtime`` answering the user: the piper voice, an LLM and a speech recognizer over real HTTP.

The LLM and the recognizer are the OpenAI-compatible stand-ins, served on real sockets by the test; the gateway
runs as ``omnigate serve --llm-url ... --asr-url ...`` runs it, with the piper engine. The user's speech is real:
the piper voice says it, and the gateway's VAD has to find it. The client is the ``openai`` SDK's realtime client,
and every server event is checked against the SDK's models.
"""

from __future__ import annotations

import base64
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from openai.resources.realtime.realtime import AsyncRealtimeConnection

from omnigate.codecs.resample import StreamResampler
from omnigate.engines.piper import PiperEngine
from omnigate.gateway.settings import ResponderSettings, Settings
from omnigate.loadtest.openai_standins import ScriptedReply, StandinConfig, StandinServer
from tests.audio_checks import speech_fraction
from tests.integration.test_realtime_ws import pcm_of, realtime, recv, until
from tests.serving import RunningServer, serve

pytestmark = pytest.mark.integration

APPEND_BYTES = 4800  # 100 ms at 24 kHz
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
LONG_REPLY = " ".join(["This answer goes on, clause after clause, so that it is still being spoken."] * 8)


@contextmanager
def answering_server(
    piper: PiperEngine, llm_url: str, asr_url: str | None, **responder: Any
) -> Iterator[RunningServer]:
    settings = Settings(responder=ResponderSettings(llm_url=llm_url, asr_url=asr_url, **responder))
    with serve(settings, engine=piper) as server:
        yield server


def utterance(piper: PiperEngine, text: str, silence_s: float = 1.0) -> bytes:
    """``text`` in the piper voice at 24 kHz, then silence long enough to end the turn."""
    samples = piper.synthesize(text, speaker_id=None, speed=1.0)
    resampler = StreamResampler(piper.info.sample_rate, 24000)
    speech = resampler.process(samples.astype("<i2").tobytes()) + resampler.flush()
    return speech + bytes(int(48000 * silence_s))


async def say(connection: AsyncRealtimeConnection, pcm: bytes) -> None:
    for offset in range(0, len(pcm), APPEND_BYTES):
        await connection.input_audio_buffer.append(audio=base64.b64encode(pcm[offset : offset + APPEND_BYTES]).decode())


async def ask_in_text(connection: AsyncRealtimeConnection, text: str) -> None:
    await connection.conversation.item.create(
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    )
    await connection.response.create()


async def opened(connection: AsyncRealtimeConnection, **session: Any) -> dict[str, Any]:
    created = await recv(connection)
    assert created["type"] == "session.created"
    if session:
        await connection.session.update(session={"type": "realtime", **session})
        assert (await recv(connection))["type"] == "session.updated"
    return created


def errors(events: list[dict[str, Any]]) -> list[str]:
    return [e["error"]["code"] for e in events if e["type"] == "error"]


async def test_a_spoken_question_gets_a_spoken_answer_with_its_timings(piper_engine: PiperEngine) -> None:
    question = "What is the capital of France?"
    config = StandinConfig(transcripts=[question], asr_delay_ms=50, llm_first_token_ms=50)
    async with StandinServer(config) as standins:
        with answering_server(piper_engine, standins.base_url, standins.base_url) as server:
            async with realtime(server) as connection:
                created = await opened(connection, instructions="Answer in one sentence.")
                assert created["session"]["capabilities"]["input_transcription"] is True
                speech = utterance(piper_engine, question)
                await say(connection, speech)
                events = await until(connection, "response.done")
    kinds = [e["type"] for e in events]
    for kind in (
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.input_audio_transcription.completed",
        "response.created",
        "response.output_audio_transcript.delta",
        "response.output_audio.delta",
    ):
        assert kind in kinds, kind
    completed = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert completed["transcript"] == question
    done = events[-1]["response"]
    assert done["status"] == "completed", done
    transcript = done["output"][0]["content"][0]["transcript"]
    assert transcript.startswith("You said: What is the capital of France")
    audio = pcm_of(events)
    assert len(audio) / 48 > 2000  # seconds of reply, not a click
    assert speech_fraction(audio, 24000) > 0.5
    metadata = done["metadata"]
    for key in ("transcript_ms", "asr_ms", "first_token_ms", "llm_ms", "first_audio_ms", "tts_ms", "overhead_ms"):
        assert float(metadata[f"omnigate_{key}"]) >= 0.0, key
    assert float(metadata["omnigate_asr_ms"]) >= 50.0  # the stand-in's own delay is inside
    # The recognizer heard the utterance, not the whole stream: it starts near the speech and ends at the pause.
    (heard_s,) = standins.state.stats.asr_audio_s
    speech_s = len(speech) / 48000 - 1.0
    assert speech_s - 0.5 < heard_s < speech_s + 1.2
    request = standins.state.stats.last_chat_request
    assert request is not None
    assert request["messages"][0] == {"role": "system", "content": "Answer in one sentence."}
    assert request["messages"][-1] == {"role": "user", "content": question}
    assert request["stream"] is True


async def test_tools_are_passed_through_and_answered_after_the_client_runs_them(piper_engine: PiperEngine) -> None:
    async with StandinServer() as standins:
        with answering_server(piper_engine, standins.base_url, None) as server:
            async with realtime(server) as connection:
                await opened(connection, tools=[WEATHER], tool_choice="auto")
                await ask_in_text(connection, "What is the weather in Paris?")
                events = await until(connection, "response.done")
                done = events[-1]["response"]
                assert done["status"] == "completed"
                call = next(item for item in done["output"] if item["type"] == "function_call")
                assert call["name"] == "get_weather"
                arguments_done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
                assert arguments_done["call_id"] == call["call_id"]
                deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
                assert deltas == arguments_done["arguments"] == call["arguments"]
                assert "Paris" in call["arguments"]
                await connection.conversation.item.create(
                    item={"type": "function_call_output", "call_id": call["call_id"], "output": '{"sky": "clear"}'}
                )
                await connection.response.create()
                events = await until(connection, "response.done")
    done = events[-1]["response"]
    assert done["status"] == "completed"
    assert done["output"][0]["content"][0]["transcript"].startswith("The tool answered:")
    assert speech_fraction(pcm_of(events), 24000) > 0.5
    request = standins.state.stats.last_chat_request
    assert request is not None
    assert [m["role"] for m in request["messages"]] == ["user", "assistant", "tool"]
    assert request["tools"][0]["function"]["name"] == "get_weather"


async def test_barge_in_cancels_the_llm_stream_the_speech_and_the_queued_audio(piper_engine: PiperEngine) -> None:
    # A slow LLM: the reply is still streaming, and being spoken, when the user talks over it.
    config = StandinConfig(replies=[ScriptedReply(text=LONG_REPLY)], llm_tokens_per_s=8, transcripts=["Stop."])
    async with StandinServer(config) as standins:
        with answering_server(piper_engine, standins.base_url, standins.base_url) as server:
            async with realtime(server) as connection:
                await opened(connection)
                await ask_in_text(connection, "Tell me everything.")
                events = await until(connection, "response.output_audio.delta")
                first = events[-1]["response_id"]
                await say(connection, utterance(piper_engine, "Stop, please."))
                events = await until(connection, "response.done")
                done = events[-1]["response"]
                assert done["id"] == first
                assert done["status"] == "cancelled"
                assert done["status_details"]["reason"] == "turn_detected"
                assert await standins.state.wait_for({"llm_disconnects": 1}, timeout_s=10)
                # Nothing of the cancelled response comes after its end; the next turn is answered.
                events = await until(connection, "response.done")
    assert all(e.get("response_id") in (None, events[-1]["response"]["id"]) for e in events)
    assert events[-1]["response"]["status"] == "completed"
    heard = done["output"][0]["content"][0]["transcript"]
    assert heard and LONG_REPLY.replace(" ", "").startswith(heard.replace(" ", ""))
    assert len(heard) < len(LONG_REPLY)
    request = standins.state.stats.last_chat_request
    assert request is not None
    said = [m for m in request["messages"] if m["role"] == "assistant"]
    assert said and said[-1]["content"] == heard.strip()  # the LLM is told what the user heard of its answer


async def test_response_cancel_closes_the_llm_stream(piper_engine: PiperEngine) -> None:
    config = StandinConfig(replies=[ScriptedReply(text=LONG_REPLY)], llm_tokens_per_s=8)
    async with StandinServer(config) as standins:
        with answering_server(piper_engine, standins.base_url, None) as server:
            async with realtime(server) as connection:
                await opened(connection)
                await ask_in_text(connection, "Tell me everything.")
                await until(connection, "response.output_audio_transcript.delta")
                await connection.response.cancel()
                events = await until(connection, "response.done")
                assert events[-1]["response"]["status"] == "cancelled"
                assert await standins.state.wait_for({"llm_disconnects": 1}, timeout_s=10)


@pytest.mark.parametrize(
    ("mode", "code"),
    [("error", "llm_error"), ("garbage", "llm_bad_response"), ("hang", "llm_timeout"), ("drop", "llm_bad_response")],
)
async def test_a_failing_llm_fails_the_turn_typed_and_the_session_recovers(
    piper_engine: PiperEngine, mode: str, code: str
) -> None:
    async with StandinServer(StandinConfig(llm_mode=mode)) as standins:  # type: ignore[arg-type]
        with answering_server(
            piper_engine, standins.base_url, None, llm_first_token_timeout_s=1.0, llm_idle_timeout_s=1.0
        ) as server:
            async with realtime(server) as connection:
                await opened(connection)
                await ask_in_text(connection, "Are you there?")
                events = await until(connection, "response.done")
                assert errors(events) == [code]
                done = events[-1]["response"]
                assert done["status"] == "failed"
                assert done["status_details"]["error"]["code"] == code
                assert "response.output_audio.delta" not in [e["type"] for e in events]
                standins.state.config.llm_mode = "ok"
                await ask_in_text(connection, "And now?")
                events = await until(connection, "response.done")
    assert events[-1]["response"]["status"] == "completed"
    assert pcm_of(events)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_an_unreachable_llm_is_typed_and_the_session_stays(piper_engine: PiperEngine) -> None:
    with answering_server(piper_engine, f"http://127.0.0.1:{_closed_port()}/v1", None) as server:
        async with realtime(server) as connection:
            await opened(connection)
            for _ in range(2):
                await ask_in_text(connection, "Hello?")
                events = await until(connection, "response.done")
                assert errors(events) == ["llm_unavailable"]
                assert events[-1]["response"]["status"] == "failed"


async def test_a_failing_recognizer_fails_the_turn_and_the_next_turn_works(piper_engine: PiperEngine) -> None:
    async with StandinServer(StandinConfig(asr_mode="error")) as standins:
        with answering_server(piper_engine, standins.base_url, standins.base_url) as server:
            async with realtime(server) as connection:
                await opened(connection)
                speech = utterance(piper_engine, "Hello there, how are you?")
                await say(connection, speech)
                events = await until(connection, "response.done")
                failed = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.failed")
                assert failed["error"]["code"] == "asr_error"
                assert events[-1]["response"]["status"] == "failed"
                assert standins.state.stats.llm_requests == 0
                standins.state.config.asr_mode = "ok"
                await say(connection, speech)
                events = await until(connection, "response.done")
    assert events[-1]["response"]["status"] == "completed"
    assert any(e["type"] == "conversation.item.input_audio_transcription.completed" for e in events)


async def test_text_turns_need_no_recognizer_and_keep_the_history(piper_engine: PiperEngine) -> None:
    async with StandinServer() as standins:
        with answering_server(piper_engine, standins.base_url, None, embedded_asr=False) as server:
            async with realtime(server) as connection:
                created = await opened(connection)
                assert created["session"]["capabilities"]["input_transcription"] is False
                await ask_in_text(connection, "My name is Ada.")
                first = await until(connection, "response.done")
                await ask_in_text(connection, "What is my name?")
                await until(connection, "response.done")
    request = standins.state.stats.last_chat_request
    assert request is not None
    assert [m["role"] for m in request["messages"]] == ["user", "assistant", "user"]
    assert request["messages"][1]["content"] == first[-1]["response"]["output"][0]["content"][0]["transcript"].strip()


async def test_a_client_that_leaves_mid_reply_closes_the_llm_stream(piper_engine: PiperEngine) -> None:
    async with StandinServer(StandinConfig(llm_mode="hang")) as standins:
        # A patient client: only the session's end can close the request within the test's wait.
        with answering_server(piper_engine, standins.base_url, None, llm_first_token_timeout_s=60.0) as server:
            async with realtime(server) as connection:
                await opened(connection)
                await ask_in_text(connection, "Are you there?")
                await until(connection, "response.created")
                assert await standins.state.wait_for({"llm_requests": 1}, timeout_s=10)
            # The session's tasks end with it: the request it held is closed, not left to time out.
            assert await standins.state.wait_for({"llm_disconnects": 1}, timeout_s=10)
