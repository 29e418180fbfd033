"""One realtime session between a transport and the protocol core: reads, writes, runs timers and the VAD.

A transport adapter (WebSocket, a WebRTC data channel) feeds :meth:`RealtimeConnection.receive_text` with each
client JSON event and, for transports with a media track, :meth:`receive_audio` with microphone PCM; it awaits
:meth:`next_output` for what to send: encoded server events, track audio (``audio_route="track"``: output audio
as PCM for the media track instead of ``response.output_audio.delta`` events) and, last, :class:`Closing`.

The protocol's rules live in :class:`omnigate.sessions.realtime.session.RealtimeSession`; this class decodes the
JSON, binds and releases the backend (which reports back here, as its :class:`ResponseSink`), wakes the writer when
the core queues output, runs the core's idle and duration deadlines on the loop, scores speech on the shared VAD
executor, and runs the transcription and LLM calls the core asks for as tasks it owns (one LLM request at a time;
all of them cancelled when the session ends, which closes their HTTP streams). Without a transcription service the
embedded recognizer hears each turn: the audio the core hands over as the turn goes feeds the turn's listener, and
the turn's end awaits its words.

No session waits on work that died: a service's failure ends its response typed and the session goes on, while a
failure of the server's own work (a task that raised past its handlers, a VAD result or a deadline the core could
not take) ends the session with a typed ``server_error``, and the transport then releases everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor, Future
from typing import Any

from omnigate.engines.openai_compat.errors import ServiceError
from omnigate.engines.recognizer import TurnListener
from omnigate.engines.vad import SpeechProbability
from omnigate.gateway.realtime.backend import Backend
from omnigate.gateway.realtime.protocol import read_client_message
from omnigate.gateway.realtime.responder_clients import ResponderClients
from omnigate.sessions.realtime.answer import ResponderPolicy
from omnigate.sessions.realtime.audio import ENGINE_RATE
from omnigate.sessions.realtime.config import RealtimeConfig, VoiceResolver
from omnigate.sessions.realtime.conversation import Conversation, IdSource, Response, ResponseStatus
from omnigate.sessions.realtime.outbox import RealtimeOutbox, RealtimeOutput
from omnigate.sessions.realtime.requests import (
    CancelChat,
    ForgetAudio,
    HearAudio,
    ScoreSpeech,
    ServiceFailed,
    SessionRequest,
    StartChat,
    Transcribe,
    TurnMeasured,
)
from omnigate.sessions.realtime.responder import TurnTimings
from omnigate.sessions.realtime.session import AudioRoute, RealtimeLimits, RealtimeSession

log = logging.getLogger(__name__)


class ResponderReports:
    """Where a session reports its answered turns and its services' failures (the process's metrics)."""

    def __init__(self, turn: Callable[[TurnTimings], None], failure: Callable[[str], None]) -> None:
        self.turn = turn
        self.failure = failure


def policy_of(clients: ResponderClients) -> ResponderPolicy:
    settings = clients.settings
    return ResponderPolicy(
        model=settings.llm_model,
        max_tokens=settings.llm_max_tokens,
        history_max_chars=settings.history_max_chars,
        transcription=clients.transcription is not None or clients.recognizer is not None,
        streaming_transcription=clients.recognizer is not None,
    )


class RealtimeConnection:
    """One realtime session over any transport: the core, its backend, its timers and its writer's wake-ups."""

    def __init__(
        self,
        backend: Backend,
        *,
        limits: RealtimeLimits,
        model: str,
        served_models: frozenset[str],
        resolve_voice: VoiceResolver,
        vad_executor: Executor,
        audio_route: AudioRoute = "events",
        ids: IdSource | None = None,
        responder: ResponderClients | None = None,
        reports: ResponderReports | None = None,
    ) -> None:
        self.backend = backend
        self.limits = limits
        self._responder = responder
        self._reports = reports
        self._chats: dict[str, asyncio.Task[None]] = {}  # by response id: at most one runs, others are ending
        self._transcriptions: set[asyncio.Task[None]] = set()
        # the embedded recognizer hearing the user's turn in progress (or why it could not), and ended turns it is
        # finishing
        self._listener: TurnListener | ServiceError | None = None
        self._ended_turns: set[TurnListener] = set()
        self._vad_executor = vad_executor
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._event_room = asyncio.Event()
        self._event_room.set()
        self.core = RealtimeSession(
            backend,
            limits=limits,
            model=model,
            served_models=served_models,
            resolve_voice=resolve_voice,
            now=time.monotonic(),
            audio_route=audio_route,
            ids=ids,
            on_request=self._on_request,
            on_output=self._on_output,
            responder=policy_of(responder) if responder is not None else None,
        )
        self._vad: SpeechProbability | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._released = False

    @property
    def closed(self) -> bool:
        return self.core.closed

    @property
    def session_id(self) -> str:
        return self.core.session_id

    @property
    def config(self) -> RealtimeConfig:
        return self.core.config

    @property
    def conversation(self) -> Conversation:
        return self.core.conversation

    @property
    def outbox(self) -> RealtimeOutbox:
        return self.core.outbox

    @property
    def idle(self) -> bool:
        """No response in progress: closing the session now loses no work (a graceful drain asks)."""
        return self.core.idle

    # ---- lifecycle ----------------------------------------------------------------------------------------------

    async def reserve(self) -> None:
        """Take the engine capacity the session needs (before :meth:`open`). Raises SessionRefused."""
        await self.backend.reserve()

    def open(self) -> None:
        """Bind the engine and announce the session. Raises SessionRefused when the engine cannot take it."""
        self.backend.start(self, self.core.config)
        self.core.open()
        self._arm_timer(self.core.next_deadline)

    async def next_output(self) -> RealtimeOutput:
        """The next thing to send; :class:`Closing` is the last."""
        while True:
            output = self.core.take_output(time.monotonic())
            if output is not None:
                return output
            self._ready.clear()
            await self._ready.wait()

    def disconnect(self) -> None:
        """The transport is gone: stop all work at once."""
        self.core.disconnect()
        self.release()

    def release(self) -> None:
        """Free the engine and the timers. Idempotent; the adapter calls it when the session's scope ends."""
        if self._released:
            return
        self._released = True
        self.backend.release()
        if self._timer is not None:
            self._timer.cancel()
        for task in (*self._chats.values(), *self._transcriptions):
            task.cancel()
        self._forget()
        for listener in self._ended_turns:  # (a task cancelled before it ran never reached its own cleanup)
            listener.cancel()
        # The session and its backend refer to each other: drop what holds native resources now rather than when
        # the cycle collector next runs a full pass (rarely, in a process holding a model).
        self._vad = None
        self.core.release()

    def end(self, code: str, message: str) -> bool:
        """End the session from the server's side (a drain); False when it is already ending."""
        return self.core.end(code, message)

    # ---- client input -------------------------------------------------------------------------------------------

    def receive_text(self, raw: str | bytes) -> None:
        """Handle one client JSON event; a bad event gets one typed error and the session goes on."""
        if not self.core.closed:
            self.core.receive(read_client_message(raw, self.limits), time.monotonic())

    def protocol_error(self, code: str, message: str) -> None:
        """A message the transport could not hand over as a client event (a binary WebSocket frame)."""
        self.core.protocol_error(code, message)

    def receive_audio(self, pcm: bytes) -> None:
        """Microphone audio from a media track: 24 kHz mono s16le."""
        self.core.receive_audio(pcm, time.monotonic())

    # ---- the backend's sink -------------------------------------------------------------------------------------

    def open_model_response(self) -> Response | None:
        return self.core.open_model_response()

    def response_audio(self, response: Response, pcm: bytes, sample_rate: int, engine_ms: float | None = None) -> bool:
        return self.core.response_audio(response, pcm, sample_rate, time.monotonic(), engine_ms)

    def response_text(self, response: Response, text: str, tokens: int) -> None:
        self.core.response_text(response, text, tokens)

    def response_input(self, response: Response, audio_ms: float) -> None:
        self.core.response_input(response, audio_ms)

    def finish_response(
        self,
        response: Response,
        status: ResponseStatus,
        reason: str | None = None,
        error: tuple[str, str] | None = None,
    ) -> None:
        self.core.finish_response(response, status, reason, error)

    def report_error(self, code: str, message: str) -> None:
        self.core.report_error(code, message)

    def fail(self, code: str, message: str) -> None:
        """End the session with a fatal typed error, then close."""
        self.core.fail(code, message)

    async def wait_for_room(self) -> None:
        """Until the outbox can take more audio."""
        await self._room.wait()

    # ---- what the core asks for ---------------------------------------------------------------------------------

    def _on_output(self) -> None:
        outbox = self.core.outbox
        if len(outbox):
            self._ready.set()
        if outbox.has_media_room:
            self._room.set()
        else:
            self._room.clear()
        if outbox.has_event_room:
            self._event_room.set()
        else:
            self._event_room.clear()

    def _on_request(self, request: SessionRequest) -> None:
        if isinstance(request, ScoreSpeech):
            if self._vad is None:
                self._vad = SpeechProbability(ENGINE_RATE)
            try:
                future = self._vad_executor.submit(self._vad.process, request.pcm)
            except RuntimeError:  # the executor is shut down: the server is stopping
                self.fail("server_error", "voice activity detection is not available")
                return
            future.add_done_callback(self._vad_finished)
        elif isinstance(request, StartChat):
            running = [task for task in self._chats.values() if not task.done()]
            self._start(self._chat(request, running), f"realtime-chat-{request.response_id}", request.response_id)
        elif isinstance(request, CancelChat):
            task = self._chats.get(request.response_id)
            if task is not None:
                task.cancel()
        elif isinstance(request, HearAudio):
            self._hear(request.pcm)
        elif isinstance(request, ForgetAudio):
            self._forget()
        elif isinstance(request, Transcribe):
            heard = None
            if self._responder is not None and self._responder.transcription is None:
                heard = self._end_turn(request.pcm)  # now: audio that comes next is the next turn's
            self._start(self._transcribe(request, heard), f"realtime-asr-{request.item_id}", None)
        elif isinstance(request, TurnMeasured):
            if self._reports is not None:
                self._reports.turn(request.timings)
        elif isinstance(request, ServiceFailed) and self._reports is not None:
            self._reports.failure(request.code)

    def _start(self, work: Coroutine[Any, Any, None], name: str, chat_of: str | None) -> None:
        if self._released:
            work.close()
            return
        task = self._loop.create_task(work, name=name)
        task.add_done_callback(self._task_ended)
        if chat_of is None:
            self._transcriptions.add(task)
            task.add_done_callback(self._transcriptions.discard)
        else:
            self._chats[chat_of] = task
            task.add_done_callback(lambda _: self._chats.pop(chat_of, None))

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        """A task that raised past its own handlers leaves the core waiting for an answer that will not come."""
        if task.cancelled() or (error := task.exception()) is None:
            return
        log.error("realtime task %s failed", task.get_name(), exc_info=error)
        self.fail("server_error", "work of this session failed in the server")

    async def _chat(self, request: StartChat, earlier: list[asyncio.Task[None]]) -> None:
        assert self._responder is not None
        if earlier:
            await asyncio.wait(earlier)  # a cancelled request closes its stream before the next one opens
        try:
            async with self._responder.chat.stream(request.request) as deltas:
                async for delta in deltas:
                    # Backpressure: the stream is read no faster than the client takes the events it makes and
                    # the engine speaks its text.
                    await self._event_room.wait()
                    await self.backend.text_room()
                    self.core.chat_delta(request.response_id, delta, time.monotonic())
        except ServiceError as exc:
            self.core.chat_failed(request.response_id, exc.code, exc.message)
        except Exception:
            # Not the service's failure but ours: the response still ends, typed, and the session goes on.
            log.exception("a realtime LLM request failed")
            self.core.chat_failed(request.response_id, "server_error", "the LLM request failed in the server")

    def _hear(self, pcm: bytes) -> None:
        if self._released:
            return
        listener = self._listener
        if listener is None:
            assert self._responder is not None and self._responder.recognizer is not None
            try:
                listener = self._responder.recognizer.listen()
            except ServiceError as exc:
                listener = exc  # the turn's transcription fails with it when the turn ends
            self._listener = listener
        if isinstance(listener, TurnListener):
            listener.hear(pcm)

    def _forget(self) -> None:
        listener, self._listener = self._listener, None
        if isinstance(listener, TurnListener):
            listener.cancel()

    def _end_turn(self, pcm: bytes) -> TurnListener | ServiceError:
        """The embedded recognizer's listener of the turn that ended, ``pcm`` its last audio."""
        self._hear(pcm)
        listener, self._listener = self._listener, None
        if listener is None:  # (released)
            return ServiceError("asr", "unavailable", "the session is closing")
        if isinstance(listener, TurnListener):
            self._ended_turns.add(listener)
        return listener

    async def _transcribe(self, request: Transcribe, heard: TurnListener | ServiceError | None) -> None:
        """``heard``: the embedded recognizer's listener of the turn (None: the transcription service hears it)."""
        assert self._responder is not None
        try:
            if isinstance(heard, ServiceError):
                raise heard
            if heard is not None:
                try:
                    transcript = await heard.transcript()
                finally:
                    self._ended_turns.discard(heard)
            else:
                assert self._responder.transcription is not None
                transcript = await self._responder.transcription.transcribe(request.pcm, ENGINE_RATE)
        except ServiceError as exc:
            self.core.transcription_failed(request.item_id, exc.code, exc.message)
        except Exception:
            log.exception("a realtime transcription failed")
            self.core.transcription_failed(request.item_id, "server_error", "the transcription failed in the server")
        else:
            self.core.transcribed(request.item_id, transcript, time.monotonic())

    def _vad_finished(self, future: Future[list[float]]) -> None:
        # On the executor's thread: hand the result to the loop, unless the loop is already gone (shutdown).
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._vad_done, future)

    def _vad_done(self, future: Future[list[float]]) -> None:
        try:
            probabilities = future.result()
        except Exception:
            log.exception("voice activity detection failed")
            self.core.scoring_failed()
            return
        try:
            self.core.speech_scored(probabilities, time.monotonic())
        except Exception:
            # The detector's state is unknown now: no turn could be trusted to end.
            log.exception("a realtime session could not take its speech scores")
            self.fail("server_error", "voice activity detection failed in the server")

    def _arm_timer(self, deadline: float | None) -> None:
        if deadline is not None and not self._released:
            self._timer = self._loop.call_later(max(0.0, deadline - time.monotonic()), self._on_timer)

    def _on_timer(self) -> None:
        try:
            deadline = self.core.expire(time.monotonic())
        except Exception:
            log.exception("a realtime session's deadline check failed")
            self.fail("server_error", "the session's deadlines failed in the server")
            return
        self._arm_timer(deadline)
