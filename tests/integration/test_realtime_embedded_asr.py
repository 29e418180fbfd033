"""``WS /v1/realtime`` hearing the user with the embedded recognizer: ``serve --llm-url`` and no ``--asr-url``.

The LLM is the OpenAI-compatible stand-in on a real socket (it repeats what the user said); the gateway runs with the
piper voice; the user's speech is a recorded turn (the piper voice: "Could you book a table for two at eight
tonight?", the same bytes every run). Spoken turns end by the server's VAD or by the client's commit, and the
pocketsphinx decoder in the gateway must hear the words that reach the LLM.
"""

from __future__ import annotations

import pytest

from omnigate.engines.piper import PiperEngine
from omnigate.loadtest.openai_standins import StandinServer
from omnigate.loadtest.targets.realtime import SPEECH_FILE, load_speech
from tests.integration.test_realtime_answer import answering_server, errors, opened, say
from tests.integration.test_realtime_ws import realtime, until

pytestmark = pytest.mark.integration

RECORDED_TURN = load_speech(SPEECH_FILE)
PAUSE = bytes(48_000)  # a second of silence: the VAD ends the turn


def heard_the_question(transcript: str) -> bool:
    # (pocketsphinx's small en-US model hears "if you book a table for today tonight" in this recording)
    return "book a table for" in transcript and transcript.endswith("tonight")


def user_message(standins: StandinServer) -> str:
    request = standins.state.stats.last_chat_request
    assert request is not None
    return str(request["messages"][-1]["content"])


async def test_a_turn_the_vad_ends_is_heard_and_its_words_reach_the_llm(piper_engine: PiperEngine) -> None:
    async with StandinServer() as standins:
        with answering_server(piper_engine, standins.base_url, None) as server:
            async with realtime(server) as connection:
                created = await opened(connection)
                assert created["session"]["capabilities"]["input_transcription"] is True
                await say(connection, PAUSE + RECORDED_TURN + PAUSE)
                events = await until(connection, "response.done")
    assert not errors(events), errors(events)
    kinds = [e["type"] for e in events]
    assert kinds.index("input_audio_buffer.speech_stopped") < kinds.index(
        "conversation.item.input_audio_transcription.completed"
    )
    completed = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert heard_the_question(completed["transcript"])
    assert completed["usage"]["seconds"] > 1.0
    assert user_message(standins) == completed["transcript"]
    assert events[-1]["response"]["status"] == "completed"
    assert standins.state.stats.asr_audio_s == []  # no transcription service was asked


@pytest.mark.parametrize("model", ["whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe"])
async def test_a_committed_turn_naming_an_openai_model_is_heard(piper_engine: PiperEngine, model: str) -> None:
    async with StandinServer() as standins:
        with answering_server(piper_engine, standins.base_url, None) as server:
            async with realtime(server) as connection:
                await opened(
                    connection,
                    audio={"input": {"turn_detection": None, "transcription": {"model": model, "language": "en"}}},
                )
                await say(connection, RECORDED_TURN)
                await connection.input_audio_buffer.commit()
                await connection.response.create()
                events = await until(connection, "response.done")
    assert not errors(events), errors(events)
    completed = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert heard_the_question(completed["transcript"])
    assert user_message(standins) == completed["transcript"]
    assert events[-1]["response"]["status"] == "completed"


async def test_turned_off_spoken_turns_are_not_transcribed(piper_engine: PiperEngine) -> None:
    async with StandinServer() as standins:
        with answering_server(piper_engine, standins.base_url, None, embedded_asr=False) as server:
            async with realtime(server) as connection:
                created = await opened(connection)
                assert created["session"]["capabilities"]["input_transcription"] is False
                await say(connection, PAUSE + RECORDED_TURN + PAUSE)
                events = await until(connection, "input_audio_buffer.committed")
    assert not any(e["type"].startswith("conversation.item.input_audio_transcription") for e in events)
    assert standins.state.stats.llm_requests == 0


async def test_a_turn_past_the_decoders_fails_typed_and_the_next_one_is_heard(piper_engine: PiperEngine) -> None:
    no_vad = {"input": {"turn_detection": None}}
    async with StandinServer() as standins:
        with answering_server(piper_engine, standins.base_url, None, embedded_asr_max_decoders=1) as server:
            async with realtime(server) as first, realtime(server) as second:
                for connection in (first, second):
                    await opened(connection, audio=no_vad)
                # The first user's turn holds the only decoder from its first append until its commit.
                await say(first, RECORDED_TURN)
                await first.conversation.item.retrieve(item_id="no-such-item")
                assert (await until(first, "error"))[-1]["error"]["code"] == "item_not_found"  # the appends are in
                await say(second, RECORDED_TURN)
                await second.input_audio_buffer.commit()
                refused = await until(second, "conversation.item.input_audio_transcription.failed")
                assert refused[-1]["error"]["code"] == "asr_busy"
                await first.input_audio_buffer.commit()
                heard = await until(first, "conversation.item.input_audio_transcription.completed")
                assert heard_the_question(heard[-1]["transcript"])
                # The decoder is free again: the second user's next turn is heard.
                await say(second, RECORDED_TURN)
                await second.input_audio_buffer.commit()
                again = await until(second, "conversation.item.input_audio_transcription.completed")
                assert heard_the_question(again[-1]["transcript"])
