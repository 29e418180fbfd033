"""The video-chat session state machine (sans-I/O): frames and microphone audio in, questions answered as text and
speech.

Camera frames arrive decoded (the transport decodes them off the event loop) into a bounded ring; a frame too like
the last one kept is skipped when the frame filter is on. Microphone audio accumulates in a bounded buffer and, with
``use_audio_in_video``, is the spoken part of the next question. A query samples ``num_frames`` frames evenly from
the ring and starts the thinker; its text streams to the client and, with the audio modality, into the session's
speech stream, whose audio comes back through :meth:`VideoChatSession.on_speech`. A ``voiced`` engine (Qwen3-Omni)
speaks its answer itself: its audio comes with its text, and the query's audio ends with its answer.

Rules kept here:
- Inputs are bounded and refused typed (``input_backpressure``), never silently dropped: a frame while too many are
  still decoding, audio beyond the buffer. The ring itself keeps the newest ``max_frames`` (that is its purpose).
- A new query cancels the one in flight, or the one still waiting for frames to decode. Queries are fenced by id:
  nothing of an old query is emitted after its terminal event, and every query that was started gets exactly one
  terminal event: ``response.audio.done`` with the audio modality, ``response.text.done`` without it (with a
  ``status``).
- The history is the newest turns that fit a token budget, whole turns only, the oldest forgotten first.
- ``video.done`` lets the query in flight finish, then ends the session with ``session.done``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal, Protocol

import msgspec

from omnigate.engines.omni.request import AudioDelta, FrameInput, TextDelta, ThinkDone, ThinkOutput
from omnigate.sessions.messages import ErrorEvent, MediaChunk, SessionClosed, UtteranceDone

Modality = Literal["text", "audio"]
QueryStatus = Literal["completed", "cancelled", "error", "max_tokens", "max_context"]
AudioFormat = Literal["wav", "pcm"]

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant watching a live camera feed. Answer briefly and conversationally."


class VideoChatConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Validated ``session.config`` of a video-chat session."""

    model: str | None = None
    modalities: tuple[Modality, ...] = ("text", "audio")
    num_frames: int = 4
    max_frames: int = 50
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    use_audio_in_video: bool = True
    enable_frame_filter: bool = True
    frame_filter_threshold: float = 0.95
    audio_format: AudioFormat = "wav"
    voice: str | None = None
    history_budget_tokens: int = 1024
    max_new_tokens: int = 256
    temperature: float = 0.7

    @property
    def speaks(self) -> bool:
        return "audio" in self.modalities


class VideoChatLimits(msgspec.Struct, frozen=True):
    max_audio_bytes: int = 4 * 1024 * 1024  # microphone audio held for the next question (s16le 16 kHz: ~131 s)
    max_decoding_frames: int = 8  # frames received and not yet decoded
    max_question_chars: int = 4096
    max_history_tokens: int = 8192  # the most a client may ask ``history_budget_tokens`` to be
    max_new_tokens: int = 1024


class PromptFormat(Protocol):
    """How the thinker's prompt is written and counted (its tokenizer)."""

    def count(self, text: str) -> int: ...

    def chat_prefix(self, system: str) -> str: ...

    def turn(self, role: str, text: str) -> str: ...


@dataclass(frozen=True)
class DecodedFrame:
    """A camera frame after decoding: the model's pixels, its digest and a small grey thumbnail for the filter."""

    frame: FrameInput
    thumbnail: bytes  # 64x64 uint8 grey


# ---- events (transport-neutral; the adapter writes them as the wire's JSON) --------------------------------------


class ResponseStart(msgspec.Struct, frozen=True, tag="response.start"):
    query: int
    frames: int


class ResponseTextDelta(msgspec.Struct, frozen=True, tag="response.text.delta"):
    query: int
    delta: str


class ResponseTextDone(msgspec.Struct, frozen=True, tag="response.text.done"):
    query: int
    text: str
    status: QueryStatus


class ResponseAudioDelta(msgspec.Struct, frozen=True, tag="response.audio.delta"):
    query: int
    pcm: bytes
    sample_rate: int


class ResponseAudioDone(msgspec.Struct, frozen=True, tag="response.audio.done"):
    query: int
    status: QueryStatus


class ChatError(msgspec.Struct, frozen=True, tag="error"):
    code: str
    message: str
    param: str | None = None
    fatal: bool = False


