"""The messages of answers on the engine-core socket (the bodies of the ``ANSWER_*`` frames), msgpack.

An engine that answers a conversation itself (``--engine qwen3-omni``) runs in the core; each gateway worker's
realtime sessions ask it for answers: the conversation goes in one ``AnswerOpen`` (text, and each user turn's speech
as 24 kHz s16le PCM, which the core encodes once per connection), the answer comes back as ``AnswerOutputs`` (text
deltas and PCM in order, one message per answer per turn of the core's loop) and one ``AnswerEnded``. Credit crosses
as a cumulative count of audio chunks (``AnswerGrant``), so a repeated grant changes nothing.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from omnigate.engines.base import EngineInfo

# The core says the engine is gone (its connection dropped) with this code, as the speech streams do.
ENGINE_UNAVAILABLE = "engine_unavailable"


class AnswerInfo(msgspec.Struct, frozen=True):
    """The answer to ANSWER_HELLO."""

    info: EngineInfo


class TurnIn(msgspec.Struct, frozen=True, array_like=True):
    """One turn of the conversation: its role, text, and the user's speech (24 kHz s16le) or None, with the id
    the connection gave that speech (the core keeps its encoding by that id, so later answers do not encode it
    again)."""

    role: str
    text: str
    speech: bytes | None = None
    speech_id: int = 0


class AnswerOpen(msgspec.Struct, frozen=True):
    turns: list[TurnIn]
    instructions: str
    speaker: str
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    max_frames: Annotated[int, msgspec.Meta(ge=1)]
    credit: Annotated[int, msgspec.Meta(ge=0)] | None = None


class AnswerGrant(msgspec.Struct, frozen=True):
    chunks: Annotated[int, msgspec.Meta(ge=0)]


class TextDelta(msgspec.Struct, frozen=True, array_like=True, tag="t"):
    text: str


class AudioChunk(msgspec.Struct, frozen=True, array_like=True, tag="a"):
    pcm: bytes  # s16le mono
    sample_rate: int


class AnswerOutputs(msgspec.Struct, frozen=True):
    outputs: list[TextDelta | AudioChunk]


class AnswerEnded(msgspec.Struct, frozen=True):
    """``reason``: stop, length, max_context or error (then ``code`` and ``message``)."""

    reason: str
    code: str | None = None
    message: str | None = None


ENCODER = msgspec.msgpack.Encoder()
