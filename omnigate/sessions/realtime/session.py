"""The OpenAI Realtime protocol for one session (sans-I/O): client events in, server events and audio out.

One instance per session, driven on one thread: client events (already decoded by the transport adapter), microphone
PCM, speech-probability scores, engine output and the passage of time go in; what goes out is queued in the
session's :class:`RealtimeOutbox` (encoded server events, track audio, last a :class:`Closing`) and, for work that
waits, handed to the adapter as a :data:`SessionRequest` (score this audio for speech). The engine side is a port
(:class:`EngineSide`) whose calls never block. No asyncio, no clock reads, no threads here: the adapter passes
``now`` where time matters and asks :meth:`RealtimeSession.expire` when the next deadline comes.

Rules kept here:
- Every server event has an ``event_id``; an error caused by a client event names that event's ``event_id``.
- A response emits ``response.created``, its output item and content part before any delta, and ends with exactly
  one ``response.done`` (status and full usage); nothing of a response follows its ``response.done``.
- Cancelling (``response.cancel``, ``output_audio_buffer.clear``, barge-in under ``interrupt_response``) stops the
  engine, purges the response's queued audio and then ends it: queued audio of an old response is never sent.
- ``conversation.item.truncate`` is checked against the audio actually handed to the transport
  (:meth:`RealtimeSession.take_output`).
- Input audio beyond the per-session cap is refused, not buffered; the outbox is bounded in media time and events.
  Under server VAD nothing is refused: the detector hears every append, and a turn that outgrows the cap is
  committed there (an ``input_turn_limit`` error says so) while detection goes on. A refused append is no activity.
- One scoring request is outstanding at a time; audio that arrives meanwhile waits (bounded by the input cap) and
  goes in the next request.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
from collections.abc import Callable
from typing import Literal, Protocol

import msgspec

from omnigate.engines.openai_compat.messages import ChatDelta, ChatFinish, ChatRequest, ToolCallDelta
from omnigate.engines.openai_compat.messages import TextDelta as ChatText
from omnigate.engines.vad import WINDOW_MS
from omnigate.sessions.realtime.answer import Answer, ResponderPolicy, history
from omnigate.sessions.realtime.audio import (
    ENGINE_RATE,
    InputConverter,
    InvalidAudio,
    OutputConverter,
    wire_bytes_per_ms,
)
from omnigate.sessions.realtime.capabilities import RealtimeCapabilities
from omnigate.sessions.realtime.client_events import (
    ClientEvent,
    ConversationItemCreate,
    ConversationItemDelete,
    ConversationItemRetrieve,
    ConversationItemTruncate,
    InputAudioBufferAppend,
    InputAudioBufferClear,
    InputAudioBufferCommit,
    ItemSpec,
    OutputAudioBufferClear,
    ResponseCancel,
    ResponseCreate,
    ResponseParams,
    SessionUpdate,
)
from omnigate.sessions.realtime.config import (
    ConfigRefused,
    RealtimeConfig,
    ResponseSettings,
    VoiceResolver,
    apply_update,
    default_config,
    response_settings,
    session_object,
    unused_fields,
)
from omnigate.sessions.realtime.conversation import (
    Conversation,
    ConversationError,
    IdSource,
    Item,
    ItemRole,
    Part,
    Response,
    ResponseStatus,
)
from omnigate.sessions.realtime.outbox import (
    Closing,
    OutboxOverflow,
    OutgoingAudio,
    OutgoingEvent,
    RealtimeOutbox,
    RealtimeOutput,
)
from omnigate.sessions.realtime.responder import (
    ResponderInputError,
    ToolCallAssembler,
    ToolCallError,
    TurnTiming,
    TurnTimings,
    chat_request,
)
from omnigate.sessions.realtime.server_events import (
    AudioDelta,
    AudioDone,
    ContentPartAdded,
    ContentPartDone,
    ErrorEvent,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    InputCleared,
    InputCommitted,
    ItemAdded,
    ItemDeleted,
    ItemDone,
    ItemRetrieved,
    ItemTruncated,
    OutputAudioCleared,
    OutputItemAdded,
    OutputItemDone,
    ResponseCreated,
    ResponseDone,
    ServerEvent,
    SessionCreated,
    SessionUpdated,
    SpeechStarted,
    SpeechStopped,
    TextDelta,
    TextDone,
    TranscriptDelta,
    TranscriptDone,
    TranscriptionCompleted,
    TranscriptionFailed,
    WireError,
    WirePart,
    WireSession,
    WireTranscriptionError,
    WireTranscriptionUsage,
    encode_event,
)
from omnigate.sessions.realtime.turn_audio import BYTES_PER_MS, TurnAudio
from omnigate.sessions.realtime.turns import SpeechStarted as TurnStarted
from omnigate.sessions.realtime.turns import TurnDetector
from omnigate.sessions.realtime.wire import wire_item, wire_response

log = logging.getLogger(__name__)

AudioRoute = Literal["events", "track"]

_ROLES: dict[str, ItemRole] = {"user": "user", "assistant": "assistant", "system": "system"}

CLOSE_CODES = {
    "client_closed": 1000,
    "idle_timeout": 4408,
    "max_duration": 1008,
    "backlog": 1008,
    "shutting_down": 1012,
}


class RealtimeLimits(msgspec.Struct, frozen=True):
    """Per-session bounds (settings; defaults from DESIGN §8)."""

    outbox_media_ms: float = 2000.0
    outbox_events: int = 512
    input_max_bytes: int = 1024 * 1024  # user audio (24 kHz s16le) held and not yet consumed
    append_max_bytes: int = 1024 * 1024  # decoded audio of one input_audio_buffer.append
    max_event_bytes: int = 128 * 1024  # any other client event, except session.update
    max_config_bytes: int = 4 * 1024 * 1024  # session.update
    max_text_chars: int = 4096  # text one response speaks
    idle_timeout_s: float = 30.0
    max_session_s: float = 3600.0
    max_items: int = 256
    truncate_tolerance_ms: float = 50.0


class UnreadableEvent(msgspec.Struct, frozen=True):
    """A client message the adapter could not decode into an event: the session answers it with a typed error."""

    code: str
    message: str
    event_id: str | None = None
    param: str | None = None


class ScoreSpeech(msgspec.Struct, frozen=True):
    """Score ``pcm`` (24 kHz s16le) for speech, window by window; answer with :meth:`RealtimeSession.speech_scored`
    (or :meth:`RealtimeSession.scoring_failed`)."""

    pcm: bytes


class Transcribe(msgspec.Struct, frozen=True):
    """Transcribe the audio of user item ``item_id``; answer with :meth:`RealtimeSession.transcribed` (or
    :meth:`RealtimeSession.transcription_failed`)."""

    item_id: str
    pcm: bytes  # 24 kHz mono s16le


class StartChat(msgspec.Struct, frozen=True):
    """Send ``request`` to the LLM, streamed, for response ``response_id``; hand each delta to
    :meth:`RealtimeSession.chat_delta` (or a failure to :meth:`RealtimeSession.chat_failed`). A session has one
    such request at a time: an earlier one of the session has ended, or been cancelled, before this one goes out."""

    response_id: str
    request: ChatRequest


class CancelChat(msgspec.Struct, frozen=True):
    """Stop the LLM request of ``response_id`` now (close its HTTP stream); nothing more of it is wanted."""

    response_id: str


class TurnMeasured(msgspec.Struct, frozen=True):
    """An answered turn's latencies, for the metrics."""

    timings: TurnTimings


