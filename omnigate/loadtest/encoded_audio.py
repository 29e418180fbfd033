"""How much audio a stream of encoded bytes holds, chunk by chunk, as a player would decode it. Sans-I/O.

The player accounting needs each chunk's audio duration, which for an encoded format is not a function of its size:
the bytes are parsed into codec frames and decoded (PyAV), and a chunk counts the audio of the frames it completed.
Bytes left that complete no frame when the stream ends are a truncated frame: the body ended early.
"""

from __future__ import annotations

import av
import av.error

ENCODED_CODECS = {"mp3": "mp3"}
"""Response formats measured by decoding, and their PyAV decoder."""


class EncodedAudioDecoder:
    """Feed the bytes of one stream in order; each call returns the audio (ms) of the frames those bytes finished."""

    def __init__(self, response_format: str) -> None:
        codec = ENCODED_CODECS.get(response_format)
        if codec is None:
            raise ValueError(f"no decoder for {response_format!r}; decoded formats: {', '.join(ENCODED_CODECS)}")
        context = av.CodecContext.create(codec, "r")
        if not isinstance(context, av.AudioCodecContext):
            raise TypeError(f"{codec} is not an audio decoder")
        self._context = context
        self._fed_bytes = 0
        self._framed_bytes = 0
        self.sample_rate: int | None = None
        """Of the decoded audio, once a frame was decoded."""
        self.errors = 0
        """Frames the decoder refused (corrupt data)."""

    def feed(self, data: bytes) -> float:
        """Audio in ms that ``data`` completed (the parser keeps a partial frame for the next call)."""
        self._fed_bytes += len(data)
        samples_ms = 0.0
        for packet in self._context.parse(data):
            self._framed_bytes += packet.size
            try:
                frames = self._context.decode(packet)
            except av.error.FFmpegError:
                self.errors += 1
                continue
            for frame in frames:
                self.sample_rate = frame.sample_rate
                samples_ms += frame.samples * 1000.0 / frame.sample_rate
        return samples_ms

    @property
    def pending_bytes(self) -> int:
        """Bytes fed that are not (yet) a whole frame: at the end of a stream, a frame cut short."""
        return self._fed_bytes - self._framed_bytes
