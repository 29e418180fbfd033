"""The embedded speech recognizer of ``/v1/realtime``: pocketsphinx decoders, each turn decoded as its audio comes.

A session hears its turn through a :class:`TurnListener`: the audio is handed over on the event loop as it arrives
and decoded on a bounded pool of threads, one job per turn at a time and in order, so the transcript is ready soon
after the turn ends. Decoders load once (about 0.7 s and 95 MB each) and are reused turn after turn.

Limits: at most ``max_decoders`` turns are heard at once (the next is refused ``asr_busy``); a turn longer than
``max_audio_s`` fails ``asr_audio_limit``; a decoder that raises fails its turn ``asr_error`` and is dropped; a turn
whose transcript is not ready ``timeout_s`` after it ended fails ``asr_timeout`` (the session goes on), and its
decoder keeps its place until its thread returns, so a hung decoder lowers capacity instead of adding threads.

pocketsphinx holds the GIL while it decodes, so audio goes to it in pieces of at most :data:`FEED_MS`: the event
loop waits for one piece (a few milliseconds of CPU) at worst.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from omnigate.codecs.resample import StreamResampler
from omnigate.engines.openai_compat.errors import ServiceError
from omnigate.os_threads import named_executor

INPUT_RATE = 24_000  # what sessions hear, mono s16le
DECODER_RATE = 16_000  # the en-US acoustic model's
FEED_MS = 100
_FEED_BYTES = DECODER_RATE * 2 * FEED_MS // 1000


class TurnDecoder(Protocol):
    """Decodes one turn after another: :meth:`start` a turn, :meth:`feed` it 16 kHz mono s16le, :meth:`finish`."""

    def start(self) -> None:
        """Begin a turn (a turn still open is dropped)."""

    def feed(self, pcm: bytes) -> None: ...

    def finish(self) -> str:
        """End the turn; its words."""


class PocketsphinxDecoder:
    """pocketsphinx with the en-US acoustic model, language model and dictionary its wheel ships."""

    def __init__(self) -> None:
        from pocketsphinx import Decoder

        self._decoder = Decoder(loglevel="FATAL")
        self._open = False

    def start(self) -> None:
        if self._open:
            self._decoder.end_utt()
        self._decoder.start_utt()
        self._open = True

    def feed(self, pcm: bytes) -> None:
        self._decoder.process_raw(pcm, False, False)

    def finish(self) -> str:
        self._decoder.end_utt()
        self._open = False
        hypothesis = self._decoder.hyp()
        return hypothesis.hypstr if hypothesis is not None else ""


class EmbeddedRecognizer:
    """The decoders of a gateway process and the threads they decode on."""

    def __init__(
        self,
        *,
        max_decoders: int = 8,
        max_audio_s: float = 60.0,
        timeout_s: float = 15.0,
        new_decoder: Callable[[], TurnDecoder] = PocketsphinxDecoder,
    ) -> None:
        if max_decoders < 1 or max_audio_s <= 0 or timeout_s <= 0:
            raise ValueError("the recognizer's decoders, audio and timeout must be positive")
        self.max_decoders = max_decoders
        self.max_audio_s = max_audio_s
        self.timeout_s = timeout_s
        self.new_decoder = new_decoder
        # One job per listener at a time, so as many threads as decoders never queue one turn behind another.
        self.executor = named_executor(max_decoders, "omnigate-asr")
        self._idle: list[TurnDecoder] = []
        self.listening = 0  # listeners holding a place, each with its decoder (or one being loaded)

    def warm_up(self) -> None:
        """Load a decoder now, so the first turn does not wait for one. Blocking: call from a thread."""
        self._idle.append(self.new_decoder())

    def listen(self) -> TurnListener:
        """A listener for a new turn (on the event loop). Raises ServiceError ``asr_busy`` when all are taken."""
        if self.listening >= self.max_decoders:
            raise ServiceError("asr", "busy", f"all {self.max_decoders} speech decoders are hearing other turns")
        self.listening += 1
        return TurnListener(self, self._idle.pop() if self._idle else None)

    def close(self) -> None:
        """Stop taking jobs (a job in progress finishes on its thread)."""
        self.executor.shutdown(wait=False, cancel_futures=True)

    def give_back(self, decoder: TurnDecoder | None) -> None:
        """A listener's place is free again, with its decoder for the next turn (None: the decoder was dropped)."""
        self.listening -= 1
        if decoder is not None:
            self._idle.append(decoder)


