"""``WS /v1/audio/speech/stream`` against the real server with a real websockets client."""

from __future__ import annotations

import json

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from omnigate.gateway.settings import Settings
from tests.audio_checks import decode, speech_fraction, synthetic_ms
from tests.integration.ws_client import collect_utterance, next_json, send
from tests.serving import RunningServer, serve

STREAM = "/v1/audio/speech/stream"


async def test_piper_speech_streams_before_input_done_and_is_speech(piper_server: RunningServer) -> None:
    async with connect(piper_server.ws_url + STREAM) as ws:
        await send(ws, "session.config", voice="joe", response_format="pcm", stream_audio=True)
        sentence = "The quick brown fox jumps over the lazy dog. "
        for word in sentence.split():
            await send(ws, "input.text", text=word + " ")
        await send(ws, "input.text", text="And then")
        # The first sentence is complete: audio starts before input.done.
        start = await next_json(ws)
        assert start["type"] == "audio.start"
        assert start["utterance_index"] == 0 and start["sentence_index"] == 0
        # The first unit is short (three words, fewer when the segmenter's timer released it before the next word).
        assert start["sentence_text"] and sentence.startswith(start["sentence_text"])
        assert start["sample_rate"] == 22050 and start["format"] == "pcm"
        await send(ws, "input.text", text=" it ran away into the forest.")
        await send(ws, "input.done")
        utt = await collect_utterance(ws)
    assert utt.end is not None and utt.end["status"] == "completed"
    # Two sentences (more only if a slow machine let the 400 ms forced flush cut one): all the text, once, in order.
    texts = [start["sentence_text"], *(s["sentence_text"] for s in utt.starts)]
    assert utt.end["total_sentences"] == len(texts) >= 2
    assert " ".join(texts).split() == (sentence + "And then it ran away into the forest.").split()
    pcm = utt.pcm
    assert len(pcm) % 2 == 0
    duration = len(pcm) / 2 / 22050
    assert duration > 1.0
    # The first sentence's audio came in many chunks of at most 100 ms.
    assert max(len(c) for c in utt.audio) <= 2 * 2205
    assert speech_fraction(pcm, 22050) > 0.5
    assert sum(d["total_bytes"] for d in utt.dones) + 0 >= len(pcm) - 2 * 2205  # the first sentence was counted too


async def test_several_utterances_per_connection_with_sticky_config(piper_server: RunningServer) -> None:
    async with connect(piper_server.ws_url + STREAM) as ws:
        await send(ws, "session.config", response_format="wav", speaker="joe")
        for i, text in enumerate(["Hello there.", "Second time around.", "And a third."]):
            await send(ws, "input.text", text=text)
            await send(ws, "input.done")
            utt = await collect_utterance(ws)
            assert utt.end is not None and utt.end["utterance_index"] == i
            # stream_audio false: one binary frame per sentence, a complete WAV file.
            assert len(utt.audio) == len(utt.starts) == 1
            samples, rate, channels = decode(utt.audio[0])
            assert rate == 22050 and channels == 1 and samples.size > 0.3 * 22050


@pytest.mark.parametrize("fmt", ["pcm", "wav", "mp3", "opus", "aac", "flac"])
async def test_every_format_decodes_with_the_announced_rate(synthetic_server: RunningServer, fmt: str) -> None:
    async with connect(synthetic_server.ws_url + STREAM) as ws:
        await send(ws, "session.config", response_format=fmt, stream_audio=True, sample_rate=24000)
        await send(ws, "input.text", text="Twenty characters!!.")
        await send(ws, "input.done")
        utt = await collect_utterance(ws)
    [start] = utt.starts
    expected_ms = synthetic_ms("Twenty characters!!.")
    if fmt == "pcm":
        assert len(utt.pcm) == round(24000 * expected_ms / 1000) * 2
        return
    samples, rate, channels = decode(utt.pcm)
    # Opus decoders always output 48 kHz; the stream header carries the announced input rate.
    assert rate == (48000 if fmt == "opus" else start["sample_rate"])
    assert channels == 1
    # MP3 and AAC add encoder priming that a headerless stream cannot signal (LAME 1105 samples, AAC 1024) and pad
    # to a whole frame: up to ~85 ms more at 24 kHz. The other formats are exact to a sample or so.
    excess_ms = samples.size / rate * 1000 - expected_ms
    assert (-1 < excess_ms < 90) if fmt in ("mp3", "aac") else abs(excess_ms) < 1


