"""The engine side of a realtime session: the core's :class:`EngineSide` port, plus binding and release.

Two implementations: :mod:`tts_backend` (a text-to-speech engine speaks assistant text, turn by turn, through the
speech session core) and :mod:`duplex_backend` (a natively duplex model listens and speaks in lockstep ticks).
The session core calls a backend on the event loop; a backend reports back through the :class:`ResponseSink` calls
(the connection, which hands them to the core and lets a producer wait for outbox room).
"""

from __future__ import annotations

import abc
from typing import Protocol

from omnigate.sessions.realtime.capabilities import RealtimeCapabilities
from omnigate.sessions.realtime.config import RealtimeConfig, ResponseSettings
from omnigate.sessions.realtime.conversation import Item, Response, ResponseStatus


class SessionRefused(Exception):
    """The engine cannot take the session now; ``retry_after_s`` tells the client when to try again."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


class ResponseSink(Protocol):
    """The core's side: where a backend delivers what its engine produced."""

    def open_model_response(self) -> Response | None:
        """A natively duplex model began to speak: open a response for it (None: no output wanted)."""

    def response_audio(self, response: Response, pcm: bytes, sample_rate: int, engine_ms: float | None = None) -> bool:
        """Audio of ``response``; False when nothing was queued (the response ended, or it sends text only).
        ``engine_ms``: on the first audio of an engine utterance, the engine's time from its text to this audio."""

    def response_text(self, response: Response, text: str, tokens: int) -> None:
        """Transcript (or text) of ``response``; ``tokens`` counts into its usage."""

    def response_input(self, response: Response, audio_ms: float) -> None:
        """User audio the engine consumed while producing ``response``."""

    def finish_response(
        self,
        response: Response,
        status: ResponseStatus,
        reason: str | None = None,
        error: tuple[str, str] | None = None,
    ) -> None:
        """End ``response``; ignored when it already ended."""

    def report_error(self, code: str, message: str) -> None:
        """A non-fatal engine-side error not tied to a response."""

    def fail(self, code: str, message: str) -> None:
        """End the session with a fatal typed error."""

    async def wait_for_room(self) -> None:
        """Until the outbox can take more audio."""


class Backend(abc.ABC):
    """Implements :class:`omnigate.sessions.realtime.session.EngineSide`; the connection binds and releases it."""

    capabilities: RealtimeCapabilities
    sample_rate: int
    admits_async = False  # True when reserve() may wait for the engine (a transport then binds asynchronously)

    async def text_room(self) -> None:
        """Until the engine can take more of a response's text (:meth:`add_speech`); by default at once."""
        return

    async def reserve(self) -> None:
        """Take the engine capacity the session needs, before it is announced. Raises SessionRefused. By default
        nothing: the engine admits in :meth:`start`."""
        return

    @abc.abstractmethod
    def start(self, sink: ResponseSink, config: RealtimeConfig) -> None:
        """Bind the engine for this session (after :meth:`reserve`). Raises SessionRefused or ConfigRefused."""

    @abc.abstractmethod
    def reconfigure(self, config: RealtimeConfig) -> None:
        """Apply a new session configuration (voice, speed). Raises ConfigRefused."""

    @abc.abstractmethod
    def open_speech(self, response: Response, settings: ResponseSettings) -> None:
        """Begin speaking ``response`` (text-to-speech engines only); its text follows in pieces."""

    @abc.abstractmethod
    def add_speech(self, response: Response, text: str) -> None:
        """More text of ``response``, spoken as soon as a sentence or clause of it is complete."""

    @abc.abstractmethod
    def close_speech(self, response: Response) -> None:
        """The text of ``response`` is complete: speak the rest, then finish it."""

    @abc.abstractmethod
    def cancel(self, response: Response) -> None:
        """Stop producing ``response`` now (the core purges what is queued and ends it)."""

    @abc.abstractmethod
    def push_audio(self, pcm: bytes) -> bool:
        """User audio (24 kHz s16le); False when refused because the input cap is reached."""

    @abc.abstractmethod
    def clear_input(self) -> None:
        """Drop user audio not yet consumed."""

    @abc.abstractmethod
    def released_audio(self, ms: float) -> None:
        """``ms`` of queued output audio left the outbox (sent or purged): room for more."""

    @abc.abstractmethod
    def release(self) -> None:
        """Free everything the session holds. Idempotent."""

    def turn_audio(self, item_id: str, pcm: bytes) -> None:  # noqa: B027 - only engines that answer use it
        """The user's committed turn as audio (engines that answer the conversation themselves): with
        :attr:`hears_turns`, only its audio not already given to :meth:`hear_turn_audio`."""

    # Engines that answer and encode a turn's audio as it comes: the session core gives them the turn in progress.
    hears_turns: bool = False

    def hear_turn_audio(self, pcm: bytes) -> None:  # noqa: B027 - only engines that hear turns use it
        """More of the user's turn in progress (24 kHz s16le), in order, from its start (:attr:`hears_turns`)."""

    def forget_turn_audio(self) -> None:  # noqa: B027 - only engines that hear turns use it
        """The turn being heard is no turn (the input buffer was cleared, turn detection restarted)."""

    def answer(self, response: Response, settings: ResponseSettings, conversation: list[Item]) -> None:
        """Answer ``conversation`` as ``response`` (engines that answer the conversation themselves)."""
        raise RuntimeError(f"the {self.capabilities.engine} engine does not answer a conversation itself")
