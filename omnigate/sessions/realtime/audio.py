"""Audio between the wire formats of a realtime session and the PCM the engines read and write.

Engines and the VAD see mono s16le PCM at 24 kHz. On the wire a session uses ``audio/pcm`` (s16le, 24 kHz) or
G.711 ``audio/pcmu`` / ``audio/pcma`` (8 kHz, one byte per sample). Resampling is streaming, so appends and chunks
of any size convert the same as one large piece.
"""

from __future__ import annotations

from collections.abc import Callable

from omnigate.codecs.g711 import alaw_decode, alaw_encode, ulaw_decode, ulaw_encode
from omnigate.codecs.resample import StreamResampler

ENGINE_RATE = 24000
G711_RATE = 8000

_G711_ENCODERS: dict[str, Callable[[bytes], bytes]] = {"audio/pcmu": ulaw_encode, "audio/pcma": alaw_encode}
_G711_DECODERS: dict[str, Callable[[bytes], bytes]] = {"audio/pcmu": ulaw_decode, "audio/pcma": alaw_decode}


class InvalidAudio(ValueError):
    """Bytes that are not whole samples of the session's input format."""


def wire_rate(fmt: str) -> int:
    return ENGINE_RATE if fmt == "audio/pcm" else G711_RATE


def wire_bytes_per_ms(fmt: str) -> float:
    """Bytes of one millisecond of audio in ``fmt``."""
    width = 2 if fmt == "audio/pcm" else 1
    return wire_rate(fmt) * width / 1000.0


class InputConverter:
    """Client audio in ``fmt`` to engine PCM (24 kHz s16le)."""

    def __init__(self, fmt: str) -> None:
        self.format = fmt
        self._decode = _G711_DECODERS.get(fmt)
        self._resampler = None if self._decode is None else StreamResampler(G711_RATE, ENGINE_RATE)

    def convert(self, data: bytes) -> bytes:
        if self._decode is None or self._resampler is None:
            if len(data) % 2:
                raise InvalidAudio("audio/pcm holds 16-bit samples: an even number of bytes")
            return data
        return self._resampler.process(self._decode(data))


class OutputConverter:
    """Engine PCM at ``input_rate`` to the client's ``fmt``."""

    def __init__(self, fmt: str, input_rate: int) -> None:
        self.format = fmt
        self._encode = _G711_ENCODERS.get(fmt)
        self._resampler = StreamResampler(input_rate, wire_rate(fmt))

    def convert(self, pcm: bytes) -> bytes:
        out = self._resampler.process(pcm)
        return out if self._encode is None else self._encode(out)

    def finish(self) -> bytes:
        """The samples the resampler still holds, at the end of a response's audio."""
        out = self._resampler.flush()
        return out if self._encode is None else self._encode(out)