async def test_bad_messages_get_one_typed_error_each_and_the_session_survives() -> None:
    # The segmenter's timer must not release the buffered text before session.config is refused (its audio.start
    # would then race the error): it is set far beyond the test's length.
    with serve(Settings(engine="synthetic", segment_max_wait_ms=600_000)) as server:
        async with connect(server.ws_url + STREAM) as ws:
            await send(ws, "input.text", text="before config")
            assert (await next_json(ws))["code"] == "no_config"
            await ws.send("{not json")
            assert (await next_json(ws))["code"] == "invalid_json"
            await ws.send(json.dumps({"type": "input.dance"}))
            assert (await next_json(ws))["code"] == "unknown_event"
            await ws.send(json.dumps(["type", "input.text"]))
            assert (await next_json(ws))["code"] == "invalid_event"
            await ws.send(json.dumps({"type": "input.text"}))
            error = await next_json(ws)
            assert error["code"] == "invalid_event" and "text" in error["message"]
            await ws.send(json.dumps({"type": "input.text", "text": 42}))
            assert (await next_json(ws))["code"] == "invalid_event"
            await ws.send(b"\x00\x01")
            assert (await next_json(ws))["code"] == "invalid_message"
            await send(ws, "session.config", voice="nobody")
            error = await next_json(ws)
            assert error["code"] == "unknown_voice" and error["type"] == "error"
            await send(ws, "session.config", response_format="ogg-vorbis")
            assert (await next_json(ws))["code"] == "unsupported_format"
            await send(ws, "session.config", model="no-such-model")
            assert (await next_json(ws))["code"] == "model_not_found"
            await send(ws, "session.config", ref_audio="data:audio/wav;base64,AAAA")
            assert (await next_json(ws))["code"] == "unsupported"
            await send(ws, "session.config", colour="blue")
            assert (await next_json(ws))["code"] == "invalid_event"
            await send(ws, "input.text", text="x" * (129 * 1024))
            assert (await next_json(ws))["code"] == "message_too_large"
            # vllm-omni clients' fields are accepted.
            await send(
                ws,
                "session.config",
                speaker="tone",
                task_type="CustomVoice",
                language="en",
                response_format="pcm",
            )
            await send(ws, "input.text", text="buffered without punctuation")
            await send(ws, "session.config", voice="noise")
            assert (await next_json(ws))["code"] == "config_while_busy"
            await send(ws, "input.done")
            utt = await collect_utterance(ws)
            assert utt.end is not None and utt.end["status"] == "completed" and len(utt.pcm) > 0


async def test_message_over_the_transport_limit_closes_with_1009(synthetic_server: RunningServer) -> None:
    async with connect(synthetic_server.ws_url + STREAM, max_size=None) as ws:
        await send(ws, "session.config", response_format="pcm")

        async def send_too_much_then_receive() -> None:
            # The server may close with 1009 while the frame is still being written: the send itself raises then.
            await ws.send(json.dumps({"type": "input.text", "text": "y" * (2 * 1024 * 1024)}))
            await ws.recv()

        with pytest.raises(ConnectionClosed) as closed:
            await send_too_much_then_receive()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


