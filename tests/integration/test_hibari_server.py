"""The default server (``Settings()``: the hibari voice, loaded as ``omnigate serve`` loads it) through its real routes:
the speech WebSocket stream, ``POST /v1/audio/speech`` with OpenAI's voice names, and a speech recognizer
(pocketsphinx's bundled en-US model) that hears the words that were sent."""

from __future__ import annotations

import httpx
import pytest
from websockets.asyncio.client import connect

from tests.audio_checks import speech_fraction
from tests.integration.ws_client import collect_utterance, next_json, send
from tests.serving import RunningServer
from tests.transcription import transcribe, word_errors, words

pytestmark = pytest.mark.integration

STREAM = "/v1/audio/speech/stream"
RATE = 24_000


async def test_the_default_server_serves_the_hibari_voice(default_server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=default_server.http_url, timeout=30) as client:
        models = (await client.get("/v1/models")).json()["data"]
        listing = (await client.get("/v1/audio/voices")).json()
    assert [(m["id"], m["engine"], m["sample_rate"]) for m in models] == [("hibari-heart", "hibari", RATE)]
    assert listing["default"] == "heart"
    aliases = [v for v in listing["voices"] if v.get("alias_of")]
    assert {v["alias_of"] for v in aliases} == {"heart"} and "alloy" in {v["id"] for v in aliases}


async def test_speech_streams_per_sentence_before_input_done(default_server: RunningServer) -> None:
    async with connect(default_server.ws_url + STREAM) as ws:
        await send(ws, "session.config", voice="heart", response_format="pcm", stream_audio=True)
        sentence = "The quick brown fox jumps over the lazy dog. "
        for word in sentence.split():
            await send(ws, "input.text", text=word + " ")
        await send(ws, "input.text", text="And then")
        start = await next_json(ws)  # the first unit's audio starts before input.done
        assert start["type"] == "audio.start" and start["sample_rate"] == RATE and start["format"] == "pcm"
        assert start["sentence_text"] and sentence.startswith(start["sentence_text"])
        await send(ws, "input.text", text=" it ran away into the forest.")
        await send(ws, "input.done")
        utt = await collect_utterance(ws)
    assert utt.end is not None and utt.end["status"] == "completed"
    texts = [start["sentence_text"], *(s["sentence_text"] for s in utt.starts)]
    assert " ".join(texts).split() == (sentence + "And then it ran away into the forest.").split()
    assert len(utt.pcm) / 2 / RATE > 1.0
    assert max(len(c) for c in utt.audio) <= 2 * RATE // 10
    assert speech_fraction(utt.pcm, RATE) > 0.5


@pytest.mark.parametrize("voice", ["heart", "alloy", "nova"])
def test_post_speech_says_the_words_it_was_given(default_server: RunningServer, voice: str) -> None:
    said = "The children played in the garden all afternoon."
    body = {"model": "tts-1", "voice": voice, "input": said, "response_format": "pcm"}
    response = httpx.post(f"{default_server.http_url}/v1/audio/speech", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("audio/pcm")
    heard = transcribe(response.content, RATE)
    # The recognizer hears this sentence (of benchmarks/voice_compare_sentences.txt) word for word; one slip allowed.
    assert word_errors(said, heard) <= 1, heard
    assert len(words(heard)) >= len(words(said)) - 1


def test_an_unknown_voice_is_refused_with_the_voices_and_aliases(default_server: RunningServer) -> None:
    body = {"model": "tts-1", "voice": "joe", "input": "Hello."}
    response = httpx.post(f"{default_server.http_url}/v1/audio/speech", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "unknown_voice" and error["param"] == "voice"
    assert error["message"].startswith("voice 'joe' is not served; available: heart; aliases of these")
