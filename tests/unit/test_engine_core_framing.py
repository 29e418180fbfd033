"""The engine-core socket's framing, sans I/O: frames survive any split of the byte stream, and a broken peer is
refused with a typed error instead of buffering without bound."""

from __future__ import annotations

import random

import pytest

from omnigate.engines.base import AudioChunk, StreamDone
from omnigate.engines.core.framing import (
    HEADER,
    MAX_FRAME_BYTES,
    Frame,
    FrameDecoder,
    FrameError,
    FrameKind,
    encode_frame,
)
from omnigate.engines.remote.protocol import Outputs, decode_stream_message, encode


def _frames() -> list[Frame]:
    pcm = bytes(range(256)) * 15  # 80 ms at 24 kHz s16le
    outputs = encode(Outputs([AudioChunk(0, pcm, 24_000), StreamDone(reason="completed")], handed_at=1.5))
    return [
        Frame(FrameKind.OPEN, 1, b"open-request"),
        Frame(FrameKind.STREAM, 1, outputs),
        Frame(FrameKind.END, 1, b""),
        Frame(FrameKind.CANCEL, 7, b""),
        Frame(FrameKind.STATS, 2**32 - 1, b"gateway-id"),
    ]


def test_frames_decode_whole_whatever_the_split() -> None:
    frames = _frames()
    wire = b"".join(encode_frame(f.kind, f.call, f.body) for f in frames)
    rng = random.Random(14)
    for _ in range(50):
        decoder = FrameDecoder()
        got: list[Frame] = []
        offset = 0
        while offset < len(wire):
            step = rng.randint(1, 64)
            got.extend(decoder.feed(wire[offset : offset + step]))
            offset += step
        assert got == frames
        assert decoder.buffered == 0


def test_pcm_crosses_as_the_msgpack_bytes_it_was_encoded_as() -> None:
    stream = next(f for f in _frames() if f.kind is FrameKind.STREAM)
    (decoded,) = FrameDecoder().feed(encode_frame(stream.kind, stream.call, stream.body))
    message = decode_stream_message(decoded.body)
    assert isinstance(message, Outputs)
    chunk, done = message.items
    assert isinstance(chunk, AudioChunk) and chunk.pcm == bytes(range(256)) * 15
    assert done == StreamDone(reason="completed")
    # The frame adds only its fixed header to the body: no second encoding of the audio.
    assert len(encode_frame(stream.kind, stream.call, stream.body)) == HEADER.size + len(stream.body)


def test_a_partial_frame_waits_for_the_rest() -> None:
    wire = encode_frame(FrameKind.REPLY, 3, b"x" * 1000)
    decoder = FrameDecoder()
    assert decoder.feed(wire[:500]) == []
    assert decoder.buffered == 500
    assert decoder.feed(wire[500:]) == [Frame(FrameKind.REPLY, 3, b"x" * 1000)]


def test_an_oversized_frame_is_refused_from_its_header() -> None:
    decoder = FrameDecoder()
    with pytest.raises(FrameError, match="exceeds"):
        decoder.feed(HEADER.pack(MAX_FRAME_BYTES + 1, FrameKind.STREAM, 1))
    with pytest.raises(FrameError, match="exceeds"):
        encode_frame(FrameKind.STREAM, 1, b"\0" * (MAX_FRAME_BYTES + 1))


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(FrameError, match="unknown frame kind 99"):
        FrameDecoder().feed(HEADER.pack(0, 99, 1))
