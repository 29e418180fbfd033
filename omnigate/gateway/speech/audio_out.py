"""Encoding a session's PCM into the client's format, off the event loop when it costs real CPU."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from omnigate.codecs.encoder import AudioEncoder
from omnigate.codecs.formats import get_format


class AudioOut:
    """One encoder for one audio stream (a sentence on the speech stream, a whole response over HTTP).

    A costly encode runs on a worker thread, which cancelling the awaiting task does not stop; a disconnect's
    ``finally`` then calls :meth:`close` while that thread may still be inside the codec. PyAV containers are not
    thread-safe (closing one under a running encode crashes the process), so a close that finds an encode running
    leaves the closing to that encode's thread, and nothing is encoded after a close.
    """

    def __init__(self, fmt: str, input_rate: int, output_rate: int | None = None) -> None:
        self.encoder = AudioEncoder(fmt, input_rate, output_rate)
        self.bytes_out = 0
        # Held only to read and flip the two flags below, never across an encode: close() on the loop never waits.
        self._state = threading.Lock()
        self._encoding = False
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
        """The bytes of the next piece of PCM (none once the stream was closed)."""
        return await self._run(lambda: self.encoder.encode(pcm))

    async def finish(self) -> bytes:
        """The stream's last bytes (none once it was closed)."""
        return await self._run(self.encoder.flush)

    def close(self) -> None:
        """Drop an encoder that will not be finished (the stream was cut off). Never blocks: an encode still
        running on a worker thread closes the encoder itself when it returns. Safe to call twice."""
        with self._state:
            self._closed = True
            if self._encoding:
                return
        self.encoder.close()

    async def _run(self, work: Callable[[], bytes]) -> bytes:
        data = await asyncio.to_thread(self._guarded, work) if self.encoder.costly else self._guarded(work)
        self.bytes_out += len(data)
        return data

    def _guarded(self, work: Callable[[], bytes]) -> bytes:
        with self._state:
            if self._closed:
                return b""
            self._encoding = True
        try:
            return work()
        finally:
            with self._state:
                self._encoding = False
                close_here = self._closed
            if close_here:
                self.encoder.close()