class ServiceFailed(msgspec.Struct, frozen=True):
    """The LLM or the transcription service failed a turn with ``code``, for the metrics."""

    code: str


SessionRequest = ScoreSpeech | Transcribe | StartChat | CancelChat | TurnMeasured | ServiceFailed


class EngineSide(Protocol):
    """The engine behind a session, as the core drives it: every call returns at once (work runs elsewhere), and
    what the engine produces comes back through the session's ``response_*`` and ``finish_response`` calls."""

    @property
    def capabilities(self) -> RealtimeCapabilities: ...

    @property
    def sample_rate(self) -> int: ...

    def reconfigure(self, config: RealtimeConfig) -> None:
        """Apply voice, speed and instructions. Raises ConfigRefused."""

    def open_speech(self, response: Response, settings: ResponseSettings) -> None:
        """Begin speaking ``response`` (text-to-speech engines only); its text follows in pieces."""

    def add_speech(self, response: Response, text: str) -> None:
        """More text of ``response``: spoken as soon as a sentence or clause of it is complete."""

    def close_speech(self, response: Response) -> None:
        """The text of ``response`` is complete: speak the rest, then end it (``finish_response``)."""

    def cancel(self, response: Response) -> None:
        """Stop producing ``response`` now."""

    def push_audio(self, pcm: bytes) -> bool:
        """User audio; False when refused because the engine's input cap is reached."""

    def clear_input(self) -> None:
        """Drop user audio not yet consumed."""

    def released_audio(self, ms: float) -> None:
        """``ms`` of queued output audio left the outbox (sent or purged): room for more."""


def _nothing(request: SessionRequest) -> None:
    pass


