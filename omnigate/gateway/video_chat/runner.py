"""Runs one video-chat session on the event loop: its state machine, its thinker queries and its speech stream.

Transports (the WebSocket route, a WebRTC call) feed client inputs in and take :class:`ChatEvent` values out with
:meth:`VideoChatRunner.next_event`; :class:`Closed` is the last. The answer's speech is an ordinary speech session
(:class:`~omnigate.sessions.driver.SessionDriver`) on the gateway's engine pool: the thinker's text goes in through
the pool contract's ``push_text`` as the segmenter releases sentences, so the first audio starts at the answer's
first sentence and the talker batches these streams with every other speech session.

A pump moves the speech stream's events into the session's queue one at a time and takes the next only once the
transport has taken the audio before it, so the engine's credit still follows what the client actually reads.

An engine that speaks its answers itself (``info.voiced``: Qwen3-Omni under ``--engine qwen3-omni``) needs no speech
stream: its voice comes with its text (bounded by the answer's frames and the session's event queue).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from omnigate.engines.base import EngineError
from omnigate.engines.omni.request import EncoderCache, FrameInput, OmniInfo, ThinkOutput, ThinkRequest, ThinkSink
from omnigate.engines.pool_api import EnginePoolAPI
from omnigate.gateway.video_chat.frames import EncodedFrame, FrameDecodePool, FrameDecoder
from omnigate.sessions.driver import SessionDriver
from omnigate.sessions.messages import AppendText, Cancel, Configure, Flush, SessionClosed, SessionConfig
from omnigate.sessions.speech import SessionLimits
from omnigate.sessions.video_chat import (
    Action,
    CancelSpeech,
    CancelThink,
    ChatError,
    ChatEvent,
    CloseSession,
    DecodedFrame,
    Emit,
    FinishSpeech,
    Pong,
    PromptFormat,
    ResponseAudioDelta,
    SpeakText,
    StartThink,
    VideoChatConfig,
    VideoChatLimits,
    VideoChatSession,
)

log = logging.getLogger(__name__)

# Events queued for the transport beyond the speech stream's own (bounded) outbox: text deltas and control events.
MAX_QUEUED_EVENTS = 4096


class ThinkJobHandle(Protocol):
    def cancel(self) -> None: ...


class PromptModel(Protocol):
    @property
    def tokenizer(self) -> PromptFormat: ...


class ThinkEngine(Protocol):
    """What a session needs of the engine answering its questions (:class:`~omnigate.engines.omni.engine.OmniEngine`,
    or :class:`~omnigate.engines.qwen3_omni.video_chat.Qwen3VideoChat`)."""

    @property
    def info(self) -> OmniInfo: ...

    @property
    def model(self) -> PromptModel: ...

    def submit(self, request: ThinkRequest, sink: ThinkSink) -> ThinkJobHandle:
        """Start answering; raises :class:`~omnigate.engines.base.EngineError` (``engine_busy``, ...)."""

    def encode_ahead(self, frame: FrameInput, cache: EncoderCache) -> None:
        """A kept camera frame a question may sample (the engine may encode it into ``cache`` before it is asked)."""

    def forget_frames(self, cache: EncoderCache) -> None:
        """The session of ``cache`` ended: drop its frames still waiting to be encoded ahead."""


class Closed(msgspec.Struct, frozen=True):
    """The session ended; the transport closes with ``reason``."""

    reason: str


class VideoChatRunner:
    """One session: call the input methods from the transport's reader, await :meth:`next_event` in its writer."""

    def __init__(
        self,
        engine: ThinkEngine,
        pool: EnginePoolAPI[Any],
        frames: FrameDecodePool,
        speech_limits: SessionLimits,
        limits: VideoChatLimits,
        *,
        seed: int = 0,
        on_closed: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.frame_budget = frames.budget
        self._on_closed = on_closed
        voiced = engine.info.voiced
        self.session = VideoChatSession(engine.model.tokenizer, limits, voiced=voiced)
        # The video-chat session keeps its own idle rule (frames keep it alive); the speech stream never idles out.
        limits_no_idle = msgspec.structs.replace(speech_limits, idle_timeout_ms=speech_limits.max_session_ms)
        self.driver: SessionDriver | None = None
        if not voiced:
            self.driver = SessionDriver(pool, limits_no_idle)
            self.driver.submit(Configure(SessionConfig()))
        self.encoder_cache = EncoderCache(capacity=2 * limits.max_decoding_frames + 256)
        self._seed = seed
        self._job: ThinkJobHandle | None = None
        self._job_query: int | None = None
        self._events: deque[ChatEvent | Closed] = deque()
        self._ready = asyncio.Event()
        self._audio_taken = asyncio.Event()
        self._audio_taken.set()
        self._closed = False
        self.decoder = FrameDecoder(
            frames,
            engine.info.frame_size,
            self._on_frame,
            self._on_frame_refused,
            self._on_worker_died,
            capacity=limits.max_decoding_frames,
        )
        self._pump: asyncio.Task[None] | None = None
        if self.driver is not None:
            self._pump = asyncio.create_task(self._pump_speech(self.driver), name="video-chat-speech")
            self._pump.add_done_callback(self._pump_ended)

    # ---- client inputs ----------------------------------------------------------------------------------------

    @property
    def config(self) -> VideoChatConfig:
        return self.session.config or VideoChatConfig()

    @property
    def answering(self) -> bool:
        return self.session.answering

    @property
    def closed(self) -> bool:
        return self._closed

    def configure(self, config: VideoChatConfig) -> None:
        voice_changed = self.session.config is None or config.voice != self.config.voice
        self._apply(self.session.configure(config))
        changed = voice_changed and self.session.config is config and not self.session.answering
        if changed and self.driver is not None:
            self.driver.submit(Configure(SessionConfig(voice=config.voice)))

    def frame(self, data: EncodedFrame) -> None:
        admitted, actions = self.session.frame_arrived(server_full=not self.decoder.has_room)
        self._apply(actions)
        if admitted:
            self.decoder.put(data)

    def audio(self, pcm: bytes) -> None:
        self._apply(self.session.on_audio(pcm))

    def query(self, text: str, audio: bytes | None = None) -> None:
        self._apply(self.session.query(text, audio))

    def done(self) -> None:
        self._apply(self.session.done())

    def error(self, code: str, message: str, param: str | None = None) -> None:
        """A bad client message: reported, the session goes on."""
        self._push(ChatError(code, message, param))

    def pong(self) -> None:
        self._push(Pong())

    def fail(self, code: str, message: str) -> None:
        self._apply(self.session.fail(code, message))

    def abort(self, reason: str) -> None:
        self._apply(self.session.abort(reason))

    # ---- transport output -------------------------------------------------------------------------------------

    async def next_event(self) -> ChatEvent | Closed:
        while not self._events:
            self._ready.clear()
            await self._ready.wait()
        event = self._events.popleft()
        if isinstance(event, ResponseAudioDelta) and not any(isinstance(e, ResponseAudioDelta) for e in self._events):
            self._audio_taken.set()
        return event

    async def close(self) -> None:
        """Release everything: engine work, the speech stream, the decoder and the pump. Idempotent."""
        if not self._closed:
            self.abort("released")
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.wait([self._pump])  # a pump that died has ended the session already
        await self.decoder.close()
        self.engine.forget_frames(self.encoder_cache)
        if self.driver is not None:
            self.driver.release()

    # ---- internals --------------------------------------------------------------------------------------------

    def _push(self, event: ChatEvent | Closed) -> None:
        if self._closed:
            return
        if len(self._events) >= MAX_QUEUED_EVENTS and not isinstance(event, Closed):
            self._apply(self.session.fail("backlog", "too many unread events; the client is not reading"))
            return
        if isinstance(event, ResponseAudioDelta):
            self._audio_taken.clear()
        self._events.append(event)
        self._ready.set()

    def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Emit):
                self._push(action.event)
            elif isinstance(action, StartThink):
                self._start(action)
            elif isinstance(action, CancelThink):
                if self._job is not None and self._job_query == action.query:
                    self._job.cancel()
                    self._job = None
            elif isinstance(action, SpeakText):
                self._speech(AppendText(action.text))
            elif isinstance(action, FinishSpeech):
                self._speech(Flush())
            elif isinstance(action, CancelSpeech):
                self._speech(Cancel())
            elif isinstance(action, CloseSession):
                if self._job is not None:
                    self._job.cancel()
                    self._job = None
                self._events.append(Closed(action.reason))
                self._ready.set()
                self._closed = True
                if self.driver is not None:
                    self.driver.abort(action.reason)
                if self._on_closed is not None:
                    self._on_closed()

    def _speech(self, message: AppendText | Flush | Cancel) -> None:
        # A voiced session's state machine asks for no speech stream.
        if self.driver is not None:
            self.driver.submit(message)

    def _start(self, action: StartThink) -> None:
        query = action.query
        request = ThinkRequest(
            context=action.context,
            question=action.question,
            frames=action.frames,
            audio=action.audio,
            max_new_tokens=action.max_new_tokens,
            temperature=action.temperature,
            seed=self._seed + query,
            cache=self.encoder_cache,
            speak=self.config.speaks,
            voice=self.config.voice,
        )

        def sink(outputs: list[ThinkOutput]) -> None:
            self._on_think(query, outputs)

        try:
            self._job = self.engine.submit(request, sink)
            self._job_query = query
        except EngineError as exc:
            self._apply(self.session.on_think_refused(query, exc.code, exc.message))

    def _on_think(self, query: int, outputs: list[ThinkOutput]) -> None:
        if self._closed:
            return
        self._apply(self.session.on_think(query, outputs))

    def _on_frame(self, frame: DecodedFrame) -> None:
        actions = self.session.on_frame(frame)
        if self.session.ring and self.session.ring[-1] is frame:
            # Kept for questions to sample (not filtered out): encoded now, so a question finds its tokens ready.
            self.engine.encode_ahead(frame.frame, self.encoder_cache)
        self._apply(actions)

    def _on_frame_refused(self, code: str, message: str) -> None:
        self._apply(self.session.on_frame_failed(code, message))

    def _on_worker_died(self, message: str) -> None:
        """A task of the session ended unexpectedly: nothing it owed will come, so the session ends, typed."""
        self.fail("internal_error", message)

    def _pump_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        log.error("a video-chat speech pump stopped", exc_info=error)
        self._on_worker_died(f"the speech stream stopped: {type(error).__name__}: {error}")

    async def _pump_speech(self, driver: SessionDriver) -> None:
        while True:
            event = await driver.next_event()
            self._apply(self.session.on_speech(event))
            if isinstance(event, SessionClosed):
                return
            await self._audio_taken.wait()
