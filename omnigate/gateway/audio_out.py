"""Encoding a session's PCM into the client's format, off the event loop when it costs real CPU."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from omnigate.codecs.encoder import AudioEncoder
from omnigate.codecs.formats import get_format


class AudioOut:
    """One encoder for one audio stream (a sentence on the speech stream, a whole response over HTTP)."""

    def __init__(self, fmt: str, input_rate: int, output_rate: int | None = None) -> None:
        self.encoder = AudioEncoder(fmt, input_rate, output_rate)
        self.bytes_out = 0
        # A codec runs in a worker thread, and the task awaiting it can be cancelled (the client went away) while it
        # still runs there: closing the codec under it crashes the process (PyAV frees what the encoder is using).
        # So a codec is used by one thread at a time, and a close that finds it busy is left to the thread using it.
        self._lock = threading.Lock()
        self._close_pending = False
        self._closed = False

    @classmethod
    async def open(cls, fmt: str, input_rate: int, output_rate: int | None = None) -> AudioOut:
        """Create the encoder, off the loop when it is a real codec (opening one costs about a millisecond)."""
        if get_format(fmt).raw:
            return cls(fmt, input_rate, output_rate)
        return await asyncio.to_thread(cls, fmt, input_rate, output_rate)

    @property
    def output_rate(self) -> int:
        return self.encoder.output_rate

    @property
    def content_type(self) -> str:
        """The stream's HTTP content type. Raw PCM names its rate (``audio/pcm;rate=24000``): nothing in the bytes
        does."""
        fmt = self.encoder.format
        return f"{fmt.content_type};rate={self.output_rate}" if fmt.name == "pcm" else fmt.content_type

    async def encode(self, pcm: bytes) -> bytes:
        if self.encoder.costly:
            data = await asyncio.to_thread(self._exclusive, self.encoder.encode, pcm)
        else:
            data = self.encoder.encode(pcm)
        self.bytes_out += len(data)
        return data

    def close(self) -> None:
        """Drop an encoder that will not be finished (the stream was cut off); never while a thread still uses it."""
        self._close_pending = True
        if self._lock.acquire(blocking=False):
            try:
                self._close_now()
            finally:
                self._lock.release()

    async def finish(self) -> bytes:
        if self.encoder.costly:
            data = await asyncio.to_thread(self._exclusive, lambda _: self.encoder.flush(), b"")
        else:
            data = self.encoder.flush()
        self.bytes_out += len(data)
        return data

    def _exclusive(self, work: Callable[[bytes], bytes], pcm: bytes) -> bytes:
        """Run codec work in this worker thread, alone; a close requested meanwhile happens here, after it."""
        with self._lock:
            try:
                return b"" if self._closed else work(pcm)
            finally:
                if self._close_pending:
                    self._close_now()

    def _close_now(self) -> None:
        if not self._closed:
            self._closed = True
            self.encoder.close()
