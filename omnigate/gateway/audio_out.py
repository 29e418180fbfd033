"""Encoding a session's PCM into the client's format, off the event loop when it costs real CPU."""

from __future__ import annotations

import asyncio

from omnigate.codecs.encoder import AudioEncoder
from omnigate.codecs.formats import get_format


class AudioOut:
    """One encoder for one audio stream (a sentence on the speech stream, a whole response over HTTP)."""

    def __init__(self, fmt: str, input_rate: int, output_rate: int | None = None) -> None:
        self.encoder = AudioEncoder(fmt, input_rate, output_rate)
        self.bytes_out = 0

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
            data = await asyncio.to_thread(self.encoder.encode, pcm)
        else:
            data = self.encoder.encode(pcm)
        self.bytes_out += len(data)
        return data

    def close(self) -> None:
        """Drop an encoder that will not be finished (the stream was cut off)."""
        self.encoder.close()

    async def finish(self) -> bytes:
        if self.encoder.costly:
            data = await asyncio.to_thread(self.encoder.flush)
        else:
            data = self.encoder.flush()
        self.bytes_out += len(data)
        return data
