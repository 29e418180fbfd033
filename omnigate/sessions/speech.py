"""The speech session state machine (sans-I/O).

One instance per client session, driven by a single writer: commands from the client, outputs from the engine and
the passage of time go in; actions come out (engine calls to make, events to emit). No asyncio, no clock reads, no
transport and no model code here, so every rule below is tested with plain function calls.

Rules kept here:
- Utterances are the flush unit. Text is segmented as it arrives and a unit goes to the engine as soon as the
  segmenter releases it, before the flush. Utterances run one at a time in order; later ones queue (bounded).
- Every utterance that was begun gets exactly one terminal :class:`UtteranceDone`, whether it completes, is
  cancelled, fails or the session closes.
- Cancel bumps the epoch, aborts engine work, purges queued media of the old epoch and ends every pending utterance.
  Nothing of an old epoch is emitted after its terminal event.
- Config is validated before any engine work, is sticky, and cannot change while text is buffered.
- Text without a letter or digit never reaches the engine; an utterance of nothing else is refused typed
  (``nothing_to_speak``), while one without any text (an ``input.done`` alone) completes empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from omnigate.engines.base import (
    AudioChunk,
    EngineError,
    EngineInfo,
    EngineOutput,
    StreamDone,
    SynthesisParams,
    speakable,
    validate_params,
)
from omnigate.engines.base import SegmentDone as EngineSegmentDone
from omnigate.engines.base import SegmentStarted as EngineSegmentStarted
from omnigate.sessions.messages import (
    AppendText,
    Cancel,
    Close,
    Command,
    Configure,
    ErrorEvent,
    Event,
    Flush,
    MediaChunk,
    SegmentDone,
    SegmentStarted,
    SessionClosed,
    SessionConfig,
    UtteranceDone,
    UtteranceStatus,
)
from omnigate.sessions.segmenter import SegmenterOverflow, TextSegmenter


class SessionLimits(msgspec.Struct, frozen=True):
    """Per-session bounds (all settings; defaults from DESIGN §8)."""

    outbox_media_ms: float = 2000.0
    outbox_bytes: int = 2 * 1024 * 1024
    idle_timeout_ms: float = 30_000.0
    max_session_ms: float = 3_600_000.0
    max_queued_utterances: int = 8
    # text of one utterance (its input.text events up to input.done), and text accepted but not yet spoken across
    # the session's utterances; None: unbounded (a transport that bounds text itself)
    max_utterance_chars: int | None = None
    max_pending_chars: int | None = None


# ---- actions -----------------------------------------------------------------------------------------------------


class OpenStream(msgspec.Struct, frozen=True):
    utterance: int
    params: SynthesisParams


class PushText(msgspec.Struct, frozen=True):
    utterance: int
    text: str


class EndInput(msgspec.Struct, frozen=True):
    utterance: int


class AbortStream(msgspec.Struct, frozen=True):
    utterance: int


class Emit(msgspec.Struct, frozen=True):
    event: Event


class PurgeMedia(msgspec.Struct, frozen=True):
    """Drop queued media of this epoch and earlier from the outbox."""

    epoch: int


Action = OpenStream | PushText | EndInput | AbortStream | Emit | PurgeMedia


class ConfigError(ValueError):
    """A config the engine cannot honour; ``code`` is the wire error code."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def synthesis_params(info: EngineInfo, config: SessionConfig) -> SynthesisParams:
    """Check ``config`` against what the engine serves and build its engine parameters. Raises ConfigError."""
    language = config.language
    if language is not None and language.lower() == "auto":
        language = None
    params = SynthesisParams(
        voice=config.voice or info.default_voice,
        speed=config.speed,
        language=language,
        instructions=config.instructions,
        max_audio_ms=config.max_audio_ms,
    )
    try:
        validate_params(info, params)
    except EngineError as exc:
        raise ConfigError(exc.code, exc.message, exc.param) from None
    return params


@dataclass(eq=False)
class _Utterance:
    index: int
    epoch: int
    params: SynthesisParams
    units: list[str] = field(default_factory=list)
    flushed: bool = False
    opened: bool = False
    input_ended: bool = False
    chars: int = 0
    segments: int = 0
    open_segment: int | None = None
    segment_bytes: int = 0


