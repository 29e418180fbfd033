"""The embedded recognizer: a turn decoded as its audio comes, in the real pocketsphinx decoder (a recorded turn) and
in decoders the test controls (to see that it streams, and what a busy, dying or hanging decoder does to a turn)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from omnigate.engines.openai_compat.errors import ServiceError
from omnigate.engines.recognizer import EmbeddedRecognizer, TurnDecoder
from omnigate.loadtest.targets.realtime import SPEECH_FILE, load_speech

CHUNK = 4800  # 100 ms at 24 kHz, as a client appends it


def recorded_turn() -> bytes:
    """A user's turn recorded once (the piper voice: "Could you book a table for two at eight tonight?"), then half
    a second of pause: 24 kHz mono s16le as a session hears it, the same bytes every run."""
    return load_speech(SPEECH_FILE) + bytes(24_000)


def chunks(pcm: bytes) -> Iterator[bytes]:
    for offset in range(0, len(pcm), CHUNK):
        yield pcm[offset : offset + CHUNK]


class ScriptedDecoder:
    """A decoder that tells the loop what it was fed, and fails or hangs where the test says."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, fail: bool = False, hang: threading.Event | None = None):
        self.loop = loop
        self.fed = asyncio.Queue[int]()
        self.fail = fail
        self.hang = hang

    def start(self) -> None:
        pass

    def feed(self, pcm: bytes) -> None:
        if self.fail:
            raise RuntimeError("the decoder broke")
        self.loop.call_soon_threadsafe(self.fed.put_nowait, len(pcm))

    def finish(self) -> str:
        if self.hang is not None:
            self.hang.wait()
        return "scripted words"


async def test_pocketsphinx_hears_a_spoken_sentence_fed_as_it_comes() -> None:
    recognizer = EmbeddedRecognizer(max_decoders=2)
    try:
        listener = recognizer.listen()
        *head, tail = list(chunks(recorded_turn()))
        for chunk in head:
            listener.hear(chunk)
        transcript = await listener.transcript(tail)
        # (pocketsphinx's small en-US model hears "if you book a table for today tonight" in this recording)
        assert "book a table for" in transcript and transcript.endswith("tonight")
        # The decoder goes back for the next turn, which it hears from a clean start.
        assert recognizer.listening == 0
        second = recognizer.listen()
        for chunk in chunks(recorded_turn()):
            second.hear(chunk)
        assert await second.transcript() == transcript
    finally:
        recognizer.close()


async def test_audio_is_decoded_while_the_turn_goes_on() -> None:
    loop = asyncio.get_running_loop()
    decoder = ScriptedDecoder(loop)
    recognizer = EmbeddedRecognizer(max_decoders=1, new_decoder=lambda: decoder)
    try:
        listener = recognizer.listen()
        listener.hear(bytes(CHUNK))
        # Fed before the turn ends, resampled to 16 kHz: 100 ms are 3200 bytes (the resampler keeps a few samples).
        assert 3000 <= await decoder.fed.get() <= 3200
        assert await listener.transcript(bytes(CHUNK)) == "scripted words"
    finally:
        recognizer.close()


async def test_turns_past_the_decoders_are_refused_typed_until_one_is_free() -> None:
    loop = asyncio.get_running_loop()
    recognizer = EmbeddedRecognizer(max_decoders=1, new_decoder=lambda: ScriptedDecoder(loop))
    try:
        first = recognizer.listen()
        with pytest.raises(ServiceError) as refused:
            recognizer.listen()
        assert refused.value.code == "asr_busy"
        first.cancel()
        recognizer.listen().cancel()
    finally:
        recognizer.close()


async def test_a_turn_longer_than_the_limit_fails_typed() -> None:
    loop = asyncio.get_running_loop()
    recognizer = EmbeddedRecognizer(max_decoders=1, max_audio_s=0.25, new_decoder=lambda: ScriptedDecoder(loop))
    try:
        listener = recognizer.listen()
        for _ in range(3):
            listener.hear(bytes(CHUNK))
        with pytest.raises(ServiceError) as failed:
            await listener.transcript()
        assert failed.value.code == "asr_audio_limit"
    finally:
        recognizer.close()


async def test_a_decoder_that_dies_fails_its_turn_typed_and_is_not_reused() -> None:
    loop = asyncio.get_running_loop()
    made: list[TurnDecoder] = []

    def new_decoder() -> TurnDecoder:
        made.append(ScriptedDecoder(loop, fail=not made))  # the first one breaks
        return made[-1]

    recognizer = EmbeddedRecognizer(max_decoders=1, new_decoder=new_decoder)
    try:
        listener = recognizer.listen()
        listener.hear(bytes(CHUNK))
        with pytest.raises(ServiceError) as failed:
            await listener.transcript()
        assert failed.value.code == "asr_error"
        assert await recognizer.listen().transcript(bytes(CHUNK)) == "scripted words"
        assert len(made) == 2
    finally:
        recognizer.close()


async def test_a_decoder_that_hangs_fails_its_turn_typed_and_holds_its_place_until_it_returns() -> None:
    loop = asyncio.get_running_loop()
    hang = threading.Event()
    recognizer = EmbeddedRecognizer(max_decoders=1, timeout_s=0.2, new_decoder=lambda: ScriptedDecoder(loop, hang=hang))
    try:
        listener = recognizer.listen()
        with pytest.raises(ServiceError) as failed:
            await listener.transcript(bytes(CHUNK))
        assert failed.value.code == "asr_timeout"
        with pytest.raises(ServiceError):
            recognizer.listen()  # the hung decoder still holds its place
        hang.set()
        await asyncio.to_thread(recognizer.executor.shutdown, wait=True)
        await asyncio.sleep(0)  # the job's return, posted to the loop by its thread, runs
        assert recognizer.listening == 0
    finally:
        recognizer.close()
