"""What the gateway and its recognizer processes say over the worker's stdin and stdout: msgpack frames, each
behind its length (4 bytes, big-endian).

The gateway sends a turn's audio as it comes (:class:`Hear`, one message of a turn in flight at a time) and
:class:`Drop` for a turn nobody waits for any more; the worker answers each :class:`Hear` with :class:`Fed`, or at the
end of the turn with :class:`Heard` (its words), or :class:`Failed`; :class:`Loaded` once its first decoder is ready.
"""

from __future__ import annotations

import struct

import msgspec

HEADER = struct.Struct(">I")
MAX_PIECE_BYTES = 96_000  # the audio of one Hear: 2 s at 24 kHz mono s16le
MAX_FRAME_BYTES = 1 << 20


class Hear(msgspec.Struct, tag=True, frozen=True):
    """More of turn ``turn``'s audio (24 kHz mono s16le; the first starts the turn); ``end``: the last of it."""

    turn: int
    pcm: bytes
    end: bool


class Drop(msgspec.Struct, tag=True, frozen=True):
    """Turn ``turn`` is not wanted any more: its decoder goes back to the worker's idle ones."""

    turn: int


class Fed(msgspec.Struct, tag=True, frozen=True):
    """The audio of turn ``turn``'s last :class:`Hear` is decoded."""

    turn: int


class Heard(msgspec.Struct, tag=True, frozen=True):
    """Turn ``turn`` ended: its words."""

    turn: int
    text: str


class Failed(msgspec.Struct, tag=True, frozen=True):
    """Turn ``turn``'s decoder raised; it is dropped."""

    turn: int
    message: str


class Loaded(msgspec.Struct, tag=True, frozen=True):
    """The worker's first decoder is loaded: turns are decoded without waiting for one."""


ToWorker = Hear | Drop
FromWorker = Fed | Heard | Failed | Loaded

_encoder = msgspec.msgpack.Encoder()
to_worker = msgspec.msgpack.Decoder(ToWorker)
from_worker = msgspec.msgpack.Decoder(FromWorker)


def frame(message: ToWorker | FromWorker) -> bytes:
    """``message`` with its length in front."""
    body = _encoder.encode(message)
    return HEADER.pack(len(body)) + body


def body_length(header: bytes) -> int:
    """The length a frame's header announces. Raises ValueError past :data:`MAX_FRAME_BYTES`."""
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {length} bytes (at most {MAX_FRAME_BYTES})")
    return int(length)