class SessionDone(msgspec.Struct, frozen=True, tag="session.done"):
    reason: str


class Pong(msgspec.Struct, frozen=True, tag="pong"):
    """The answer to a client's ``ping``."""


ChatEvent = (
    ResponseStart
    | ResponseTextDelta
    | ResponseTextDone
    | ResponseAudioDelta
    | ResponseAudioDone
    | ChatError
    | SessionDone
    | Pong
)


# ---- actions -------------------------------------------------------------------------------------------------------


class Emit(msgspec.Struct, frozen=True):
    event: ChatEvent


class StartThink(msgspec.Struct, frozen=True):
    query: int
    context: str
    question: str
    frames: tuple[FrameInput, ...]
    audio: bytes
    max_new_tokens: int
    temperature: float


class CancelThink(msgspec.Struct, frozen=True):
    query: int


class SpeakText(msgspec.Struct, frozen=True):
    text: str


class FinishSpeech(msgspec.Struct, frozen=True):
    """The answer's text is complete: speak what is buffered and end the utterance."""


class CancelSpeech(msgspec.Struct, frozen=True):
    """Abort the speech in progress and drop its queued audio."""


class CloseSession(msgspec.Struct, frozen=True):
    reason: str


Action = Emit | StartThink | CancelThink | SpeakText | FinishSpeech | CancelSpeech | CloseSession


