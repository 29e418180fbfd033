"""The embedded recognizer: a turn decoded as its audio comes, in recognizer processes running the real pocketsphinx
decoder (a recorded turn) and decoders the test controls (to see that it streams, and what a busy, failing, hanging
or killed decoder does to a turn). The test decoders run in the worker processes, so they are named ``module:name``
and speak to the test through a FIFO the test makes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from omnigate.engines.openai_compat.errors import ServiceError
from omnigate.engines.recognizer import EmbeddedRecognizer
from omnigate.loadtest.targets.realtime import SPEECH_FILE, load_speech

CHUNK = 4800  # 100 ms at 24 kHz, as a client appends it
FIFO_ENV = "OMNIGATE_TEST_DECODER_FIFO"
HERE = "tests.unit.test_recognizer"


def recorded_turn() -> bytes:
    """A user's turn recorded once (the piper voice: "Could you book a table for two at eight tonight?"), then half
    a second of pause: 24 kHz mono s16le as a session hears it, the same bytes every run."""
    return load_speech(SPEECH_FILE) + bytes(24_000)


def chunks(pcm: bytes) -> Iterator[bytes]:
    for offset in range(0, len(pcm), CHUNK):
        yield pcm[offset : offset + CHUNK]


class ScriptedDecoder:
    """A decoder that hears nothing: every turn is "scripted words"."""

    def start(self) -> None:
        pass

    def feed(self, pcm: bytes) -> None:
        pass

    def finish(self) -> str:
        return "scripted words"


class ReportingDecoder(ScriptedDecoder):
    """Writes the length of each piece it is fed to the test's FIFO, as it is fed."""

    def __init__(self) -> None:
        self.report = open(os.environ[FIFO_ENV], "w", buffering=1)  # noqa: SIM115 (open for the decoder's life)

    def feed(self, pcm: bytes) -> None:
        self.report.write(f"{len(pcm)}\n")


class BreakingDecoder(ScriptedDecoder):
    """The first one a process makes raises when fed; each says which one it is."""

    made = 0

    def __init__(self) -> None:
        BreakingDecoder.made += 1
        self.number = BreakingDecoder.made

    def feed(self, pcm: bytes) -> None:
        if self.number == 1:
            raise RuntimeError("the decoder broke")

    def finish(self) -> str:
        return f"decoder {self.number}"


class HangingDecoder(ScriptedDecoder):
    """Hangs at the end of its first turn until the test writes a line to its FIFO."""

    def __init__(self) -> None:
        self.release = open(os.environ[FIFO_ENV])  # noqa: SIM115 (open for the decoder's life)
        self.hung = False

    def finish(self) -> str:
        if not self.hung:
            self.hung = True
            self.release.readline()
        return "scripted words"