class RealtimeSession:
    """One realtime session's protocol state: conversation, turns, the response in progress and the outbox."""

    def __init__(
        self,
        engine: EngineSide,
        *,
        limits: RealtimeLimits,
        model: str,
        served_models: frozenset[str],
        resolve_voice: VoiceResolver,
        now: float,
        audio_route: AudioRoute = "events",
        ids: IdSource | None = None,
        on_request: Callable[[SessionRequest], None] = _nothing,
        on_output: Callable[[], None] | None = None,
        responder: ResponderPolicy | None = None,
    ) -> None:
        self.engine = engine
        caps = engine.capabilities
        if caps.native_duplex:
            responder = None  # a duplex model answers by itself
        if responder is not None:
            caps = msgspec.structs.replace(
                caps, create_response=True, tools=True, input_transcription=responder.transcription
            )
        self.caps = caps
        self.responder = responder
        self.limits = limits
        self.audio_route = audio_route
        self.on_request = on_request
        self._served_models = served_models
        self._resolve_voice = resolve_voice
        self._ids = ids or IdSource()
        self.session_id = self._ids("sess")
        self.config: RealtimeConfig = default_config(self.caps, model)
        self.conversation = Conversation(
            self._ids, max_items=limits.max_items, truncate_tolerance_ms=limits.truncate_tolerance_ms
        )
        self.outbox = RealtimeOutbox(max_media_ms=limits.outbox_media_ms, max_events=limits.outbox_events)
        if on_output is not None:
            self.outbox.on_change = on_output
        self.closed = False
        self.started_at = now
        self.last_activity = now
        self._activity_before_event = now
        self._input = InputConverter(self.config.input_format)
        self._active: Response | None = None
        self._last_response_id: str | None = None
        self._converters: dict[str, OutputConverter] = {}
        self._audio_items: dict[str, Item] = {}
        self._previous: dict[str, str | None] = {}
        self._audio_sent = False
        self._logged_unused: set[str] = set()  # each unused field is logged once per session
        self._pending_input_bytes = 0
        self._user_item_id: str | None = None
        self._detector: TurnDetector | None = None
        self._vad_queue = bytearray()
        self._scoring = False
        self._turn_audio = TurnAudio(limits.input_max_bytes)
        self._answer: Answer | None = None
        self._transcribing: dict[str, tuple[Item, float]] = {}  # user items awaiting their transcript, audio seconds
        self._turn_timings: dict[str, TurnTiming] = {}  # of the items being transcribed
        self._next_timing: TurnTiming | None = None  # of the newest turn, for the response that answers it

    # ---- lifecycle ----------------------------------------------------------------------------------------------

    def open(self) -> None:
        """Announce the session (the adapter has bound the engine)."""
        self._configure_vad()
        self._emit(SessionCreated(event_id=self._event_id(), session=self._session()))

    @property
    def active(self) -> Response | None:
        """The response in progress."""
        return self._active

    @property
    def idle(self) -> bool:
        """No response in progress: closing the session now loses no work (a graceful drain asks)."""
        return self._active is None

    @property
    def next_deadline(self) -> float | None:
        """When :meth:`expire` should be called next (None: the session is over)."""
        if self.closed:
            return None
        return min(self.last_activity + self.limits.idle_timeout_s, self.started_at + self.limits.max_session_s)

    def expire(self, now: float) -> float | None:
        """End the session if its idle timeout or maximum duration has passed; returns the next deadline."""
        if self.closed:
            return None
        if now >= self.started_at + self.limits.max_session_s:
            self.fail("max_duration", "the session reached its maximum duration")
        elif now >= self.last_activity + self.limits.idle_timeout_s:
            self.fail("idle_timeout", f"no client event within {self.limits.idle_timeout_s:g} s")
        return self.next_deadline

    def take_output(self) -> RealtimeOutput | None:
        """The next output for the transport, or None. Audio taken counts as sent (truncation is checked against
        it) and its room goes back to the engine."""
        output = self.outbox.pop()
        if isinstance(output, (OutgoingEvent, OutgoingAudio)) and output.audio_ms:
            item = self._audio_items.get(output.item_id or "")
            if item is not None:
                item.sent_ms += output.audio_ms
            self.engine.released_audio(output.audio_ms)
        return output

    def disconnect(self) -> None:
        """The transport is gone: stop the engine's work at once; nothing more goes out."""
        if not self.closed:
            self.closed = True
            if self._active is not None:
                self.engine.cancel(self._active)
            self._stop_chat()

    def release(self) -> None:
        """Drop what the session holds (the adapter has freed the engine and ended its requests). Idempotent."""
        self.closed = True
        self._detector = None
        self._vad_queue.clear()
        self._converters.clear()
        self._turn_audio.restart()
        self._answer = None
        self._transcribing.clear()
        self._turn_timings.clear()

    def end(self, code: str, message: str) -> bool:
        """End the session from the server's side (a drain): a response in progress is cancelled, its
        ``response.done`` goes out, then the typed error and the close. False when the session is already ending."""
        if self.closed:
            return False
        self._cancel_active(None, purge_all=True)
        self.fail(code, message)
        return True

    def fail(self, code: str, message: str) -> None:
        """End the session with a fatal typed error, then close."""
        if self.closed:
            return
        if self._active is not None:
            self.engine.cancel(self._active)
        self._stop_chat()
        self.closed = True
        error = ErrorEvent(event_id=self._event_id(), error=WireError(type="server_error", code=code, message=message))
        closing = Closing(code, code, CLOSE_CODES.get(code, 1011))
        try:
            self.outbox.push(OutgoingEvent(encode_event(error)), terminal=True)
            self.outbox.push(closing, terminal=True)
        except OutboxOverflow:
            self.outbox.replace_all(closing)

    # ---- client input -------------------------------------------------------------------------------------------

    def receive(self, event: ClientEvent | UnreadableEvent, now: float) -> None:
        """Handle one client message; a bad one gets one typed error and the session goes on."""
        if self.closed:
            return
        self._activity_before_event = self.last_activity
        self.last_activity = now
        if isinstance(event, UnreadableEvent):
            self._error(event.code, event.message, event.event_id, param=event.param)
            return
        try:
            self._dispatch(event, now)
        except (ConfigRefused, ConversationError) as exc:
            self._error(exc.code, exc.message, event.event_id, param=exc.param)
        except InvalidAudio as exc:
            self._error("invalid_audio", str(exc), event.event_id, param="audio")

    def protocol_error(self, code: str, message: str) -> None:
        """A message the transport could not hand over as a client event (a binary WebSocket frame)."""
        if not self.closed:
            self._error(code, message, None)

    def receive_audio(self, pcm: bytes, now: float) -> None:
        """Microphone audio from a media track: 24 kHz mono s16le."""
        if not self.closed:
            self.last_activity = now
            self._ingest(pcm, None)

    def _dispatch(self, event: ClientEvent, now: float) -> None:
        if isinstance(event, InputAudioBufferAppend):
            self._on_append(event)
        elif isinstance(event, SessionUpdate):
            self._on_session_update(event)
        elif isinstance(event, ResponseCreate):
            self._on_response_create(event, now)
        elif isinstance(event, ResponseCancel):
            self._on_response_cancel(event)
        elif isinstance(event, ConversationItemCreate):
            self._on_item_create(event)
        elif isinstance(event, ConversationItemTruncate):
            cut = self.conversation.truncate(event.item_id, event.content_index, event.audio_end_ms)
            self._emit(
                ItemTruncated(
                    event_id=self._event_id(),
                    item_id=event.item_id,
                    content_index=event.content_index,
                    audio_end_ms=cut,
                )
            )
        elif isinstance(event, ConversationItemDelete):
            self.conversation.delete(event.item_id)
            self._emit(ItemDeleted(event_id=self._event_id(), item_id=event.item_id))
        elif isinstance(event, ConversationItemRetrieve):
            item = self.conversation.get(event.item_id)
            self._emit(ItemRetrieved(event_id=self._event_id(), item=wire_item(item)))
        elif isinstance(event, InputAudioBufferCommit):
            self._on_commit(event, now)
        elif isinstance(event, InputAudioBufferClear):
            self.engine.clear_input()
            self._pending_input_bytes = 0
            if self._detector is None:
                self._turn_audio.take_all()
            self._emit(InputCleared(event_id=self._event_id()))
        elif isinstance(event, OutputAudioBufferClear):
            self._on_output_clear()

    def _on_session_update(self, event: SessionUpdate) -> None:
        config = apply_update(
            self.config,
            event.session,
            self.caps,
            served_models=self._served_models,
            resolve_voice=self._resolve_voice,
            voice_locked=self._audio_sent,
        )
        speech = (config.voice, config.speed, config.instructions if self.caps.instructions else "")
        if speech != (self.config.voice, self.config.speed, self.config.instructions if self.caps.instructions else ""):
            if self._active is not None:
                raise ConfigRefused(
                    "response_in_progress", "voice, speed and instructions change only between responses", "session"
                )
            self.engine.reconfigure(config)
        if config.input_format != self.config.input_format:
            self._input = InputConverter(config.input_format)
        turn_changed = config.turn_detection != self.config.turn_detection
        self.config = config
        if turn_changed:
            self._configure_vad()
        unused = [name for name in unused_fields(config, self.caps) if name not in self._logged_unused]
        if unused:
            self._logged_unused.update(unused)
            log.info("session fields the %s engine does not use (kept and echoed): %s", self.caps.engine, unused)
        self._emit(SessionUpdated(event_id=self._event_id(), session=self._session()))

    def _on_append(self, event: InputAudioBufferAppend) -> None:
        try:
            data = base64.b64decode(event.audio, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidAudio("audio must be base64") from None
        if len(data) > self.limits.append_max_bytes:
            raise ConfigRefused("message_too_large", f"an append carries at most {self.limits.append_max_bytes} bytes")
        self._ingest(self._input.convert(data), event.event_id)

    def _ingest(self, pcm: bytes, event_id: str | None) -> None:
        if not pcm:
            return
        if self.caps.native_duplex:
            accepted = self.engine.push_audio(pcm)
        elif self._detector is not None:
            # The detector commits a turn before it outgrows the cap; until its scores catch up the count saturates
            # (a text-to-speech engine holds no user audio, only this count).
            accepted = True
            self._pending_input_bytes = min(self.limits.input_max_bytes, self._pending_input_bytes + len(pcm))
        else:
            accepted = self._pending_input_bytes + len(pcm) <= self.limits.input_max_bytes
            if accepted:
                self._pending_input_bytes += len(pcm)
        if not accepted:
            self.last_activity = self._activity_before_event  # a refused append does not keep the session alive
            self._error(
                "input_backpressure",
                f"more than {self.limits.input_max_bytes} bytes of input audio are pending; the append was refused",
                event_id,
            )
            return
        if self.responder is not None and self.responder.transcription and not self.caps.native_duplex:
            self._turn_audio.add(pcm)
        if self._detector is not None:
            self._vad_feed(pcm)

    def _on_commit(self, event: InputAudioBufferCommit, now: float) -> None:
        if not self.caps.client_commit:
            raise ConfigRefused(
                "unsupported", "the duplex model consumes audio as it arrives; there is no buffer to commit"
            )
        if self._pending_input_bytes == 0:
            raise ConfigRefused("input_audio_buffer_commit_empty", "the input audio buffer is empty")
        self._commit_turn(self._user_item_id or self._ids("item"), self._turn_audio.take_all(), now)

    def _commit_turn(self, item_id: str, pcm: bytes, now: float) -> None:
        self._pending_input_bytes = 0
        self._user_item_id = None
        item = Item(id=item_id, role="user", status="completed", content=[Part(type="input_audio")])
        previous = self.conversation.add(item)
        self._emit(InputCommitted(event_id=self._event_id(), item_id=item_id, previous_item_id=previous))
        self._emit(ItemAdded(event_id=self._event_id(), item=wire_item(item), previous_item_id=previous))
        self._emit(ItemDone(event_id=self._event_id(), item=wire_item(item), previous_item_id=previous))
        responder = self.responder
        if responder is None or not responder.transcription or not pcm:
            return  # without a transcript the LLM cannot hear an audio turn
        self._transcribe(item, pcm, now)
        td = self.config.turn_detection
        if td is not None and td.create_response and self._active is None and item.id in self._transcribing:
            self._answer_now(self._session_response_settings(), None, now)

    def _on_item_create(self, event: ConversationItemCreate) -> None:
        if not self.caps.speaks_text_items:
            raise ConfigRefused(
                "unsupported", "the duplex model takes audio only; it cannot read conversation items", "item"
            )
        item = self._client_item(event.item)
        previous = self.conversation.add(item, event.previous_item_id)
        self._emit(ItemAdded(event_id=self._event_id(), item=wire_item(item), previous_item_id=previous))
        self._emit(ItemDone(event_id=self._event_id(), item=wire_item(item), previous_item_id=previous))

    def _client_item(self, spec: ItemSpec) -> Item:
        if spec.type in ("function_call", "function_call_output") and self.responder is not None:
            return self._client_call_item(spec)
        if spec.type != "message":
            raise ConfigRefused("unsupported", f"item type {spec.type!r} is not served (no tools)", "item.type")
        allowed = {
            "user": ("input_text", "input_audio"),
            "system": ("input_text",),
            "assistant": ("output_text", "text"),
        }
        if spec.role is None or spec.role not in allowed:
            raise ConfigRefused("invalid_value", "item.role must be user, assistant or system", "item.role")
        parts: list[Part] = []
        for part in spec.content:
            if part.type not in allowed[spec.role]:
                raise ConfigRefused(
                    "unsupported", f"a {spec.role} item takes {list(allowed[spec.role])} content", "item.content"
                )
            if part.type == "input_audio":
                parts.append(Part(type="input_audio", transcript=part.transcript))
            else:
                kind = "output_text" if spec.role == "assistant" else "input_text"
                parts.append(Part(type=kind, text=part.text or ""))
        if sum(len(p.text or "") for p in parts) > self.limits.max_text_chars:
            raise ConfigRefused("input_too_large", f"an item holds at most {self.limits.max_text_chars} characters")
        if spec.id is not None and not 1 <= len(spec.id) <= 64:
            raise ConfigRefused("invalid_value", "item.id must be 1..64 characters", "item.id")
        return Item(id=spec.id or self._ids("item"), role=_ROLES[spec.role], status="completed", content=parts)

    def _client_call_item(self, spec: ItemSpec) -> Item:
        """A tool call's output the client adds (or a call it adds to the history itself)."""
        if not spec.call_id:
            raise ConfigRefused("invalid_value", f"a {spec.type} item names its call_id", "item.call_id")
        if spec.id is not None and not 1 <= len(spec.id) <= 64:
            raise ConfigRefused("invalid_value", "item.id must be 1..64 characters", "item.id")
        item_id = spec.id or self._ids("item")
        if spec.type == "function_call":
            if not spec.name:
                raise ConfigRefused("invalid_value", "a function_call item names its function", "item.name")
            return Item(
                id=item_id,
                role="assistant",
                status="completed",
                content=[],
                type="function_call",
                call_id=spec.call_id,
                name=spec.name,
                arguments=spec.arguments or "{}",
            )
        return Item(
            id=item_id,
            role="user",
            status="completed",
            content=[],
            type="function_call_output",
            call_id=spec.call_id,
            output=spec.output or "",
        )

    # ---- responses ----------------------------------------------------------------------------------------------

    def _on_response_create(self, event: ResponseCreate, now: float) -> None:
        if not self.caps.speaks_text_items:
            raise ConfigRefused(
                "unsupported", "the duplex model decides itself when to speak; response.create is not served"
            )
        if self._active is not None:
            raise ConfigRefused(
                "conversation_already_has_active_response", f"response {self._active.id} is still in progress"
            )
        settings = response_settings(self.config, event.response, self.caps, self._resolve_voice)
        inline = event.response.input if event.response is not None else None
        if self.responder is not None and inline is None:
            self._answer_now(settings, event.response, now)
            return
        spoken: list[Item] = []
        if inline is None:
            spoken = self.conversation.unspoken_assistant_text()
            text = " ".join(item.text().strip() for item in spoken)
        else:
            text = " ".join(self._inline_text(spec) for spec in inline)
        text = text.strip()
        if not text:
            raise ConfigRefused(
                "nothing_to_speak",
                "the engine speaks assistant text: create an assistant message item (or pass one as response.input)",
            )
        if len(text) > self.limits.max_text_chars:
            raise ConfigRefused("input_too_large", f"a response speaks at most {self.limits.max_text_chars} characters")
        for item in spoken:
            item.spoken = True
        response = self._begin_response(settings)
        response.input_text_tokens = len(text.split())
        self.engine.open_speech(response, settings)
        self.engine.add_speech(response, text)
        self.engine.close_speech(response)

    def _inline_text(self, spec: ItemSpec) -> str:
        if spec.type == "item_reference":
            return self.conversation.get(spec.id or "", "response.input").text().strip()
        if spec.type != "message" or spec.role != "assistant":
            raise ConfigRefused("unsupported", "response.input takes assistant messages to speak", "response.input")
        return "".join(part.text or "" for part in spec.content if part.type in ("output_text", "text")).strip()

    def open_model_response(self) -> Response | None:
        """A natively duplex model began to speak: open a response for it (None: no output wanted)."""
        if self.closed or self._active is not None:
            return None
        return self._begin_response(self._session_response_settings())

    def _session_response_settings(self) -> ResponseSettings:
        """A response the server starts itself runs with the session's settings."""
        config = self.config
        return ResponseSettings(
            output_modalities=config.output_modalities,
            voice=config.voice,
            output_format=config.output_format,
            max_output_tokens=config.max_output_tokens,
            in_conversation=True,
            metadata=None,
        )

    # ---- answering with the LLM ---------------------------------------------------------------------------------

    def _transcribe(self, item: Item, pcm: bytes, now: float) -> None:
        assert self.responder is not None
        if len(self._transcribing) >= self.responder.max_pending_transcriptions:
            message = f"more than {self.responder.max_pending_transcriptions} turns are waiting for transcription"
            self._transcription_error(item.id, "asr_backlog", message)
            return
        timing = TurnTiming(now)
        timing.mark("asr_sent", now)
        self._transcribing[item.id] = (item, len(pcm) / BYTES_PER_MS / 1000.0)
        self._turn_timings[item.id] = timing
        self._next_timing = timing
        self.on_request(Transcribe(item.id, pcm))

    def transcribed(self, item_id: str, transcript: str, now: float) -> None:
        """The answer to :class:`Transcribe`: the turn's words."""
        pending = self._transcribing.pop(item_id, None)
        timing = self._turn_timings.pop(item_id, None)
        if pending is None or self.closed:
            return
        item, seconds = pending
        if timing is not None:
            timing.mark("transcript_done", now)
        item.content[0].transcript = transcript
        self._emit(
            TranscriptionCompleted(
                event_id=self._event_id(),
                item_id=item_id,
                content_index=0,
                transcript=transcript,
                usage=WireTranscriptionUsage(seconds=round(seconds, 3)),
            )
        )
        answer = self._answer
        if answer is not None and answer.waiting and not self._transcribing:
            answer.waiting = False
            self._ask(answer, now)

    def transcription_failed(self, item_id: str, code: str, message: str) -> None:
        """:class:`Transcribe` failed (the service is down, slow or answered garbage): the turn has no words."""
        if self._transcribing.pop(item_id, None) is None or self.closed:
            return
        self._turn_timings.pop(item_id, None)
        self._transcription_error(item_id, code, message)
        answer = self._answer
        if answer is not None and answer.waiting:
            self._fail_answer(answer, code, message)

    def _transcription_error(self, item_id: str, code: str, message: str) -> None:
        self._emit(
            TranscriptionFailed(
                event_id=self._event_id(),
                item_id=item_id,
                content_index=0,
                error=WireTranscriptionError(type="server_error", code=code, message=message),
            )
        )
        self._error(code, message, None, error_type="server_error")
        self.on_request(ServiceFailed(code))

    def _answer_now(self, settings: ResponseSettings, params: ResponseParams | None, now: float) -> None:
        """Start a response the LLM writes; it asks once the transcripts of the user's turns are in."""
        config = self.config
        timing = self._next_timing or TurnTiming(now)
        self._next_timing = None
        response = self._begin_response(settings)
        answer = Answer(
            response=response,
            settings=settings,
            timing=timing,
            assembler=ToolCallAssembler(lambda: self._ids("call")),
            instructions=params.instructions if params and params.instructions is not None else config.instructions,
            tools=tuple(params.tools) if params and params.tools is not None else config.passthrough.tools,
            tool_choice=(
                params.tool_choice if params and params.tool_choice is not None else config.passthrough.tool_choice
            ),
            temperature=(
                params.temperature if params and params.temperature is not None else config.passthrough.temperature
            ),
        )
        self._answer = answer
        if self._transcribing:
            answer.waiting = True
        else:
            self._ask(answer, now)

    def _ask(self, answer: Answer, now: float) -> None:
        policy = self.responder
        assert policy is not None
        response = answer.response
        try:
            request = chat_request(
                instructions=answer.instructions,
                history=history(item for item in self.conversation if item.response_id != response.id),
                max_chars=policy.history_max_chars,
                max_tokens=policy.max_tokens,
                model=policy.model,
                tools=answer.tools,
                tool_choice=answer.tool_choice,
                max_output_tokens=response.max_output_tokens,
                temperature=answer.temperature,
            )
        except ResponderInputError as exc:
            self._fail_answer(answer, "invalid_tools", f"{exc} ({exc.param})")
            return
        # Until the LLM reports its usage, the request's words stand for its tokens.
        response.input_text_tokens = sum(len((message.content or "").split()) for message in request.messages)
        answer.timing.mark("llm_sent", now)
        answer.chatting = True
        self.on_request(StartChat(response.id, request))

    def chat_delta(self, response_id: str, delta: ChatDelta, now: float) -> None:
        """One piece of the LLM's streamed reply to :class:`StartChat`."""
        answer = self._answer
        if answer is None or answer.response.id != response_id or not answer.chatting or self.closed:
            return
        response = answer.response
        if isinstance(delta, ChatText):
            answer.timing.mark("first_token", now)
            if not delta.text:
                return
            if not answer.speaking:
                answer.speaking = True
                self.engine.open_speech(response, answer.settings)
            answer.note_text(delta.text, now)
            self.engine.add_speech(response, delta.text)
        elif isinstance(delta, ToolCallDelta):
            answer.timing.mark("first_token", now)
            self._tool_call_delta(answer, delta)
        elif isinstance(delta, ChatFinish):
            self._chat_finished(answer, delta)

    def _tool_call_delta(self, answer: Answer, delta: ToolCallDelta) -> None:
        response = answer.response
        try:
            call_id = answer.assembler.add(delta)
        except ToolCallError as exc:
            self._fail_answer(answer, "llm_bad_response", str(exc))
            return
        item = answer.calls.get(call_id)
        if item is None:
            item = Item(
                id=self._ids("item"),
                role="assistant",
                status="in_progress",
                content=[],
                response_id=response.id,
                type="function_call",
                call_id=call_id,
                name=delta.name or "",
            )
            answer.calls[call_id] = item
            response.outputs.append(item)
            self._emit(
                OutputItemAdded(
                    event_id=self._event_id(),
                    response_id=response.id,
                    output_index=len(response.outputs) - 1,
                    item=wire_item(item),
                )
            )
            if response.in_conversation:
                previous = self.conversation.add(item)
                self._previous[item.id] = previous
                self._emit(ItemAdded(event_id=self._event_id(), item=wire_item(item), previous_item_id=previous))
        if delta.arguments:
            item.arguments += delta.arguments
            self._emit(
                FunctionCallArgumentsDelta(
                    event_id=self._event_id(),
                    response_id=response.id,
                    item_id=item.id,
                    output_index=response.outputs.index(item),
                    call_id=call_id,
                    delta=delta.arguments,
                )
            )

    def _chat_finished(self, answer: Answer, finish: ChatFinish) -> None:
        response = answer.response
        try:
            calls = answer.assembler.complete()
        except ToolCallError as exc:
            self._fail_answer(answer, "llm_bad_response", str(exc))
            return
        answer.chatting = False
        if finish.usage is not None:
            response.input_text_tokens = finish.usage.prompt_tokens
            answer.completion_tokens = finish.usage.completion_tokens
        answer.cut_by_llm = finish.finish_reason == "length"
        for call in calls:
            item = answer.calls[call.id]
            item.name = call.function.name
            item.arguments = call.function.arguments
            item.status = "completed"
            index = response.outputs.index(item)
            self._emit(
                FunctionCallArgumentsDone(
                    event_id=self._event_id(),
                    response_id=response.id,
                    item_id=item.id,
                    output_index=index,
                    call_id=call.id,
                    name=item.name,
                    arguments=item.arguments,
                )
            )
            self._emit(
                OutputItemDone(
                    event_id=self._event_id(), response_id=response.id, output_index=index, item=wire_item(item)
                )
            )
            if response.in_conversation:
                previous = self._previous.pop(item.id, None)
                self._emit(ItemDone(event_id=self._event_id(), item=wire_item(item), previous_item_id=previous))
        if answer.speaking:
            self.engine.close_speech(response)  # the engine ends the response once the rest is spoken
        else:
            self.finish_response(response, "completed")

    def chat_failed(self, response_id: str, code: str, message: str) -> None:
        """:class:`StartChat` failed (unreachable, timed out, an error or garbage): the response fails, typed."""
        answer = self._answer
        if answer is not None and answer.response.id == response_id and answer.chatting and not self.closed:
            answer.chatting = False
            self._fail_answer(answer, code, message)

    def _fail_answer(self, answer: Answer, code: str, message: str) -> None:
        """A typed error, then the response ends failed with nothing of it left queued."""
        response = answer.response
        self._error(code, message, None, error_type="server_error")
        self.on_request(ServiceFailed(code))
        self.engine.cancel(response)
        dropped = self.outbox.purge_audio(response.id)
        if dropped:
            self.engine.released_audio(dropped)
        self.finish_response(response, "failed", error=(code, message))

    def _stop_chat(self) -> None:
        answer = self._answer
        if answer is not None and answer.chatting:
            answer.chatting = False
            self.on_request(CancelChat(answer.response.id))

    def _begin_response(self, settings: ResponseSettings) -> Response:
        response = Response(
            id=self._ids("resp"),
            in_conversation=settings.in_conversation,
            metadata=settings.metadata,
            output_modalities=settings.output_modalities,
            voice=settings.voice,
            output_format=settings.output_format,
            max_output_tokens=settings.max_output_tokens,
        )
        self._active = response
        self._last_response_id = response.id
        self._emit(ResponseCreated(event_id=self._event_id(), response=wire_response(response)))
        audio = "audio" in settings.output_modalities
        part = Part(type="output_audio", transcript="") if audio else Part(type="output_text", text="")
        item = Item(
            id=self._ids("item"), role="assistant", status="in_progress", content=[part], response_id=response.id
        )
        response.item = item
        response.outputs.append(item)
        self._emit(
            OutputItemAdded(event_id=self._event_id(), response_id=response.id, output_index=0, item=wire_item(item))
        )
        if response.in_conversation:
            previous = self.conversation.add(item)
            self._previous[item.id] = previous
            self._emit(ItemAdded(event_id=self._event_id(), item=wire_item(item), previous_item_id=previous))
        self._emit(
            ContentPartAdded(
                event_id=self._event_id(),
                response_id=response.id,
                item_id=item.id,
                output_index=0,
                content_index=0,
                part=WirePart(type="audio", transcript="") if audio else WirePart(type="text", text=""),
            )
        )
        if audio:
            rate_format = settings.output_format if self.audio_route == "events" else "audio/pcm"
            self._converters[response.id] = OutputConverter(rate_format, self.engine.sample_rate)
            self._audio_items[item.id] = item
            while len(self._audio_items) > self.limits.max_items:
                self._audio_items.pop(next(iter(self._audio_items)))
        return response

    def response_audio(self, response: Response, pcm: bytes, sample_rate: int, now: float | None = None) -> bool:
        """Audio of ``response``; False when nothing was queued (the response ended, or it sends text only).
        ``now`` times a reply's first audio."""
        converter = self._converters.get(response.id)
        if response.done or self.closed or converter is None:
            return False
        item = response.item
        assert item is not None
        ms = len(pcm) / 2 * 1000.0 / sample_rate
        item.audio_ms += ms
        response.output_audio_ms += ms
        answer = self._answer
        if now is not None and answer is not None and answer.response is response:
            answer.timing.mark("tts_first_audio", now)
            answer.timing.mark("first_audio_out", now)  # queued for the transport, which takes it in order
        self._queue_audio(response, item, converter.convert(pcm))
        return True

    def _queue_audio(self, response: Response, item: Item, data: bytes) -> None:
        if not data:
            return
        self._audio_sent = True
        if self.audio_route == "track":
            ms = len(data) / 2 * 1000.0 / ENGINE_RATE
            self._push(OutgoingAudio(data, ENGINE_RATE, response.id, item.id, ms))
            return
        ms = len(data) / wire_bytes_per_ms(response.output_format)
        delta = AudioDelta(
            event_id=self._event_id(),
            response_id=response.id,
            item_id=item.id,
            output_index=0,
            content_index=0,
            delta=base64.b64encode(data).decode("ascii"),
        )
        self._push(OutgoingEvent(encode_event(delta), response.id, item.id, ms))

    def response_text(self, response: Response, text: str, tokens: int) -> None:
        """Transcript (or text) of ``response``; ``tokens`` counts into its usage."""
        if response.done or self.closed:
            return
        response.output_text_tokens += tokens
        item = response.item
        if not text or item is None:
            return
        part = item.content[0]
        if part.type == "output_audio":
            item.marks.append((item.audio_ms, len(part.transcript or "")))
            part.transcript = (part.transcript or "") + text
            self._emit(
                TranscriptDelta(
                    event_id=self._event_id(),
                    response_id=response.id,
                    item_id=item.id,
                    output_index=0,
                    content_index=0,
                    delta=text,
                )
            )
        else:
            part.text = (part.text or "") + text
            self._emit(
                TextDelta(
                    event_id=self._event_id(),
                    response_id=response.id,
                    item_id=item.id,
                    output_index=0,
                    content_index=0,
                    delta=text,
                )
            )

    def response_input(self, response: Response, audio_ms: float) -> None:
        """User audio the engine consumed while producing ``response``."""
        if not response.done:
            response.input_audio_ms += audio_ms

    def finish_response(
        self,
        response: Response,
        status: ResponseStatus,
        reason: str | None = None,
        error: tuple[str, str] | None = None,
    ) -> None:
        """End ``response``; ignored when it already ended."""
        if response.done:
            return
        answer = self._answer
        if answer is not None and answer.response is response:
            self._answer = None
            status, reason = self._end_answer(answer, status, reason)
        response.status = status
        response.reason = reason
        response.error = error
        if self._active is response:
            self._active = None
        converter = self._converters.pop(response.id, None)
        item = response.item
        if item is None or self.closed:
            return
        item.status = "completed" if status == "completed" else "incomplete"
        if converter is not None and status == "completed":
            self._queue_audio(response, item, converter.finish())
        for event in self._closing_events(response, item):
            self._emit(event, terminal=True)

    def _end_answer(
        self, answer: Answer, status: ResponseStatus, reason: str | None
    ) -> tuple[ResponseStatus, str | None]:
        """What ending a response the LLM wrote adds: its request stops, its usage and timings are final."""
        response = answer.response
        if answer.chatting:
            answer.chatting = False
            self.on_request(CancelChat(response.id))
        if status == "completed" and answer.cut_by_llm:
            status, reason = "incomplete", "max_output_tokens"
        if answer.completion_tokens is not None:
            response.output_text_tokens = answer.completion_tokens
        timings = answer.timing.timings()
        response.metadata = {**(response.metadata or {}), **timings.metadata()}
        if status == "completed":
            self.on_request(TurnMeasured(timings))
        return status, reason

    def _closing_events(self, response: Response, item: Item) -> list[ServerEvent]:
        """The events that end a response, in protocol order, ``response.done`` last."""
        part = item.content[0]
        rid, iid = response.id, item.id
        events: list[ServerEvent] = []
        for index, call in enumerate(response.outputs):
            if call.type == "function_call" and call.status == "in_progress":
                # A call cut off with its response ends incomplete; the client does not run it.
                call.status = "incomplete"
                events.append(
                    OutputItemDone(event_id=self._event_id(), response_id=rid, output_index=index, item=wire_item(call))
                )
                if response.in_conversation:
                    previous = self._previous.pop(call.id, None)
                    events.append(ItemDone(event_id=self._event_id(), item=wire_item(call), previous_item_id=previous))
        if part.type == "output_audio":
            transcript = part.transcript or ""
            events.append(
                AudioDone(event_id=self._event_id(), response_id=rid, item_id=iid, output_index=0, content_index=0)
            )
            events.append(
                TranscriptDone(
                    event_id=self._event_id(),
                    response_id=rid,
                    item_id=iid,
                    output_index=0,
                    content_index=0,
                    transcript=transcript,
                )
            )
            wire_part = WirePart(type="audio", transcript=transcript)
        else:
            text = part.text or ""
            events.append(
                TextDone(
                    event_id=self._event_id(), response_id=rid, item_id=iid, output_index=0, content_index=0, text=text
                )
            )
            wire_part = WirePart(type="text", text=text)
        events.append(
            ContentPartDone(
                event_id=self._event_id(),
                response_id=rid,
                item_id=iid,
                output_index=0,
                content_index=0,
                part=wire_part,
            )
        )
        events.append(OutputItemDone(event_id=self._event_id(), response_id=rid, output_index=0, item=wire_item(item)))
        if response.in_conversation:
            previous = self._previous.pop(iid, None)
            events.append(ItemDone(event_id=self._event_id(), item=wire_item(item), previous_item_id=previous))
        events.append(ResponseDone(event_id=self._event_id(), response=wire_response(response)))
        return events

    def _on_response_cancel(self, event: ResponseCancel) -> None:
        active = self._active
        if active is None or (event.response_id is not None and event.response_id != active.id):
            raise ConfigRefused("response_cancel_not_active", "there is no response in progress to cancel")
        self._cancel_active("client_cancelled", purge_all=False)

    def _on_output_clear(self) -> None:
        response_id = self._active.id if self._active is not None else self._last_response_id
        self._cancel_active("client_cancelled", purge_all=True)
        if response_id is not None:
            self._emit(OutputAudioCleared(event_id=self._event_id(), response_id=response_id))

    def _cancel_active(self, reason: str | None, *, purge_all: bool) -> None:
        """The epoch fence: stop the engine, drop queued audio, then end the response."""
        active = self._active
        if active is not None:
            self.engine.cancel(active)
            self._stop_chat()
        dropped = self.outbox.purge_audio(None if purge_all else (active.id if active else ""))
        if dropped:
            self.engine.released_audio(dropped)
        if active is not None:
            answered = self._answer is not None and self._answer.response is active
            if answered and active.item is not None and active.in_conversation:
                # What the LLM is told it said next time is what the user was sent of it.
                with contextlib.suppress(ConversationError):
                    self.conversation.truncate(active.item.id, 0, int(active.item.sent_ms))
            self.finish_response(active, "cancelled", reason)

    # ---- server VAD -----------------------------------------------------------------------------------------------

    def _configure_vad(self) -> None:
        td = self.config.turn_detection
        if td is None:
            self._detector = None
            self._vad_queue.clear()
            return
        if self._detector is None:
            # A duplex engine consumes the audio as it comes; a turn-based session buffers up to the input cap.
            max_turn_ms = None if self.caps.native_duplex else self.limits.input_max_bytes / 2 * 1000.0 / ENGINE_RATE
            self._detector = TurnDetector(td.settings, WINDOW_MS, max_turn_ms)
            self._turn_audio.restart()
        else:
            self._detector.settings = td.settings

    def _vad_feed(self, pcm: bytes) -> None:
        self._vad_queue.extend(pcm)
        excess = len(self._vad_queue) - self.limits.input_max_bytes
        if excess > 0 and self._detector is not None:
            # Scoring fell a whole input cap behind: skip the oldest audio rather than hold it without bound.
            excess += excess % 2
            del self._vad_queue[:excess]
            self._detector.skip(excess / 2 * 1000.0 / ENGINE_RATE)
        if not self._scoring:
            self._request_scoring()

    def _request_scoring(self) -> None:
        if self._detector is None or not self._vad_queue:
            return
        chunk = bytes(self._vad_queue)
        self._vad_queue.clear()
        self._scoring = True
        self.on_request(ScoreSpeech(chunk))

    def scoring_failed(self) -> None:
        """A :class:`ScoreSpeech` request produced no scores (the adapter logged why): go on with later audio."""
        self._scoring = False
        if not self.closed:
            self._request_scoring()

    def speech_scored(self, probabilities: list[float], now: float) -> None:
        """The answer to the outstanding :class:`ScoreSpeech`: one speech probability per window."""
        self._scoring = False
        if self.closed:
            return
        for probability in probabilities:
            detector = self._detector
            if detector is None:
                break
            turn = detector.feed(probability)
            if isinstance(turn, TurnStarted):
                self._on_speech_started(turn.audio_start_ms)
            elif turn is not None:
                self._on_speech_stopped(turn.audio_end_ms, now, forced=turn.forced)
        if self._detector is not None and not self._detector.speaking and not self.caps.native_duplex:
            # Outside a turn the buffer holds only the prefix padding a turn would start with.
            padding_ms = self._detector.settings.prefix_padding_ms
            self._pending_input_bytes = min(self._pending_input_bytes, padding_ms * ENGINE_RATE * 2 // 1000)
            self._turn_audio.keep_from(self._detector.position_ms - padding_ms)
        self._request_scoring()

    def _on_speech_started(self, audio_start_ms: int) -> None:
        self._turn_audio.keep_from(audio_start_ms)
        self._user_item_id = self._ids("item")
        self._emit(SpeechStarted(event_id=self._event_id(), audio_start_ms=audio_start_ms, item_id=self._user_item_id))
        td = self.config.turn_detection
        if td is not None and td.interrupt_response:
            # Barge-in: the user talks over the assistant, so nothing queued for playback should play.
            self._cancel_active("turn_detected", purge_all=True)

    def _on_speech_stopped(self, audio_end_ms: int, now: float, *, forced: bool = False) -> None:
        if forced:
            limit_s = self.limits.input_max_bytes / 2 / ENGINE_RATE
            self._error(
                "input_turn_limit",
                f"the speech went on for {limit_s:.1f} s without a pause: the turn is committed there and the next"
                " one starts",
                None,
                error_type="server_error",
            )
        item_id = self._user_item_id or self._ids("item")
        self._emit(SpeechStopped(event_id=self._event_id(), audio_end_ms=audio_end_ms, item_id=item_id))
        self._commit_turn(item_id, self._turn_audio.take_until(audio_end_ms), now)

    # ---- output -------------------------------------------------------------------------------------------------

    def report_error(self, code: str, message: str) -> None:
        """A non-fatal engine-side error not tied to a response."""
        self._error(code, message, None, error_type="server_error")

    def _session(self) -> WireSession:
        return session_object(self.config, self.session_id, self.caps)

    def _event_id(self) -> str:
        return self._ids("event")

    def _error(
        self,
        code: str,
        message: str,
        event_id: str | None,
        *,
        param: str | None = None,
        error_type: str = "invalid_request_error",
    ) -> None:
        error = WireError(type=error_type, code=code, message=message, param=param, event_id=event_id)
        self._emit(ErrorEvent(event_id=self._event_id(), error=error))

    def _emit(self, event: ServerEvent, *, terminal: bool = False) -> None:
        self._push(OutgoingEvent(encode_event(event)), terminal=terminal)

    def _push(self, output: RealtimeOutput, *, terminal: bool = False) -> None:
        if self.closed and not isinstance(output, Closing):
            return
        try:
            self.outbox.push(output, terminal=terminal)
        except OutboxOverflow:
            self.fail("backlog", "too many unsent events: the client is not reading")