class TurnListener:
    """One turn's decoding: :meth:`hear` its audio (24 kHz mono s16le) as it comes, then await :meth:`transcript`
    with the rest; or :meth:`cancel`. Used on the event loop only."""

    def __init__(self, recognizer: EmbeddedRecognizer, decoder: TurnDecoder | None) -> None:
        self._recognizer = recognizer
        self._loop = asyncio.get_running_loop()
        self._max_bytes = int(recognizer.max_audio_s * INPUT_RATE) * 2
        self._bytes = 0
        self._pending = bytearray()  # heard, not yet handed to a job
        self._job: Future[str | None] | None = None
        self._ending = False
        self._abandoned = False  # cancelled, failed or timed out: the decoder goes back once no job runs
        self._given_back = False
        self._done = asyncio.Event()
        self._text = ""
        self._error: ServiceError | None = None
        # Touched only by the job in flight (one at a time):
        self._decoder = decoder
        self._started = False
        self._resampler = StreamResampler(INPUT_RATE, DECODER_RATE)

    def hear(self, pcm: bytes) -> None:
        """More of the turn's audio."""
        if self._ending or self._abandoned:
            return
        self._bytes += len(pcm)
        if self._bytes > self._max_bytes:
            self._fail(
                ServiceError("asr", "audio_limit", f"a turn longer than {self._recognizer.max_audio_s:g} s of speech")
            )
            return
        self._pending += pcm
        if self._job is None:
            self._next_job()

    async def transcript(self, pcm: bytes = b"") -> str:
        """The rest of the turn's audio, then its words. Raises ServiceError; cancels the listener when the caller
        is cancelled."""
        self.hear(pcm)
        if not self._abandoned:
            self._ending = True
            if self._job is None:
                self._next_job()
        try:
            async with asyncio.timeout(self._recognizer.timeout_s):
                await self._done.wait()
        except TimeoutError:
            self._fail(
                ServiceError("asr", "timeout", f"no transcript {self._recognizer.timeout_s:g} s after the turn ended")
            )
        finally:
            self.cancel()  # (a listener whose turn ended gave its decoder back already)
        if self._error is not None:
            raise self._error
        return self._text

    def cancel(self) -> None:
        """Nothing more of this turn is wanted; the decoder goes back once its job returns."""
        self._abandoned = True
        self._pending.clear()
        if self._job is None:
            self._give_back(self._decoder)

    # ---- jobs ---------------------------------------------------------------------------------------------------

    def _next_job(self) -> None:
        if not self._pending and not self._ending:
            return
        pcm = bytes(self._pending)
        self._pending.clear()
        try:
            job = self._recognizer.executor.submit(self._decode, pcm, self._ending)
        except RuntimeError:  # the pool is shut down: the server is stopping
            self._fail(ServiceError("asr", "unavailable", "the speech recognizer has stopped"))
            return
        self._job = job
        job.add_done_callback(self._job_returned)

    def _decode(self, pcm: bytes, end: bool) -> str | None:
        """On a worker thread: decode ``pcm``; at the end of the turn, its words."""
        if self._decoder is None:
            self._decoder = self._recognizer.new_decoder()
        decoder = self._decoder
        if not self._started:
            decoder.start()
            self._started = True
        pcm = self._resampler.process(pcm)
        if end:
            pcm += self._resampler.flush()
        for offset in range(0, len(pcm), _FEED_BYTES):
            decoder.feed(pcm[offset : offset + _FEED_BYTES])
        if not end:
            return None
        self._started = False
        return decoder.finish()

    def _job_returned(self, job: Future[str | None]) -> None:
        # On the worker's thread: go on on the loop, unless the loop is gone (shutdown).
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._job_done, job)

    def _job_done(self, job: Future[str | None]) -> None:
        self._job = None
        if job.cancelled():
            self._fail(ServiceError("asr", "unavailable", "the speech recognizer has stopped"))
            self._give_back(self._decoder)
            return
        error = job.exception()
        if error is not None:
            self._decoder = None  # its state is unknown: it is not reused
            self._fail(ServiceError("asr", "error", f"the speech recognizer failed: {error}"))
            self._give_back(None)
            return
        if self._abandoned:
            self._give_back(self._decoder)
            return
        text = job.result()
        if text is None:
            self._next_job()
            return
        self._text = text
        self._abandoned = True
        self._done.set()
        self._give_back(self._decoder)

    def _fail(self, error: ServiceError) -> None:
        if self._done.is_set():
            return
        self._error = error
        self._abandoned = True
        self._pending.clear()
        self._done.set()
        if self._job is None:
            self._give_back(self._decoder)

    def _give_back(self, decoder: TurnDecoder | None) -> None:
        if not self._given_back:
            self._given_back = True
            self._recognizer.give_back(decoder)