class SpeechSession:
    """State machine of one speech session."""

    def __init__(self, info: EngineInfo, limits: SessionLimits, now_ms: float) -> None:
        self.info = info
        self.limits = limits
        self.config: SessionConfig | None = None
        self.params: SynthesisParams | None = None
        self.epoch = 0
        self.closed = False
        self.closing = False
        self._segmenter: TextSegmenter | None = None
        self._queue: list[_Utterance] = []  # head is the active one (engine stream open when it has work)
        self._collecting: _Utterance | None = None
        self._next_utterance = 0
        self._seq = 0
        self._started_ms = now_ms
        self._last_activity_ms = now_ms

    # ---- queries ----------------------------------------------------------------------------------------------

    @property
    def active_utterance(self) -> int | None:
        head = self._queue[0] if self._queue else None
        return head.index if head is not None and head.opened else None

    @property
    def busy(self) -> bool:
        """True while the client waits on us: a flushed utterance is queued or generating."""
        return any(u.flushed for u in self._queue)

    @property
    def pending_utterances(self) -> int:
        return len(self._queue)

    @property
    def collecting_utterance(self) -> int | None:
        """The utterance that appended text goes to; None: the next append begins a new utterance."""
        return self._collecting.index if self._collecting is not None else None

    @property
    def next_utterance(self) -> int:
        """The index the next utterance to begin will have (indices only grow)."""
        return self._next_utterance

    def next_deadline_ms(self) -> float | None:
        if self.closed:
            return None
        deadlines = [self._started_ms + self.limits.max_session_ms]
        if not self.busy:
            deadlines.append(self._last_activity_ms + self.limits.idle_timeout_ms)
        if self._segmenter is not None:
            seg = self._segmenter.next_deadline_ms()
            if seg is not None:
                deadlines.append(seg)
        return min(deadlines)

    # ---- inputs -----------------------------------------------------------------------------------------------

    def handle(self, command: Command, now_ms: float) -> list[Action]:
        if self.closed:
            return []
        self._last_activity_ms = now_ms
        if isinstance(command, Configure):
            return self._configure(command.config)
        if isinstance(command, AppendText):
            return self._append(command.text, now_ms)
        if isinstance(command, Flush):
            return self._flush()
        if isinstance(command, Cancel):
            return self._cancel()
        if isinstance(command, Close):
            return self._close_gracefully()
        raise TypeError(f"unknown command {command!r}")

    def on_engine(self, utterance: int, outputs: list[EngineOutput], now_ms: float) -> list[Action]:
        """Outputs of the engine stream of ``utterance``; outputs of a stream no longer active are dropped."""
        head = self._queue[0] if self._queue else None
        if self.closed or head is None or head.index != utterance or not head.opened:
            return []
        actions: list[Action] = []
        for out in outputs:
            if isinstance(out, AudioChunk):
                seg = head.open_segment if head.open_segment is not None else out.segment_index
                head.segment_bytes += len(out.pcm)
                actions.append(Emit(MediaChunk(head.epoch, head.index, seg, self._seq, out.pcm, out.sample_rate)))
                self._seq += 1
            elif isinstance(out, EngineSegmentStarted):
                head.open_segment = out.index
                head.segment_bytes = 0
                head.segments += 1
                actions.append(Emit(SegmentStarted(head.epoch, head.index, out.index, out.text, self.info.sample_rate)))
            elif isinstance(out, EngineSegmentDone):
                actions.append(Emit(SegmentDone(head.epoch, head.index, out.index, head.segment_bytes, out.reason)))
                head.open_segment = None
            elif isinstance(out, StreamDone):
                self._last_activity_ms = now_ms
                if out.reason == "error":
                    code = out.code or "generation_failed"
                    actions.append(Emit(ErrorEvent(code, out.error or "generation failed", fatal=False)))
                actions.extend(self._finish_head(out.reason, out.error))
                break
        return actions

    def on_stream_refused(self, utterance: int, code: str, message: str) -> list[Action]:
        """The pool refused to open the stream (no free slot, shutting down)."""
        head = self._queue[0] if self._queue else None
        if head is None or head.index != utterance:
            return []
        head.opened = False
        actions: list[Action] = [Emit(ErrorEvent(code, message, fatal=False))]
        actions.extend(self._finish_head("error", message, aborted=True))
        return actions

    def poll(self, now_ms: float) -> list[Action]:
        """Time passed: forced segmenter flushes, idle and duration limits."""
        if self.closed:
            return []
        if now_ms >= self._started_ms + self.limits.max_session_ms:
            return self._fail_session("max_duration", "the session reached its maximum duration")
        if not self.busy and now_ms >= self._last_activity_ms + self.limits.idle_timeout_ms:
            return self._fail_session("idle_timeout", "no input within the idle timeout")
        actions: list[Action] = []
        if self._segmenter is not None:
            for unit in self._segmenter.poll(now_ms):
                actions.extend(self._route_unit(unit))
        return actions

    def abort_all(self, reason: str, code: str | None = None) -> list[Action]:
        """The transport is gone or the server is stopping: abort everything, end every utterance, close."""
        if self.closed:
            return []
        actions = self._end_all("cancelled", None)
        self.closed = True
        actions.append(Emit(SessionClosed(reason, code)))
        return actions

    # ---- command handlers -------------------------------------------------------------------------------------

    def _configure(self, config: SessionConfig) -> list[Action]:
        if self._queue or (self._segmenter is not None and self._segmenter.buffered.strip()):
            # The output format of queued utterances must not change under them, and buffered text is never
            # silently dropped: the client finishes (session.done) or cancels first.
            return [
                Emit(
                    ErrorEvent(
                        "config_while_busy",
                        "session.config is refused while text is buffered or an utterance is in progress; "
                        "wait for session.done or send input.cancel first",
                    )
                )
            ]
        try:
            params = synthesis_params(self.info, config)
        except ConfigError as exc:
            return [Emit(ErrorEvent(exc.code, exc.message))]
        self.config = config
        self.params = params
        self._segmenter = TextSegmenter(config.segmenter)
        return []

    def _append(self, text: str, now_ms: float) -> list[Action]:
        if self._segmenter is None:
            return [Emit(ErrorEvent("no_config", "send session.config before input.text"))]
        if self.closing:
            return [Emit(ErrorEvent("session_closing", "the session is closing"))]
        if self._collecting is None and len(self._queue) >= self.limits.max_queued_utterances:
            return [
                Emit(
                    ErrorEvent(
                        "too_many_utterances",
                        f"more than {self.limits.max_queued_utterances} utterances are queued; wait for session.done",
                    )
                )
            ]
        refusal = self._refuse_text(len(text))
        if refusal is not None:
            return [Emit(refusal)]
        try:
            units = self._segmenter.push(text, now_ms)
        except SegmenterOverflow as exc:
            return [Emit(ErrorEvent("input_too_large", str(exc)))]
        self._ensure_collecting()
        assert self._collecting is not None
        self._collecting.chars += len(text)
        actions: list[Action] = []
        for unit in units:
            actions.extend(self._route_unit(unit))
        return actions

    def _refuse_text(self, chars: int) -> ErrorEvent | None:
        """The error for text that would take an utterance or the session over its bound (the text is dropped
        whole, nothing else changes: the client may flush what it sent, or cancel), else None."""
        limits = self.limits
        utterance = self._collecting.chars if self._collecting is not None else 0
        if limits.max_utterance_chars is not None and utterance + chars > limits.max_utterance_chars:
            return ErrorEvent(
                "utterance_too_long",
                f"this input.text would make the utterance {utterance + chars} characters long; the limit is "
                f"{limits.max_utterance_chars}: send input.done to speak what was sent, then go on in a new utterance",
                param="text",
            )
        pending = sum(u.chars for u in self._queue)
        if limits.max_pending_chars is not None and pending + chars > limits.max_pending_chars:
            return ErrorEvent(
                "too_much_pending_text",
                f"{pending} characters are waiting to be spoken and this input.text adds {chars}; the limit is "
                f"{limits.max_pending_chars}: wait for session.done",
                param="text",
            )
        return None

    def _flush(self) -> list[Action]:
        if self._segmenter is None:
            return [Emit(ErrorEvent("no_config", "send session.config before input.done"))]
        if self._collecting is None and len(self._queue) >= self.limits.max_queued_utterances:
            return [Emit(ErrorEvent("too_many_utterances", "too many utterances are queued"))]
        self._ensure_collecting()
        actions: list[Action] = []
        for unit in self._segmenter.flush():
            actions.extend(self._route_unit(unit))
        utt = self._collecting
        assert utt is not None
        utt.flushed = True
        self._collecting = None
        actions.extend(self._advance())
        return actions

    def _cancel(self) -> list[Action]:
        if self._segmenter is not None:
            self._segmenter.clear()
        return self._end_all("cancelled", None)

    def _close_gracefully(self) -> list[Action]:
        self.closing = True
        actions: list[Action] = []
        if self._segmenter is not None:
            self._segmenter.clear()
        # Unflushed text that has not reached the engine is dropped with its utterance; an utterance already
        # speaking is finished, like every flushed one.
        utt = self._collecting
        self._collecting = None
        if utt is not None and not utt.opened:
            self._queue.remove(utt)
            actions.append(Emit(UtteranceDone(utt.epoch, utt.index, 0, "cancelled")))
        elif utt is not None:
            utt.flushed = True
        actions.extend(self._advance())
        return actions

    # ---- internals --------------------------------------------------------------------------------------------

    def _ensure_collecting(self) -> None:
        if self._collecting is None:
            assert self.params is not None
            utt = _Utterance(index=self._next_utterance, epoch=self.epoch, params=self.params)
            self._next_utterance += 1
            self._collecting = utt
            self._queue.append(utt)

    def _route_unit(self, unit: str) -> list[Action]:
        if self._collecting is None:
            self._ensure_collecting()
        utt = self._collecting
        assert utt is not None
        if not speakable(unit):
            # Punctuation alone ("...", released by the segmenter's timer or the flush) makes no sound: the engine
            # is not opened for it, and an utterance of nothing else is refused when it comes to be spoken.
            return []
        if utt.opened:
            return [PushText(utt.index, unit)]
        utt.units.append(unit)
        return self._advance()

    def _advance(self) -> list[Action]:
        """Start the head utterance if it can start, end its input once flushed, complete empty flushed ones."""
        actions: list[Action] = []
        while self._queue:
            head = self._queue[0]
            if not head.opened:
                if head.units:
                    head.opened = True
                    actions.append(OpenStream(head.index, head.params))
                    actions.extend(PushText(head.index, u) for u in head.units)
                    head.units.clear()
                elif head.flushed:
                    self._queue.pop(0)
                    actions.extend(self._end_unspoken(head))
                    continue
                else:
                    break
            if head.flushed and not head.input_ended:
                head.input_ended = True
                actions.append(EndInput(head.index))
            break
        actions.extend(self._maybe_close())
        return actions

    def _end_unspoken(self, utt: _Utterance) -> list[Action]:
        """The terminal events of a flushed utterance that gave the engine nothing: completed when it had no text
        (an input.done alone), refused with ``nothing_to_speak`` when its text had no letter or digit."""
        if not utt.chars:
            return [Emit(UtteranceDone(utt.epoch, utt.index, 0, "completed"))]
        message = "the utterance's text has nothing to speak (no letter or digit)"
        return [
            Emit(ErrorEvent("nothing_to_speak", message, param="text")),
            Emit(UtteranceDone(utt.epoch, utt.index, 0, "error", message)),
        ]

    def _finish_head(self, status: UtteranceStatus, error: str | None, aborted: bool = False) -> list[Action]:
        head = self._queue.pop(0)
        if self._collecting is head:
            self._collecting = None
            if self._segmenter is not None:
                self._segmenter.clear()
        actions: list[Action] = []
        if head.open_segment is not None:
            actions.append(Emit(SegmentDone(head.epoch, head.index, head.open_segment, head.segment_bytes, status)))
        actions.append(Emit(UtteranceDone(head.epoch, head.index, head.segments, status, error)))
        actions.extend(self._advance())
        return actions

    def _end_all(self, status: UtteranceStatus, error: str | None) -> list[Action]:
        old_epoch = self.epoch
        self.epoch += 1
        actions: list[Action] = []
        if self._queue and self._queue[0].opened:
            actions.append(AbortStream(self._queue[0].index))
        actions.append(PurgeMedia(old_epoch))
        for utt in self._queue:
            if utt.open_segment is not None:
                actions.append(Emit(SegmentDone(utt.epoch, utt.index, utt.open_segment, utt.segment_bytes, status)))
            actions.append(Emit(UtteranceDone(utt.epoch, utt.index, utt.segments, status, error)))
        self._queue.clear()
        self._collecting = None
        actions.extend(self._maybe_close())
        return actions

    def fail(self, code: str, message: str) -> list[Action]:
        """End the session with a fatal typed error (for example no config within the config timeout)."""
        if self.closed:
            return []
        return self._fail_session(code, message)

    def _fail_session(self, code: str, message: str) -> list[Action]:
        actions = self._end_all("cancelled", None)
        actions.append(Emit(ErrorEvent(code, message, fatal=True)))
        self.closed = True
        actions.append(Emit(SessionClosed(code, code)))
        return actions

    def _maybe_close(self) -> list[Action]:
        if self.closing and not self._queue and not self.closed:
            self.closed = True
            return [Emit(SessionClosed("client_closed"))]
        return []