async def test_cancel_ends_the_utterance_at_once_and_the_next_one_works(
    synthetic_server: RunningServer,
) -> None:
    async with connect(synthetic_server.ws_url + STREAM) as ws:
        await send(ws, "session.config", response_format="pcm", stream_audio=True)
        await send(ws, "input.text", text="A long sentence that keeps going. " * 20)
        await send(ws, "input.done")
        start = await next_json(ws)
        assert start["type"] == "audio.start"
        assert isinstance(await ws.recv(), bytes)
        await send(ws, "input.cancel")
        terminal = None
        while terminal is None:
            message = await ws.recv()
            if isinstance(message, str) and json.loads(message)["type"] == "session.done":
                terminal = json.loads(message)
        assert terminal["status"] == "cancelled" and terminal["utterance_index"] == 0
        # Nothing of the cancelled utterance follows: the next event belongs to the next utterance.
        await send(ws, "input.text", text="Fresh start.")
        await send(ws, "input.done")
        utt = await collect_utterance(ws)
        assert utt.end is not None and utt.end["utterance_index"] == 1 and utt.end["status"] == "completed"
        assert all(s["utterance_index"] == 1 for s in utt.starts)


async def test_session_close_finishes_flushed_speech_then_closes(synthetic_server: RunningServer) -> None:
    async with connect(synthetic_server.ws_url + STREAM) as ws:
        await send(ws, "session.config", response_format="pcm")
        await send(ws, "input.text", text="Say this before closing.")
        await send(ws, "input.done")
        await send(ws, "session.close")
        utt = await collect_utterance(ws)
        assert utt.end is not None and utt.end["status"] == "completed"
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000


async def test_text_per_utterance_and_per_session_is_bounded_typed_and_the_session_survives() -> None:
    # The segmenter's timer must not release the first text before the second arrives (its audio.start would then
    # race the error): it is set far beyond the test's length.
    settings = Settings(engine="synthetic", model="ms_per_char=5", max_utterance_chars=100, segment_max_wait_ms=600_000)
    with serve(settings) as server:
        async with connect(server.ws_url + STREAM) as ws:
            await send(ws, "session.config", response_format="pcm")
            # 56 characters in two words, no mark: no boundary and no first-unit cut (3 words), nothing spoken yet.
            words = "many-words-and-no-full-stop " * 2
            await send(ws, "input.text", text=words)
            await send(ws, "input.text", text=words)
            error = await next_json(ws)
            assert error["type"] == "error" and error["code"] == "utterance_too_long" and error["param"] == "text"
            # What was accepted is spoken; the refused text is not in it, and the next utterance starts fresh.
            await send(ws, "input.done")
            utt = await collect_utterance(ws)
            assert utt.end is not None and utt.end["status"] == "completed"
            assert [s["sentence_text"] for s in utt.starts] == [words.strip()]
            await send(ws, "input.text", text=words + "end.")
            await send(ws, "input.done")
            utt = await collect_utterance(ws)
            assert utt.end is not None and utt.end["status"] == "completed" and len(utt.pcm) > 0


async def test_text_with_nothing_to_speak_is_refused_typed_and_the_session_survives(
    synthetic_server: RunningServer,
) -> None:
    async with connect(synthetic_server.ws_url + STREAM) as ws:
        await send(ws, "session.config", response_format="pcm")
        await send(ws, "input.text", text="...!!!")
        await send(ws, "input.done")
        error = await next_json(ws)
        assert error["type"] == "error" and error["code"] == "nothing_to_speak" and error["param"] == "text"
        done = await next_json(ws)
        assert done["type"] == "session.done" and done["utterance_index"] == 0
        assert done["status"] == "error" and done["total_sentences"] == 0
        # Punctuation inside an utterance with words is no sentence of its own; the session goes on.
        await send(ws, "input.text", text="Now words. ")
        await send(ws, "input.text", text="?! ")
        await send(ws, "input.done")
        utt = await collect_utterance(ws)
        assert utt.end is not None and utt.end["status"] == "completed" and utt.end["utterance_index"] == 1
        assert [s["sentence_text"] for s in utt.starts] == ["Now words."]
        assert len(utt.pcm) == round(synthetic_ms("Now words.") / 1000 * 24000) * 2
