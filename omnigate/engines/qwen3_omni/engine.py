"""The Qwen3-Omni engine: turns of every session on one worker thread, outputs delivered on the caller's loop.

A session submits a turn (:class:`~omnigate.engines.qwen3_omni.runner.TurnRequest`: the conversation's ids up to the
open assistant turn, the user's audio tokens) with a sink; the worker runs every live turn's steps together
(:class:`~omnigate.engines.qwen3_omni.runner.TurnRunner`: batched prefills under a token budget, one padded thinker
step, one padded talker frame, one Code2Wav push) and hands each turn, per step, its text delta, its audio as
24 kHz s16le PCM, and at the end exactly one :class:`TurnEnd`. ``cancel`` stops a turn at once (barge-in,
``response.cancel``): nothing more of it is delivered, and its slot is free at the next step. ``grant`` raises a
turn's credit (the audio frames it may make in all, :attr:`TurnRequest.credit`): a turn at its credit is paused, not
stepped, until its session's client takes more. A step that raises ends every turn in flight with an error, so no
session waits on a worker that can no longer answer. A turn's audio and a question's frames are encoded before it is
submitted, by :attr:`Qwen3OmniEngine.encoder` (:class:`~omnigate.engines.qwen3_omni.encoder.InputEncoder`: every
session's waiting inputs together, on its own thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import numpy as np

from omnigate.engines.base import EngineError
from omnigate.engines.omni.tokenizer import IncrementalDecoder
from omnigate.engines.qwen3_omni.encoder import InputEncoder
from omnigate.engines.qwen3_omni.model import DEFAULT_MAX_CONTEXT, DEFAULT_SLOTS, Qwen3OmniModel, load_model
from omnigate.engines.qwen3_omni.runner import AudioFrame, TextToken, TurnDone, TurnRequest, TurnRunner

log = logging.getLogger(__name__)

OPTIONS = ("device", "dtype", "seed", "max_sessions", "max_context", "audio_ahead")


@dataclass(frozen=True)
class TurnText:
    text: str


@dataclass(frozen=True)
class TurnAudio:
    pcm: bytes  # s16le mono
    sample_rate: int


@dataclass(frozen=True)
class TurnEnd:
    reason: str  # "stop", "length", "max_context", "error"
    text: str  # the whole answer's text
    code: str | None = None  # a typed error code (context_length_exceeded, internal_error)
    message: str | None = None


TurnOutput = TurnText | TurnAudio | TurnEnd
TurnSink = Callable[[list[TurnOutput]], None]


@dataclass(eq=False)
class TurnHandle:
    """A submitted turn; ``cancel`` may be called from any thread."""

    engine: Qwen3OmniEngine
    sink: TurnSink
    loop: asyncio.AbstractEventLoop
    decoder: IncrementalDecoder
    id: int = -1
    ended: bool = False
    outputs: list[TurnOutput] = field(default_factory=list)

    def cancel(self) -> None:
        self.engine._cancel(self)

    def grant(self, frames: int) -> None:
        """Let the turn make ``frames`` audio frames in all (cumulative)."""
        self.engine._grant(self, frames)


def pcm16(audio: np.ndarray) -> bytes:
    """Float samples in [-1, 1] as s16le, clipped."""
    data: bytes = (np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
    return data


class Qwen3OmniEngine:
    """Runs the turns of every session on one worker thread; ``submit`` and ``cancel`` never block."""

    def __init__(self, model: Qwen3OmniModel, *, max_sessions: int | None = None, audio_ahead: bool = True) -> None:
        sessions = model.slots if max_sessions is None else max_sessions
        if not 0 < sessions <= model.slots:
            raise ValueError(f"max_sessions {sessions} must be between 1 and the model's {model.slots} slots")
        self.model = model
        self.max_sessions = sessions
        self.sample_rate = model.sample_rate
        self.audio_ahead = audio_ahead  # realtime turns' audio encoded as it comes (the encoder's turn_ahead)
        self._runner = TurnRunner(model)
        # Inputs encoded on their own thread, batched (not on this worker: a burst's encode would stall every voice
        # in flight); each session waits on at most one turn's audio, or one question's frames and audio.
        self.encoder = InputEncoder(model, max_waiting=2 * sessions)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._submitted: list[tuple[TurnHandle, TurnRequest]] = []
        self._cancelled: list[TurnHandle] = []
        self._granted: dict[TurnHandle, int] = {}
        self._live: dict[int, TurnHandle] = {}  # worker thread only
        # Turns that count against max_sessions: a cancelled one no longer does (its slot is freed at the next step,
        # and the turn replacing it, after a barge-in, must not be refused).
        self._answering: set[TurnHandle] = set()
        self._stopping = False
        self._thread: threading.Thread | None = None

    @classmethod
    def load(cls, spec: str, **options: str) -> Qwen3OmniEngine:
        """``--model SPEC`` with ``-E`` options: device, dtype, seed, max_sessions (slots), max_context, audio_ahead
        (default true: a realtime turn's whole windows are encoded while the user still speaks)."""
        unknown = set(options) - set(OPTIONS)
        if unknown:
            raise ValueError(f"unknown qwen3-omni option(s) {', '.join(sorted(unknown))}; known: {', '.join(OPTIONS)}")
        sessions = int(options.get("max_sessions", str(DEFAULT_SLOTS)))
        try:  # true/false, 1/0, as the talker's options
            audio_ahead = msgspec.convert(options.get("audio_ahead", "true"), bool, strict=False)
        except msgspec.ValidationError:
            raise ValueError(f"audio_ahead must be true or false, not {options['audio_ahead']!r}") from None
        model = load_model(
            spec,
            seed=int(options.get("seed", "0")),
            device=options.get("device", "cpu"),
            dtype=options.get("dtype"),
            slots=sessions,
            max_context=int(options.get("max_context", str(DEFAULT_MAX_CONTEXT))),
        )
        model.capture()
        return cls(model, max_sessions=sessions, audio_ahead=audio_ahead)

    def start(self) -> None:
        self.encoder.start()
        self._thread = threading.Thread(target=self._run, name="qwen3-omni-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End every turn, fail the inputs waiting to be encoded, and join the threads. Blocking: call it off the
        event loop."""
        self.encoder.stop()
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def submit(self, request: TurnRequest, sink: TurnSink) -> TurnHandle:
        """Queue a turn; raises :class:`EngineError` ``engine_busy`` when every slot is answering."""
        decoder = IncrementalDecoder(cast(Any, self.model.tokenizer))  # it reads only ``decode``
        handle = TurnHandle(self, sink, asyncio.get_running_loop(), decoder)
        with self._lock:
            if self._stopping:
                raise EngineError("shutting_down", "the server is shutting down")
            if len(self._answering) >= self.max_sessions:
                raise EngineError("engine_busy", "every qwen3-omni slot is answering; retry shortly")
            self._answering.add(handle)
            self._submitted.append((handle, request))
            self._wake.notify()
        return handle

    def _cancel(self, handle: TurnHandle) -> None:
        with self._lock:
            handle.ended = True
            self._answering.discard(handle)
            self._cancelled.append(handle)
            self._wake.notify()

    def _grant(self, handle: TurnHandle, frames: int) -> None:
        with self._lock:
            if handle.ended:
                return
            self._granted[handle] = max(frames, self._granted.get(handle, 0))
            self._wake.notify()

    # ---- worker ----------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._stopping or self._submitted or self._cancelled or self._granted or self._runner.ready):
                    self._wake.wait()
                if self._stopping:
                    return
                submitted, self._submitted = self._submitted, []
                cancelled, self._cancelled = self._cancelled, []
                granted, self._granted = self._granted, {}
            for handle in cancelled:
                self._live.pop(handle.id, None)
                if handle.id >= 0:
                    self._runner.cancel(handle.id)
            for handle, request in submitted:
                if handle.ended:  # cancelled before the worker saw it
                    continue
                handle.id = self._runner.submit(request)
                self._live[handle.id] = handle
            for handle, frames in granted.items():
                if handle.id >= 0 and not handle.ended:
                    self._runner.grant(handle.id, frames)
            try:
                events = self._runner.step()
            except Exception as exc:  # a failed step ends every turn in flight, typed
                log.exception("qwen3-omni step failed")
                self._fail_all(f"{type(exc).__name__}: {exc}")
                continue
            touched: dict[int, TurnHandle] = {}
            for event in events:
                owner = self._live.get(event.turn)
                if owner is None or owner.ended:
                    continue
                touched[event.turn] = owner
                self._collect(owner, event.event)
            for turn, owner in touched.items():
                outputs, owner.outputs = owner.outputs, []
                if any(isinstance(o, TurnEnd) for o in outputs):
                    self._live.pop(turn, None)
                    with self._lock:
                        self._answering.discard(owner)
                self._emit(owner, outputs)

    def _collect(self, handle: TurnHandle, event: TextToken | AudioFrame | TurnDone) -> None:
        if isinstance(event, TextToken):
            if event.token != self.model.tokenizer.im_end:
                delta = handle.decoder.push(event.token)
                if delta:
                    handle.outputs.append(TurnText(delta))
        elif isinstance(event, AudioFrame):
            handle.outputs.append(TurnAudio(pcm16(event.audio), self.sample_rate))
        else:
            handle.ended = True
            reason = "error" if event.error is not None else event.reason
            code = event.reason if event.error is not None else None
            handle.outputs.append(TurnEnd(reason, handle.decoder.text, code, event.error))

    def _fail_all(self, message: str) -> None:
        with self._lock:  # before the ends reach anyone: a session answered with the error may submit at once
            self._answering.difference_update(self._live.values())
        for handle in self._live.values():
            handle.ended = True
            self._emit(handle, [TurnEnd("error", handle.decoder.text, "internal_error", message)])
        self._live.clear()
        self._runner.drop_all()

    @staticmethod
    def _emit(handle: TurnHandle, outputs: list[TurnOutput]) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            handle.loop.call_soon_threadsafe(handle.sink, outputs)