class ConfigRefused(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def frame_similarity(a: bytes, b: bytes) -> float:
    """1 minus the mean absolute difference of two equal-size grey thumbnails, scaled to 0..1."""
    if len(a) != len(b) or not a:
        return 0.0
    total = sum(abs(x - y) for x, y in zip(a, b, strict=True))
    return 1.0 - total / (255.0 * len(a))


def sample_evenly(count: int, wanted: int) -> list[int]:
    """``wanted`` indices spread evenly over ``range(count)``, always including the newest."""
    if count <= wanted:
        return list(range(count))
    if wanted == 1:
        return [count - 1]
    return [round(i * (count - 1) / (wanted - 1)) for i in range(wanted)]


@dataclass(eq=False)
class _Query:
    id: int
    question: str
    speaks: bool
    text_done: bool = False
    speech_started: bool = False  # an utterance exists in the speech stream for it
    speech_ended: bool = False  # its utterance ended (refused or failed) while the text still streams
    answer: list[str] = field(default_factory=list)


class VideoChatSession:
    """State machine of one video-chat session."""

    def __init__(self, prompt: PromptFormat, limits: VideoChatLimits | None = None, *, voiced: bool = False) -> None:
        self.prompt = prompt
        self.limits = limits if limits is not None else VideoChatLimits()
        self.voiced = voiced  # the thinker's engine speaks its answers: no speech stream
        self.config: VideoChatConfig | None = None
        self.ring: deque[DecodedFrame] = deque(maxlen=VideoChatConfig().max_frames)
        self.audio = bytearray()
        self.decoding = 0
        self.history: list[tuple[str, str]] = []
        self.closing = False
        self.closed = False
        self.frames_received = 0
        self.frames_filtered = 0
        self._query: _Query | None = None  # the query in flight
        self._speaking: dict[int, int] = {}  # speech utterance index -> query id
        self._failed: set[int] = set()  # queries whose speech is cancelled because their answer failed
        self._utterances = 0
        self._next_query = 0
        self._waiting: tuple[str, bytes | None] | None = None  # a query held until the frames before it decode

    @property
    def latest_query(self) -> int:
        """The id of the newest query started (-1 before the first): older ones are cancelled or done."""
        return self._next_query - 1

    @property
    def answering(self) -> bool:
        return self._query is not None or bool(self._speaking) or self._waiting is not None

    # ---- client inputs -------------------------------------------------------------------------------------------

    def configure(self, config: VideoChatConfig) -> list[Action]:
        try:
            self._validate(config)
        except ConfigRefused as exc:
            return [Emit(ChatError("invalid_config", exc.message, exc.param))]
        if self.answering and self.config is not None and config.modalities != self.config.modalities:
            return [Emit(ChatError("config_while_busy", "modalities cannot change while a query is answered"))]
        self.config = config
        self.ring = deque(self.ring, maxlen=config.max_frames)
        return []

    def _validate(self, c: VideoChatConfig) -> None:
        if not c.modalities or any(m not in ("text", "audio") for m in c.modalities) or "text" not in c.modalities:
            raise ConfigRefused('modalities must be ["text"] or ["text", "audio"]', "modalities")
        if not 1 <= c.num_frames <= 128:
            raise ConfigRefused("num_frames must be within 1..128", "num_frames")
        if not 1 <= c.max_frames <= 256:
            raise ConfigRefused("max_frames must be within 1..256", "max_frames")
        if c.num_frames > c.max_frames:
            raise ConfigRefused("num_frames cannot exceed max_frames", "num_frames")
        if not 0.0 <= c.frame_filter_threshold <= 1.0:
            raise ConfigRefused("frame_filter_threshold must be within 0..1", "frame_filter_threshold")
        if not 0 <= c.history_budget_tokens <= self.limits.max_history_tokens:
            raise ConfigRefused(
                f"history_budget_tokens must be within 0..{self.limits.max_history_tokens}", "history_budget_tokens"
            )
        if not 1 <= c.max_new_tokens <= self.limits.max_new_tokens:
            raise ConfigRefused(f"max_new_tokens must be within 1..{self.limits.max_new_tokens}", "max_new_tokens")
        if not 0.0 <= c.temperature <= 2.0:
            raise ConfigRefused("temperature must be within 0..2", "temperature")
        if len(c.system_prompt) > self.limits.max_question_chars:
            raise ConfigRefused(f"system_prompt exceeds {self.limits.max_question_chars} characters", "system_prompt")

    def frame_arrived(self, server_full: bool = False) -> tuple[bool, list[Action]]:
        """A frame was received: may it be decoded? Refused typed while too many of this session's are decoding, or
        while the server holds as many frames to decode as it takes (``server_full``)."""
        if self.closed or self.closing:
            return False, []
        if self.decoding >= self.limits.max_decoding_frames:
            message = f"{self.decoding} frames are still being decoded; frame dropped, send frames more slowly"
            return False, [Emit(ChatError("input_backpressure", message, "video.frame"))]
        if server_full:
            message = "the server is decoding as many frames as it holds; frame dropped, send frames more slowly"
            return False, [Emit(ChatError("input_backpressure", message, "video.frame"))]
        self.decoding += 1
        return True, []

    def on_frame(self, frame: DecodedFrame) -> list[Action]:
        """A frame finished decoding (in arrival order)."""
        self.decoding = max(0, self.decoding - 1)
        if self.closed:
            return []
        actions = self._add_frame(frame)
        return actions + self._release_waiting()

    def _release_waiting(self) -> list[Action]:
        if self.decoding or self._waiting is None:
            return []
        text, audio = self._waiting
        self._waiting = None
        return self.query(text, audio)

    def _add_frame(self, frame: DecodedFrame) -> list[Action]:
        self.frames_received += 1
        config = self.config or VideoChatConfig()
        similar = bool(self.ring) and (
            frame_similarity(self.ring[-1].thumbnail, frame.thumbnail) >= config.frame_filter_threshold
        )
        if config.enable_frame_filter and similar:
            self.frames_filtered += 1
            return []
        self.ring.append(frame)
        return []

    def on_frame_failed(self, code: str, message: str) -> list[Action]:
        """A frame was refused by its decoder (``invalid_frame``, ``input_too_large``); the session goes on."""
        self.decoding = max(0, self.decoding - 1)
        if self.closed:
            return []
        return [Emit(ChatError(code, message, "video.frame")), *self._release_waiting()]

    def on_audio(self, pcm: bytes) -> list[Action]:
        if self.closed or self.closing:
            return []
        if len(pcm) % 2:
            return [Emit(ChatError("invalid_audio", "audio.chunk must hold whole 16-bit samples", "audio.chunk"))]
        if len(self.audio) + len(pcm) > self.limits.max_audio_bytes:
            message = (
                f"the audio buffer holds {len(self.audio)} of {self.limits.max_audio_bytes} bytes; chunk refused "
                "(send video.query to use it, or less audio)"
            )
            return [Emit(ChatError("input_backpressure", message, "audio.chunk"))]
        self.audio += pcm
        return []

    def query(self, text: str, audio: bytes | None = None) -> list[Action]:
        if self.closed or self.closing:
            return [Emit(ChatError("session_closing", "the session is closing"))]
        config = self.config or VideoChatConfig()
        if len(text) > self.limits.max_question_chars:
            message = f"the question exceeds {self.limits.max_question_chars} characters"
            return [Emit(ChatError("input_too_large", message, "text"))]
        if audio is not None and len(audio) % 2:
            return [Emit(ChatError("invalid_audio", "audio_data must hold whole 16-bit samples", "audio_data"))]
        if self.decoding:
            # The answer sees every frame sent before the question: wait for those still decoding (a bounded few).
            # A question already waiting is replaced, and cancelled as one in flight would be.
            actions = self._cancel_waiting()
            self._waiting = (text, audio)
            return actions
        question_audio = audio if audio is not None else (bytes(self.audio) if config.use_audio_in_video else b"")
        self.audio.clear()
        if not text.strip() and not question_audio:
            return [Emit(ChatError("empty_query", "video.query needs text or audio", "text"))]
        actions = self._cancel_in_flight()
        query = _Query(self._next_query, text, config.speaks)
        self._next_query += 1
        self._query = query
        frames = tuple(self.ring[i].frame for i in sample_evenly(len(self.ring), config.num_frames))
        actions.append(Emit(ResponseStart(query.id, len(frames))))
        actions.append(
            StartThink(
                query.id,
                self._context(config),
                text,
                frames,
                question_audio,
                config.max_new_tokens,
                config.temperature,
            )
        )
        return actions

    def done(self) -> list[Action]:
        """``video.done``: finish the query in flight, then end."""
        if self.closed:
            return []
        self.closing = True
        return self._maybe_close()

    # ---- engine inputs -------------------------------------------------------------------------------------------

    def on_think(self, query_id: int, outputs: list[ThinkOutput]) -> list[Action]:
        query = self._query
        if self.closed or query is None or query.id != query_id or query.text_done:
            return []  # the fence: a cancelled query's late text
        actions: list[Action] = []
        for out in outputs:
            if isinstance(out, TextDelta):
                query.answer.append(out.text)
                actions.append(Emit(ResponseTextDelta(query.id, out.text)))
                if query.speaks and not self.voiced:
                    actions.extend(self._speak(query, out.text))
            elif isinstance(out, AudioDelta):
                if query.speaks:
                    actions.append(Emit(ResponseAudioDelta(query.id, out.pcm, out.sample_rate)))
            elif isinstance(out, ThinkDone):
                status: QueryStatus = "completed" if out.reason == "completed" else out.reason
                if out.reason == "error":
                    code = out.code or "generation_failed"
                    actions.append(Emit(ChatError(code, out.error or "the answer failed")))
                actions.extend(self._text_done(query, status))
                break
        return actions

    def on_think_refused(self, query_id: int, code: str, message: str) -> list[Action]:
        query = self._query
        if query is None or query.id != query_id:
            return []
        return [Emit(ChatError(code, message)), *self._text_done(query, "error", speak=False)]

    def on_speech(self, event: object) -> list[Action]:
        """An event of the session's speech stream (the speech driver's outbox)."""
        if self.closed:
            return []
        if isinstance(event, MediaChunk):
            owner = self._speaking.get(event.utterance)
            if owner is None:
                return []
            return [Emit(ResponseAudioDelta(owner, event.pcm, event.sample_rate))]
        if isinstance(event, UtteranceDone):
            owner = self._speaking.pop(event.utterance, None)
            if owner is None:
                return []
            status: QueryStatus = "error" if event.status == "error" else event.status  # type: ignore[assignment]
            if event.status in ("max_duration", "silence"):
                status = "completed"
            if owner in self._failed:
                self._failed.discard(owner)
                status = "error"
            if self._query is not None and self._query.id == owner:
                # The rest of its text must not open another utterance (each would be refused or fail again).
                self._query.speech_ended = True
            actions: list[Action] = [Emit(ResponseAudioDone(owner, status))]
            actions.extend(self._maybe_close())
            return actions
        if isinstance(event, ErrorEvent):
            return [Emit(ChatError(event.code, event.message))]
        if isinstance(event, SessionClosed):
            return self.fail(event.code or "speech_closed", f"the speech stream ended: {event.reason}")
        return []

    def fail(self, code: str, message: str) -> list[Action]:
        """End the session with a fatal typed error; every open query gets its terminal first."""
        if self.closed:
            return []
        actions = self._cancel_waiting()
        actions.extend(self._cancel_in_flight())
        actions.extend(Emit(ResponseAudioDone(q, "cancelled")) for q in self._speaking.values())
        self._speaking.clear()
        actions.append(Emit(ChatError(code, message, fatal=True)))
        self.closed = True
        actions.append(CloseSession(code))
        return actions

    def abort(self, reason: str) -> list[Action]:
        """The transport is gone or the server stops: cancel engine work, no more events matter."""
        if self.closed:
            return []
        self._waiting = None
        actions = self._cancel_in_flight()
        self._speaking.clear()
        self.closed = True
        actions.append(CloseSession(reason))
        return actions

    # ---- internals -----------------------------------------------------------------------------------------------

    def _speak(self, query: _Query, text: str) -> list[Action]:
        if query.speech_ended:
            return []
        if not query.speech_started:
            query.speech_started = True
            self._speaking[self._utterances] = query.id
            self._utterances += 1
        return [SpeakText(text)]

    def _text_done(self, query: _Query, status: QueryStatus, *, speak: bool = True) -> list[Action]:
        query.text_done = True
        self._query = None
        self._remember(query)
        actions: list[Action] = [Emit(ResponseTextDone(query.id, "".join(query.answer), status))]
        if query.speaks and self.voiced:  # the voice ended with the answer
            actions.append(Emit(ResponseAudioDone(query.id, status)))
        elif query.speaks and not query.speech_ended:
            if speak and status != "cancelled" and status != "error":
                if not query.speech_started:  # an empty answer: the utterance still ends, silent
                    self._speaking[self._utterances] = query.id
                    self._utterances += 1
                    query.speech_started = True
                actions.append(FinishSpeech())
            elif query.speech_started:
                if status == "error":
                    self._failed.add(query.id)
                actions.append(CancelSpeech())
            else:
                actions.append(Emit(ResponseAudioDone(query.id, status)))
        actions.extend(self._maybe_close())
        return actions

    def _cancel_waiting(self) -> list[Action]:
        """The question waiting for frames gets its id and its terminal events, ``cancelled``, having seen none."""
        if self._waiting is None:
            return []
        self._waiting = None
        query = self._next_query
        self._next_query += 1
        actions: list[Action] = [Emit(ResponseStart(query, 0)), Emit(ResponseTextDone(query, "", "cancelled"))]
        if (self.config or VideoChatConfig()).speaks:
            actions.append(Emit(ResponseAudioDone(query, "cancelled")))
        return actions

    def _cancel_in_flight(self) -> list[Action]:
        actions: list[Action] = []
        query = self._query
        if query is not None:
            actions.append(CancelThink(query.id))
            query.text_done = True
            self._query = None
            self._remember(query)
            actions.append(Emit(ResponseTextDone(query.id, "".join(query.answer), "cancelled")))
            if query.speaks and not query.speech_started:
                actions.append(Emit(ResponseAudioDone(query.id, "cancelled")))
        if self._speaking:
            # The speech stream ends every utterance it holds with a terminal that on_speech maps to its query.
            actions.append(CancelSpeech())
        return actions

    def _remember(self, query: _Query) -> None:
        answer = "".join(query.answer).strip()
        question = query.question.strip() or "(spoken question)"
        self.history.append(("user", question))
        if answer:
            self.history.append(("assistant", answer))
        budget = (self.config or VideoChatConfig()).history_budget_tokens
        costs = [self.prompt.count(self.prompt.turn(role, text)) for role, text in self.history]
        kept, total = 0, 0
        for cost in reversed(costs):
            if total + cost > budget:
                break
            total += cost
            kept += 1
        self.history = self.history[len(self.history) - kept :] if kept else []
        if self.history and self.history[0][0] == "assistant":  # never an answer without its question
            self.history.pop(0)

    def _context(self, config: VideoChatConfig) -> str:
        turns = "".join(self.prompt.turn(role, text) for role, text in self.history)
        return self.prompt.chat_prefix(config.system_prompt) + turns

    def _maybe_close(self) -> list[Action]:
        if self.closing and not self.answering and not self.closed:
            self.closed = True
            return [Emit(SessionDone("client_done")), CloseSession("client_done")]
        return []
