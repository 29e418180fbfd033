"""Realtime sessions on a natively duplex engine: the model listens and speaks at once, in lockstep ticks.

User audio goes straight to the engine's per-session input (refused beyond the cap); every tick the engine hands
back one frame. The model's own text stream says whether it speaks; speaking frames are grouped into responses
(:class:`ModelTurns`), the rest is the model listening and is not sent. Engine credit is counted in frames: a frame
not sent is returned at once, a queued one when it leaves the outbox or is purged.
"""

from __future__ import annotations

from typing import Protocol

from omnigate.engines.base import EngineInfo
from omnigate.engines.duplex.session import (
    DuplexClosed,
    DuplexFrame,
    DuplexFull,
    DuplexSession,
    DuplexUnavailable,
    FrameSink,
    SessionEnd,
)
from omnigate.engines.duplex.stats import ClockStats
from omnigate.gateway.realtime.backend import Backend, ResponseSink, SessionRefused
from omnigate.sessions.realtime.capabilities import RealtimeCapabilities, capabilities_for
from omnigate.sessions.realtime.config import RealtimeConfig, ResponseSettings
from omnigate.sessions.realtime.conversation import Response
from omnigate.sessions.realtime.model_turns import ModelTurns

MAX_MUTE_MS = 1000.0  # after an interruption, how long a model that keeps talking stays unheard


class DuplexEngineApi(Protocol):
    """The session API of :class:`omnigate.engines.duplex.engine.DuplexEngine` (kept as a protocol so that the
    gateway imports no model code), and of :class:`omnigate.engines.core.duplex_client.CoreDuplexClient`, which
    serves it from an engine-core process."""

    info: EngineInfo
    sample_rate: int
    frame_s: float
    stats: ClockStats

    async def admit(
        self,
        sink: FrameSink,
        *,
        max_input_bytes: int,
        initial_credit_frames: int,
        seed: int | None = None,
        on_end: SessionEnd | None = None,
    ) -> DuplexSession:
        """Open a session once the engine holds a slot for it. Raises DuplexFull, DuplexClosed, DuplexUnavailable."""
        ...

    def push_audio(self, session: DuplexSession, pcm: bytes) -> bool: ...

    def clear_input(self, session: DuplexSession) -> int: ...

    def grant(self, session: DuplexSession, frames: int) -> None: ...

    def close_session(self, session: DuplexSession) -> None: ...

    def shutdown(self) -> None: ...


class DuplexBackend(Backend):
    """One realtime session on a duplex engine: :meth:`reserve` takes its slot (on an engine core, the core's
    answer is awaited, so admission stays exact with several gateway processes), :meth:`start` binds it."""

    admits_async = True

    def __init__(self, engine: DuplexEngineApi, *, input_max_bytes: int, outbox_ms: float, turn_end_ms: float) -> None:
        self.engine = engine
        self.capabilities: RealtimeCapabilities = capabilities_for(engine.info)
        self.sample_rate = engine.sample_rate
        self._frame_ms = engine.frame_s * 1000.0
        self._input_max_bytes = input_max_bytes
        self._credit_frames = max(1, int(outbox_ms // self._frame_ms))
        end_frames = max(1, round(turn_end_ms / self._frame_ms))
        self._turns = ModelTurns(end_frames, max_mute_frames=max(1, round(MAX_MUTE_MS / self._frame_ms)))
        self._session: DuplexSession | None = None
        self._sink: ResponseSink | None = None
        self._response: Response | None = None
        self._released_ms = 0.0
        self._released = False

    async def reserve(self) -> None:
        if self._session is not None:
            return
        try:
            self._session = await self.engine.admit(
                self._on_frame,
                max_input_bytes=self._input_max_bytes,
                initial_credit_frames=self._credit_frames,
                on_end=self._on_end,
            )
        except DuplexFull as exc:
            raise SessionRefused("resource_exhausted", str(exc), exc.retry_after_s) from None
        except DuplexUnavailable as exc:
            raise SessionRefused("engine_unavailable", str(exc), exc.retry_after_s) from None
        except DuplexClosed:
            raise SessionRefused("shutting_down", "the server is shutting down") from None
        if self._released:  # released while the engine answered
            self.engine.close_session(self._session)

    def start(self, sink: ResponseSink, config: RealtimeConfig) -> None:
        if self._session is None:
            raise RuntimeError("a duplex session is started after reserve() took its slot")
        self._sink = sink

    def reconfigure(self, config: RealtimeConfig) -> None:
        """The model's voice is its own and it has no speed control: the config rules refuse changes to them."""

    def open_speech(self, response: Response, settings: ResponseSettings) -> None:
        raise RuntimeError("a duplex model does not speak given text")

    def add_speech(self, response: Response, text: str) -> None:
        raise RuntimeError("a duplex model does not speak given text")

    def close_speech(self, response: Response) -> None:
        raise RuntimeError("a duplex model does not speak given text")

    def cancel(self, response: Response) -> None:
        if response is self._response:
            self._response = None
            self._turns.interrupt()

    def push_audio(self, pcm: bytes) -> bool:
        if self._session is None:
            return True
        return self.engine.push_audio(self._session, pcm)

    def clear_input(self) -> None:
        if self._session is not None:
            self.engine.clear_input(self._session)

    def released_audio(self, ms: float) -> None:
        self._released_ms += ms
        frames = int(self._released_ms // self._frame_ms)
        if frames:
            self._released_ms -= frames * self._frame_ms
            self._grant(frames)

    def release(self) -> None:
        self._released = True
        if self._session is not None:
            self.engine.close_session(self._session)
        self._sink = None  # the session refers to this backend: no cycle outlives the session
        self._response = None

    def _grant(self, frames: int) -> None:
        if self._session is not None:
            self.engine.grant(self._session, frames)

    def _on_end(self, code: str, message: str) -> None:
        sink = self._sink
        if sink is not None:  # otherwise released already
            sink.fail(code, message)

    def _on_frame(self, frame: DuplexFrame) -> None:
        sink = self._sink
        if sink is None:
            return  # a frame the engine made before the session was released
        role = self._turns.feed(frame.listening)
        if role == "start":
            self._response = sink.open_model_response()
        response = self._response
        if role == "listen" or response is None:
            self._grant(1)
            return
        sink.response_input(response, frame.input_ms)
        if not sink.response_audio(response, frame.pcm, frame.sample_rate):
            self._grant(1)
        sink.response_text(response, frame.text, 0 if frame.listening else 1)
        limit = response.max_output_tokens
        if role == "end":
            self._response = None
            sink.finish_response(response, "completed")
        elif limit is not None and response.output_audio_ms >= limit * self._frame_ms:
            self._response = None
            self._turns.interrupt()
            sink.finish_response(response, "incomplete", "max_output_tokens")
