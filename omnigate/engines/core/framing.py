"""Frames on the engine-core socket: a fixed binary header and a msgpack body, encoded and decoded sans I/O.

The bodies are the remote pool's messages (:mod:`omnigate.engines.remote.protocol`), already msgpack; a frame only
says which call a body belongs to and what it is, so PCM crosses the socket as the bytes of one msgpack ``bin``,
never pickled and never re-encoded. The ``DUPLEX_*`` kinds serve duplex sessions
(:mod:`omnigate.engines.core.duplex_protocol`): their call id is the gateway's session id, and user audio crosses
as the raw PCM body. The ``ANSWER_*`` kinds serve the answers of an engine that answers a conversation itself
(:mod:`omnigate.engines.core.answer_protocol`): their call id is the gateway's answer id. Every frame is bounded by
:data:`MAX_FRAME_BYTES`; a peer that sends a longer one, or an unknown kind, is a protocol error and its connection is
dropped.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import TypeVar

import msgspec

# body length, kind, call id (network byte order)
HEADER = struct.Struct("!IBI")
# An audio chunk is tens of kilobytes; the largest control message carries the texts of a batch of streams.
MAX_FRAME_BYTES = 8 * 1024 * 1024


class FrameKind(enum.IntEnum):
    """What a frame carries. Gateway to core: OPEN, CANCEL, CONTROL, STATS, the duplex calls DUPLEX_HELLO,
    DUPLEX_OPEN, DUPLEX_AUDIO, DUPLEX_CLEAR, DUPLEX_GRANT, DUPLEX_CLOSE and the answer calls ANSWER_HELLO, ANSWER_OPEN,
    ANSWER_CANCEL, ANSWER_GRANT, ANSWER_HEAR, ANSWER_FORGET. Core to gateway: the rest."""

    OPEN = 1  # start a stream call: an ``OpenStream``
    STREAM = 2  # one message of a stream call: ``Opened``, ``Refused`` or ``Outputs``
    END = 3  # the stream call ended (after its terminal message); empty body
    CANCEL = 4  # the gateway gives up a stream call: the core aborts the stream and frees its slot; empty body
    CONTROL = 5  # a ``ControlBatch``
    STATS = 6  # the gateway's id (UTF-8): asks for ``ReplicaStats`` and renews the gateway's streams
    REPLY = 7  # the answer to CONTROL (a ``ReplicaReport``) or STATS (a ``ReplicaStats``)
    ERROR = 8  # the call failed inside the core; the body is a UTF-8 description
    DUPLEX_HELLO = 9  # the connection serves duplex sessions: the core answers DUPLEX_INFO; empty body
    DUPLEX_INFO = 10  # a ``DuplexInfo``: the engine's facts
    DUPLEX_OPEN = 11  # open the session ``call``: a ``DuplexOpen``
    DUPLEX_AUDIO = 12  # user audio of the session: s16le PCM at the engine's rate, the body itself
    DUPLEX_CLEAR = 13  # drop the session's unconsumed input; empty body
    DUPLEX_GRANT = 14  # the session's consumer has room for more frames: a ``DuplexGrant``
    DUPLEX_CLOSE = 15  # close the session and free its slot; empty body
    DUPLEX_TICK = 16  # every frame one tick made for the connection's sessions: a ``DuplexTick``; call 0
    DUPLEX_ENDED = 17  # the core ended the session (refused, or its step failed): a ``DuplexEnded``
    DUPLEX_STATS = 18  # the clock's counters (a ``ClockStats``), at most once a second; call 0
    DUPLEX_OPENED = 19  # the session ``call`` holds a slot (the answer to DUPLEX_OPEN that admits it); empty body
    ANSWER_HELLO = 20  # the connection serves answers (an engine that answers itself): the core says ANSWER_INFO
    ANSWER_INFO = 21  # an ``AnswerInfo``: the engine's facts
    ANSWER_OPEN = 22  # answer the conversation of an ``AnswerOpen`` as the answer ``call``
    ANSWER_CANCEL = 23  # stop the answer ``call`` at once; empty body
    ANSWER_GRANT = 24  # the answer's session took more audio: an ``AnswerGrant``
    ANSWER_OUTPUTS = 25  # the answer's text and audio made in one turn of the core's loop: an ``AnswerOutputs``
    ANSWER_ENDED = 26  # the answer ended (or was refused): an ``AnswerEnded``, last
    ANSWER_HEAR = 27  # more of a user turn in progress, s16le 24 kHz PCM, the body itself; call: its speech id
    ANSWER_FORGET = 28  # the turn heard under the speech id ``call`` will not be answered; empty body
    ANSWER_STATS = 29  # the engine's input encoder counters (an ``EncoderStats``), at most once a second; call 0


_KINDS = frozenset(int(k) for k in FrameKind)


class FrameError(Exception):
    """The peer broke the framing: an oversized frame or an unknown kind."""


@dataclass(frozen=True, slots=True)
class Frame:
    kind: FrameKind
    call: int
    body: bytes


def encode_frame(kind: FrameKind, call: int, body: bytes = b"") -> bytes:
    """One frame as bytes. Raises :class:`FrameError` for a body over :data:`MAX_FRAME_BYTES`."""
    if len(body) > MAX_FRAME_BYTES:
        raise FrameError(f"a frame body of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(len(body), kind, call) + body


class FrameDecoder:
    """Bytes in, whole frames out. Holds at most one partial frame (bounded by :data:`MAX_FRAME_BYTES`)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        """Frames completed by ``data``, in order. Raises :class:`FrameError`."""
        self._buffer += data
        frames: list[Frame] = []
        view = memoryview(self._buffer)
        offset = 0
        try:
            while len(view) - offset >= HEADER.size:
                length, kind, call = HEADER.unpack_from(view, offset)
                if length > MAX_FRAME_BYTES:
                    raise FrameError(f"a frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
                if kind not in _KINDS:
                    raise FrameError(f"unknown frame kind {kind}")
                end = offset + HEADER.size + length
                if end > len(view):
                    break
                frames.append(Frame(FrameKind(kind), call, bytes(view[offset + HEADER.size : end])))
                offset = end
        finally:
            view.release()
        del self._buffer[:offset]
        return frames

    @property
    def buffered(self) -> int:
        """Bytes of a frame not yet complete."""
        return len(self._buffer)


_M = TypeVar("_M")


def decode_body(body: bytes, kind: type[_M]) -> _M:
    """A frame's msgpack body as ``kind``. Raises :class:`FrameError` for a malformed one."""
    try:
        return msgspec.msgpack.decode(body, type=kind)
    except msgspec.DecodeError as exc:
        raise FrameError(f"a malformed {kind.__name__}: {exc}") from None