@pytest.fixture
def fifo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A FIFO the worker processes find in their environment, and the test's end of it: a file descriptor opened
    read-write, so neither side waits for the other to open it."""
    path = tmp_path / "decoder.fifo"
    os.mkfifo(path)
    monkeypatch.setenv(FIFO_ENV, str(path))
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.asynccontextmanager
async def lines_from(fd: int) -> AsyncIterator[asyncio.StreamReader]:
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(os.dup(fd), "rb")
    )
    try:
        yield reader
    finally:
        transport.close()


async def started(recognizer: EmbeddedRecognizer) -> EmbeddedRecognizer:
    recognizer.start()
    await recognizer.loaded()
    return recognizer


async def test_pocketsphinx_hears_a_spoken_sentence_fed_as_it_comes() -> None:
    recognizer = await started(EmbeddedRecognizer(max_decoders=2, processes=1))
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
        await recognizer.aclose()


async def test_audio_is_decoded_while_the_turn_goes_on(fifo: int) -> None:
    recognizer = await started(EmbeddedRecognizer(max_decoders=1, decoder=f"{HERE}:ReportingDecoder"))
    try:
        async with lines_from(fifo) as reports:
            listener = recognizer.listen()
            listener.hear(bytes(CHUNK))
            # Fed before the turn ends, resampled to 16 kHz: 100 ms are 3200 bytes (the resampler keeps a few).
            assert 3000 <= int(await reports.readline()) <= 3200
            assert await listener.transcript(bytes(CHUNK)) == "scripted words"
    finally:
        await recognizer.aclose()


async def test_turns_past_the_decoders_are_refused_typed_until_one_is_free() -> None:
    recognizer = await started(EmbeddedRecognizer(max_decoders=2, processes=2, decoder=f"{HERE}:ScriptedDecoder"))
    try:
        first, second = recognizer.listen(), recognizer.listen()
        with pytest.raises(ServiceError) as refused:
            recognizer.listen()
        assert refused.value.code == "asr_busy"
        first.cancel()
        recognizer.listen().cancel()
        second.cancel()
    finally:
        await recognizer.aclose()


async def test_a_turn_longer_than_the_limit_fails_typed() -> None:
    recognizer = await started(EmbeddedRecognizer(max_decoders=1, max_audio_s=0.25, decoder=f"{HERE}:ScriptedDecoder"))
    try:
        listener = recognizer.listen()
        for _ in range(3):
            listener.hear(bytes(CHUNK))
        with pytest.raises(ServiceError) as failed:
            await listener.transcript()
        assert failed.value.code == "asr_audio_limit"
    finally:
        await recognizer.aclose()


async def test_a_decoder_that_raises_fails_its_turn_typed_and_is_not_reused() -> None:
    recognizer = await started(EmbeddedRecognizer(max_decoders=1, decoder=f"{HERE}:BreakingDecoder"))
    try:
        listener = recognizer.listen()
        listener.hear(bytes(CHUNK))
        with pytest.raises(ServiceError) as failed:
            await listener.transcript()
        assert failed.value.code == "asr_error"
        assert await recognizer.listen().transcript(bytes(CHUNK)) == "decoder 2"
    finally:
        await recognizer.aclose()


async def test_a_decoder_that_hangs_fails_its_turn_typed_and_holds_its_place_until_it_returns(
    fifo: int,
) -> None:
    recognizer = await started(
        EmbeddedRecognizer(max_decoders=2, processes=1, timeout_s=1.0, decoder=f"{HERE}:HangingDecoder")
    )
    try:
        with pytest.raises(ServiceError) as failed:
            await recognizer.listen().transcript(bytes(CHUNK))
        assert failed.value.code == "asr_timeout"
        waiting = recognizer.listen()  # the other place; its audio waits behind the hung turn in the process
        waiting.hear(bytes(CHUNK))
        with pytest.raises(ServiceError) as refused:
            recognizer.listen()  # the hung decoder still holds its place
        assert refused.value.code == "asr_busy"
        os.write(fifo, b"go\n")
        # The process answers in order: the hung turn's words come back (and its place with them) before these.
        assert await waiting.transcript() == "scripted words"
        assert recognizer.listening == 0
    finally:
        await recognizer.aclose()


async def test_a_killed_recognizer_process_fails_its_turns_typed_and_the_next_turn_is_heard() -> None:
    recognizer = await started(EmbeddedRecognizer(max_decoders=2, processes=1, decoder=f"{HERE}:ScriptedDecoder"))
    try:
        turns = [recognizer.listen(), recognizer.listen()]
        for listener in turns:
            listener.hear(bytes(CHUNK))
        [pid] = recognizer.pids()
        os.kill(pid, signal.SIGKILL)
        for listener in turns:
            with pytest.raises(ServiceError) as failed:
                await listener.transcript()
            assert failed.value.code == "asr_error"
        # The process is started again; a turn that comes meanwhile waits for it.
        assert await recognizer.listen().transcript(bytes(CHUNK)) == "scripted words"
        assert recognizer.pids() != [pid]
    finally:
        await recognizer.aclose()


async def test_the_recognizer_processes_end_with_it() -> None:
    recognizer = await started(EmbeddedRecognizer(max_decoders=4, processes=2, decoder=f"{HERE}:ScriptedDecoder"))
    listener = recognizer.listen()
    listener.hear(bytes(CHUNK))
    pids = recognizer.pids()
    assert len(pids) == 2
    await recognizer.aclose()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone, and reaped
    with pytest.raises(ServiceError) as stopped:
        await listener.transcript()
    assert stopped.value.code == "asr_unavailable"
