"""G.711 µ-law and A-law (ITU-T G.711) for 8 kHz telephony audio, as lookup tables over numpy.

Encoding follows the reference coder (truncating segment quantisation), so the bytes match what telephony stacks
produce; decoding maps each byte to the centre of its quantisation step.
"""

from __future__ import annotations

from functools import cache

import numpy as np

_ULAW_BIAS = 0x84
_ULAW_CLIP = 8159
_SEGMENT_ENDS_ULAW = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
_SEGMENT_ENDS_ALAW = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])


def _all_samples() -> np.ndarray:
    return np.arange(-32768, 32768, dtype=np.int64)


@cache
def _ulaw_encode_table() -> np.ndarray:
    pcm = _all_samples() >> 2
    mask = np.where(pcm < 0, 0x7F, 0xFF)
    magnitude = np.minimum(np.abs(pcm), _ULAW_CLIP) + (_ULAW_BIAS >> 2)
    segment = np.searchsorted(_SEGMENT_ENDS_ULAW, magnitude)
    value = (segment << 4) | ((magnitude >> (segment + 1)) & 0xF)
    value = np.where(segment >= 8, 0x7F, value)
    return ((value ^ mask) & 0xFF).astype(np.uint8)


@cache
def _alaw_encode_table() -> np.ndarray:
    pcm = _all_samples() >> 3
    mask = np.where(pcm >= 0, 0xD5, 0x55)
    magnitude = np.where(pcm >= 0, pcm, -pcm - 1)
    segment = np.searchsorted(_SEGMENT_ENDS_ALAW, magnitude)
    shift = np.where(segment < 2, 1, segment)
    value = (segment << 4) | ((magnitude >> shift) & 0xF)
    value = np.where(segment >= 8, 0x7F, value)
    return ((value ^ mask) & 0xFF).astype(np.uint8)


@cache
def _ulaw_decode_table() -> np.ndarray:
    code = ~np.arange(256, dtype=np.int64) & 0xFF
    t = (((code & 0x0F) << 3) + _ULAW_BIAS) << ((code & 0x70) >> 4)
    return np.where(code & 0x80, _ULAW_BIAS - t, t - _ULAW_BIAS).astype("<i2")


@cache
def _alaw_decode_table() -> np.ndarray:
    code = np.arange(256, dtype=np.int64) ^ 0x55
    segment = (code & 0x70) >> 4
    t = (code & 0x0F) << 4
    t = np.where(segment == 0, t + 8, (t + 0x108) << np.maximum(segment - 1, 0))
    return np.where(code & 0x80, t, -t).astype("<i2")


def ulaw_encode(pcm: bytes) -> bytes:
    """s16le samples to µ-law bytes (one per sample)."""
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.int64) + 32768
    return _ulaw_encode_table()[samples].tobytes()


def alaw_encode(pcm: bytes) -> bytes:
    """s16le samples to A-law bytes (one per sample)."""
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.int64) + 32768
    return _alaw_encode_table()[samples].tobytes()


def ulaw_decode(data: bytes) -> bytes:
    """µ-law bytes to s16le samples."""
    return _ulaw_decode_table()[np.frombuffer(data, dtype=np.uint8)].tobytes()


def alaw_decode(data: bytes) -> bytes:
    """A-law bytes to s16le samples."""
    return _alaw_decode_table()[np.frombuffer(data, dtype=np.uint8)].tobytes()
