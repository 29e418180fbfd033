"""The session API of an engine that answers a conversation itself, text and voice (``--engine qwen3-omni``).

Kept free of model imports so that the gateway's realtime backend (:mod:`omnigate.gateway.realtime.answer_backend`)
types against it without loading torch; :class:`omnigate.engines.qwen3_omni.serving.Qwen3OmniServing` implements it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from omnigate.engines.base import EngineInfo

ANSWERING_FAMILY = "qwen3-omni"  # the engine family that answers /v1/realtime sessions itself

# One conversation turn: (role, text, the audio tokens of the user's speech or None).
PromptTurn = tuple[str, str, Any]


class AnswerSink(Protocol):
    """Where one answer's outputs go, on the event loop of the caller of :meth:`AnsweringEngine.answer`."""

    def text(self, delta: str) -> None: ...

    def audio(self, pcm: bytes, sample_rate: int) -> None:
        """Mono s16le at ``sample_rate``."""

    def end(self, reason: str, code: str | None, message: str | None) -> None:
        """Exactly once, last: ``reason`` stop, length, max_context or error (then ``code`` and ``message``)."""


class AnswerHandle(Protocol):
    def cancel(self) -> None:
        """Stop the answer at once: nothing more of it reaches its sink."""

    def grant(self, chunks: int) -> None:
        """Let the answer make ``chunks`` audio chunks (:meth:`AnswerSink.audio` calls) in all: a cumulative limit,
        so a repeated or late grant changes nothing. An answer at its credit pauses until the next grant."""


class TurnHearing(Protocol):
    """A user turn heard as it comes (:meth:`AnsweringEngine.turn_ahead`)."""

    def hear(self, pcm: bytes) -> None:
        """More of the turn's 24 kHz s16le speech, in order; never blocks."""

    def close(self) -> None:
        """The turn will not be finished (it was forgotten): what it holds may go."""


class AnsweringEngine(Protocol):
    info: EngineInfo

    async def encode_audio(self, pcm: bytes) -> Any:
        """Audio tokens of a user turn's 24 kHz s16le speech; raises
        :class:`~omnigate.engines.base.EngineError` (``engine_busy``, ...)."""

    def turn_ahead(self) -> TurnHearing | None:
        """A user turn to hear as it comes, encoded meanwhile as far as it can be; None where the engine encodes a
        turn only once it has ended."""

    async def finish_turn(self, ahead: TurnHearing, pcm: bytes) -> Any:
        """Audio tokens of the turn ``ahead`` heard, whose whole speech is ``pcm``: what :meth:`encode_audio` of
        ``pcm`` gives; raises as it does."""

    def answer(
        self,
        turns: Sequence[PromptTurn],
        sink: AnswerSink,
        *,
        instructions: str,
        speaker: str,
        max_tokens: int,
        max_frames: int,
        credit: int | None = None,
    ) -> AnswerHandle:
        """Start answering, at most ``credit`` audio chunks before a grant (None: unbounded); raises
        :class:`~omnigate.engines.base.EngineError` (``engine_busy``, ...)."""
