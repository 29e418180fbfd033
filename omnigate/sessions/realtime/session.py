"""The OpenAI Realtime protocol for one session (sans-I/O): client events in, server events and audio out.

One instance per session, driven on one thread: client events (already decoded by the transport adapter), microphone
PCM, speech-probability scores, engine output and the passage of time go in; what goes out is queued in the
session's :class:`RealtimeOutbox` (encoded server events, track audio, last a :class:`Closing`) and, for work that
waits, handed to the adapter as a :data:`SessionRequest` (score this audio for speech, transcribe this turn, ask the
LLM, stop asking; :mod:`.requests`), whose answers come back as calls. The engine side is a port
(:class:`EngineSide`) whose calls never block. No asyncio, no clock reads, no threads here: the adapter passes
``now`` where time matters and asks :meth:`RealtimeSession.expire` when the next deadline comes. With a responder
policy the session answers the user with an LLM (:mod:`.answer`); without one it speaks the text clients send.

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
  goes in the next request. One LLM request per session: a response's request stops when the response ends.
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Callable
from typing import Literal, Protocol

import msgspec

from omnigate.engines.base import speakable
from omnigate.engines.openai_compat.messages import ChatDelta
from omnigate.engines.vad import WINDOW_MS
from omnigate.sessions.realtime.answer import Answering, ResponderPolicy
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
    server_response_settings,
    session_object,
    unused_fields,
)
from omnigate.sessions.realtime.conversation import (
    Conversation,
    ConversationError,
    IdSource,
    Item,
    Part,
    Response,
    ResponseStatus,
)
from omnigate.sessions.realtime.items import client_item
from omnigate.sessions.realtime.outbox import (
    Closing,
    OutboxOverflow,
    OutgoingAudio,
    OutgoingEvent,
    RealtimeOutbox,
    RealtimeOutput,
)
from omnigate.sessions.realtime.requests import ForgetAudio, HearAudio, ScoreSpeech, SessionRequest
from omnigate.sessions.realtime.response_events import closing_events
from omnigate.sessions.realtime.server_events import (
    AudioDelta,
    ContentPartAdded,
    ErrorEvent,
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
    ServerEvent,
    SessionCreated,
    SessionUpdated,
    SpeechStarted,
    SpeechStopped,
    TextDelta,
    TranscriptDelta,
    WireError,
    WirePart,
    WireSession,
    encode_event,
)
from omnigate.sessions.realtime.turn_audio import TurnAudio
from omnigate.sessions.realtime.turns import SpeechStarted as TurnStarted
from omnigate.sessions.realtime.turns import TurnDetector
from omnigate.sessions.realtime.wire import wire_item, wire_response

log = logging.getLogger(__name__)

AudioRoute = Literal["events", "track"]


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

    def turn_audio(self, item_id: str, pcm: bytes) -> None:
        """The user's committed turn ``item_id`` as audio (engines that answer the conversation themselves): with
        :attr:`hears_turns`, only its audio not already given to :meth:`hear_turn_audio`."""

    @property
    def hears_turns(self) -> bool:
        """Whether the engine (one that answers) encodes the turn in progress as it comes."""

    def hear_turn_audio(self, pcm: bytes) -> None:
        """More of the turn in progress, in order, from its start (:attr:`hears_turns`)."""

    def forget_turn_audio(self) -> None:
        """The turn being heard is no turn."""

    def answer(self, response: Response, settings: ResponseSettings, conversation: list[Item]) -> None:
        """Answer ``conversation`` as ``response`` (engines that answer the conversation themselves)."""


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
        if caps.native_duplex or caps.answers_turns:
            responder = None  # the model answers by itself
        if responder is not None:
            # The LLM writes the reply, so a response may also be text alone.
            caps = msgspec.structs.replace(
                caps,
                create_response=True,
                tools=True,
                temperature=True,
                input_transcription=responder.transcription,
                output_modalities=("audio", "text"),
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
        # a streaming recognizer, or an engine that answers and encodes ahead, hears each turn as it comes; this
        # much of the turn in progress went to it
        self._engine_hears = caps.answers_turns and engine.hears_turns
        recognizer_hears = responder is not None and responder.transcription and responder.streaming_transcription
        self._streaming = recognizer_hears or self._engine_hears
        self._heard_bytes = 0
        self.answering = Answering(self, responder, on_request) if responder is not None else None

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
            if self._active is not None or len(self.outbox):
                # A client listening to a long answer sends nothing: the idle clock covers the gaps between
                # answers, so while one is generated or still goes out it starts again.
                self.last_activity = now
            else:
                self.fail("idle_timeout", f"no client event within {self.limits.idle_timeout_s:g} s")
        return self.next_deadline

    def take_output(self, now: float | None = None) -> RealtimeOutput | None:
        """The next output for the transport, or None. Audio taken counts as sent (truncation is checked against
        it) and its room goes back to the engine; ``now`` times a reply's first audio out."""
        output = self.outbox.pop()
        if isinstance(output, (OutgoingEvent, OutgoingAudio)) and output.audio_ms:
            item = self._audio_items.get(output.item_id or "")
            if item is not None:
                item.sent_ms += output.audio_ms
            self.engine.released_audio(output.audio_ms)
            if now is not None and self.answering is not None and output.response_id is not None:
                self.answering.audio_sent(output.response_id, now)
        return output

    def disconnect(self) -> None:
        """The transport is gone: stop the engine's work at once; nothing more goes out."""
        if not self.closed:
            self.closed = True
            if self._active is not None:
                self.engine.cancel(self._active)
            if self.answering is not None:
                self.answering.stop()

    def release(self) -> None:
        """Drop what the session holds (the adapter has freed the engine and ended its requests). Idempotent."""
        self.closed = True
        self._detector = None
        self._vad_queue.clear()
        self._converters.clear()
        self._turn_audio.restart()
        if self.answering is not None:
            self.answering.release()

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
        if self.answering is not None:
            self.answering.stop()
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
            self._turn_audio.take_all()
            self._forget_heard()
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
            unknown=event.unknown_fields,
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
        keeps_turns = self.caps.answers_turns or (self.responder is not None and self.responder.transcription)
        if keeps_turns and not self.caps.native_duplex:
            self._turn_audio.add(pcm)
            if self._streaming and self._detector is None:
                self._hear(self._turn_audio.take_all())  # without a detector all audio is the turn's
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
        heard, self._heard_bytes = self._heard_bytes, 0
        self._pending_input_bytes = 0
        self._user_item_id = None
        item = Item(id=item_id, role="user", status="completed", content=[Part(type="input_audio")])
        previous = self.conversation.add(item)
        self._emit(InputCommitted(event_id=self._event_id(), item_id=item_id, previous_item_id=previous))
        self._emit(ItemAdded(event_id=self._event_id(), item=wire_item(item), previous_item_id=previous))
        self._emit(ItemDone(event_id=self._event_id(), item=wire_item(item), previous_item_id=previous))
        if self.answering is not None:
            self.answering.turn_committed(item, pcm, now, heard)
        if self.caps.answers_turns:
            self.engine.turn_audio(item_id, pcm)

    def _on_item_create(self, event: ConversationItemCreate) -> None:
        if not self.caps.speaks_text_items:
            raise ConfigRefused(
                "unsupported", "the duplex model takes audio only; it cannot read conversation items", "item"
            )
        item = client_item(
            event.item, self._ids, max_text_chars=self.limits.max_text_chars, calls=self.answering is not None
        )
        previous = self.conversation.add(item, event.previous_item_id)
        self._emit(ItemAdded(event_id=self._event_id(), item=wire_item(item), previous_item_id=previous))
        self._emit(ItemDone(event_id=self._event_id(), item=wire_item(item), previous_item_id=previous))

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
        if self.caps.answers_turns:
            if inline is not None:
                raise ConfigRefused(
                    "unsupported", "the model answers the conversation itself: response.input is not served",
                    "response.input",
                )  # fmt: skip
            self._answer(settings)
            return
        if self.answering is not None and inline is None:
            self.answering.answer_now(settings, event.response, now)
            return
        spoken: list[Item] = []
        if inline is None:
            spoken = self.conversation.unspoken_assistant_text()
            text = " ".join(item.text().strip() for item in spoken)
        else:
            text = " ".join(self._inline_text(spec) for spec in inline)
        text = text.strip()
        if not speakable(text):
            raise ConfigRefused(
                "nothing_to_speak",
                "the engine speaks assistant text with a letter or digit: create an assistant message item (or pass "
                "one as response.input)",
            )
        if len(text) > self.limits.max_text_chars:
            raise ConfigRefused("input_too_large", f"a response speaks at most {self.limits.max_text_chars} characters")
        for item in spoken:
            item.spoken = True
        response = self.begin_response(settings)
        response.input_text_tokens = len(text.split())
        self.engine.open_speech(response, settings)
        self.engine.add_speech(response, text)
        self.engine.close_speech(response)

    def _answer(self, settings: ResponseSettings) -> None:
        """The engine answers the conversation (the response's own item is in it, still empty)."""
        response = self.begin_response(settings)
        self.engine.answer(response, settings, list(self.conversation))

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
        return self.begin_response(server_response_settings(self.config))

    # ---- answering with the LLM: the adapter's answers to the requests, and what answering uses ---------------

    def transcribed(self, item_id: str, transcript: str, now: float) -> None:
        """The answer to :class:`Transcribe`: the turn's words."""
        if self.answering is not None and not self.closed:
            self.answering.transcribed(item_id, transcript, now)

    def transcription_failed(self, item_id: str, code: str, message: str) -> None:
        """:class:`Transcribe` failed (the service is down, slow or answered garbage): the turn has no words."""
        if self.answering is not None and not self.closed:
            self.answering.transcription_failed(item_id, code, message)

    def chat_delta(self, response_id: str, delta: ChatDelta, now: float) -> None:
        """One piece of the LLM's streamed reply to :class:`StartChat`."""
        if self.answering is not None and not self.closed:
            self.answering.chat_delta(response_id, delta, now)

    def chat_failed(self, response_id: str, code: str, message: str) -> None:
        """:class:`StartChat` failed (unreachable, timed out, an error or garbage): the response fails, typed."""
        if self.answering is not None and not self.closed:
            self.answering.chat_failed(response_id, code, message)

    def new_id(self, prefix: str) -> str:
        return self._ids(prefix)

    def emit(self, event: ServerEvent) -> None:
        self._emit(event)

    def server_error(self, code: str, message: str) -> None:
        self._error(code, message, None, error_type="server_error")

    def open_speech(self, response: Response, settings: ResponseSettings) -> None:
        self.engine.open_speech(response, settings)

    def add_speech(self, response: Response, text: str) -> None:
        self.engine.add_speech(response, text)

    def close_speech(self, response: Response) -> None:
        self.engine.close_speech(response)

    def fail_response(self, response: Response, code: str, message: str) -> None:
        """Stop the engine, drop what is queued of ``response``, then end it failed."""
        self.engine.cancel(response)
        dropped = self.outbox.purge_audio(response.id)
        if dropped:
            self.engine.released_audio(dropped)
        self.finish_response(response, "failed", error=(code, message))

    def add_output_item(self, response: Response, item: Item) -> int:
        """Add ``item`` to ``response``'s output and, for a response in the conversation, to the conversation."""
        response.outputs.append(item)
        index = len(response.outputs) - 1
        self._emit(
            OutputItemAdded(
                event_id=self._event_id(), response_id=response.id, output_index=index, item=wire_item(item)
            )
        )
        if response.in_conversation:
            previous = self.conversation.add(item)
            self._previous[item.id] = previous
            self._emit(ItemAdded(event_id=self._event_id(), item=wire_item(item), previous_item_id=previous))
        return index

    def output_item_done(self, response: Response, item: Item) -> None:
        self._emit(
            OutputItemDone(
                event_id=self._event_id(),
                response_id=response.id,
                output_index=response.outputs.index(item),
                item=wire_item(item),
            )
        )
        if response.in_conversation:
            previous = self._previous.pop(item.id, None)
            self._emit(ItemDone(event_id=self._event_id(), item=wire_item(item), previous_item_id=previous))

    def begin_response(self, settings: ResponseSettings) -> Response:
        """Start a response: ``response.created``, its message item and content part."""
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
        self.add_output_item(response, item)
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

    def response_audio(
        self,
        response: Response,
        pcm: bytes,
        sample_rate: int,
        now: float | None = None,
        engine_ms: float | None = None,
    ) -> bool:
        """Audio of ``response``; False when nothing was queued (the response ended, or it sends text only).
        ``now`` times a reply's first audio; ``engine_ms``, on the first audio of the engine's utterance, is the
        engine's own time from the utterance's text to it."""
        converter = self._converters.get(response.id)
        if response.done or self.closed or converter is None:
            return False
        item = response.item
        assert item is not None
        ms = len(pcm) / 2 * 1000.0 / sample_rate
        item.audio_ms += ms
        response.output_audio_ms += ms
        if now is not None and self.answering is not None:
            self.answering.audio_made(response, now, engine_ms)
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
        if self.answering is not None:
            status, reason = self.answering.ending(response, status, reason)
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
        for event in closing_events(response, item, self._event_id, self._previous):
            self._emit(event, terminal=True)

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
            if self.answering is not None:
                self.answering.cancelling(active)
        dropped = self.outbox.purge_audio(None if purge_all else (active.id if active else ""))
        if dropped:
            self.engine.released_audio(dropped)
        if active is not None:
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
            self._forget_heard()
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
        elif self._streaming and self._detector is not None:
            # The turn so far, up to the audio scored: what follows may be the pause that ends it.
            self._hear(self._turn_audio.take_until(self._detector.position_ms))
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
        td = self.config.turn_detection
        if self.caps.answers_turns and td is not None and td.create_response and self._active is None:
            self._answer(server_response_settings(self.config))

    def _hear(self, pcm: bytes) -> None:
        if pcm:
            self._heard_bytes += len(pcm)
            if self._engine_hears:
                self.engine.hear_turn_audio(pcm)
            else:
                self.on_request(HearAudio(pcm))

    def _forget_heard(self) -> None:
        if self._heard_bytes:
            self._heard_bytes = 0
            if self._engine_hears:
                self.engine.forget_turn_audio()
            else:
                self.on_request(ForgetAudio())

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
