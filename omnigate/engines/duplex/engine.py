"""The duplex engine: every live session advances one 80 ms frame per tick, all of them in one batched step.

A clock thread keeps the ticks: at each tick it takes one frame of each session's buffered audio (or a frame of
silence when the client sent none, so the model keeps listening in real time), steps the model once for all of
them and hands each session its output frame on the session's event loop. A session whose consumer has no room
(no credit) sits the tick out: its row is computed but masked, so it neither hears nor says anything that tick and
its input waits, capped, for the next (a stalled client costs bounded memory; the model's time for it pauses).
Every tick is a batch of slots ``0..B-1`` for one of a few bucket sizes, which a CUDA graph captured at load serves,
whichever sessions have credit and wherever their slots are. A tick whose step ends after the next tick was due is
late; a clock that falls more than one tick behind drops the backlog and counts the ticks it missed
(:class:`ClockStats`, exported on ``/metrics``).

The engine also implements the text-stream :class:`Engine` contract, refusing it: a speech-to-speech model has
nothing to say about text alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch

from omnigate.engines.base import (
    Engine,
    EngineCapabilities,
    EngineError,
    EngineInfo,
    EngineOutput,
    EngineStream,
    SynthesisParams,
    VoiceInfo,
)
from omnigate.engines.duplex.frames import FrameModel, FrameSettings
from omnigate.engines.duplex.model import DuplexModel, load_duplex_model
from omnigate.engines.duplex.options import TORCH_DTYPES, DuplexOptions
from omnigate.engines.duplex.session import (
    DuplexClosed,
    DuplexFrame,
    DuplexFull,
    DuplexSession,
    FrameSink,
    SessionEnd,
)
from omnigate.engines.duplex.stats import ClockStats
from omnigate.os_threads import name_os_thread

log = logging.getLogger(__name__)

FAMILY = "duplex"
VOICE_ID = "moshi"
_SEED_MASK = (1 << 62) - 1
_NOT_TEXT = "the duplex engine is speech-to-speech: it serves /v1/realtime sessions, not text synthesis"


@dataclass(frozen=True)
class _Row:
    """One session's step in a tick: its slot and its input frame."""

    slot: int
    session: DuplexSession
    pcm: bytes
    real_input: bool


class DuplexEngine(Engine):
    """Serves up to ``max_sessions`` concurrent full-duplex sessions from one Moshi model."""

    def __init__(self, model: DuplexModel, options: DuplexOptions) -> None:
        self.options = options
        self.model = model
        self.frames = FrameModel(
            model,
            FrameSettings(
                slots=options.max_sessions,
                context_frames=options.context_frames,
                text_temperature=options.text_temperature,
                text_top_k=options.text_top_k,
                audio_temperature=options.audio_temperature,
                audio_top_k=options.audio_top_k,
                codec_graphs=options.codec_graphs,
            ),
        )
        self.sample_rate = self.frames.sample_rate
        self.samples_per_frame = self.frames.samples_per_frame
        self.frame_s = self.samples_per_frame / self.sample_rate
        self.stats = ClockStats()
        self._cond = threading.Condition()
        self._sessions: dict[int, DuplexSession] = {}
        self._free_slots = set(range(options.max_sessions))
        self._ids = itertools.count(1)
        self._closing = False
        self._thread: threading.Thread | None = None
        self._tokenizer: Any = model.tokenizer
        self._silence = bytes(2 * self.samples_per_frame)
        self._warm_up()
        voice = VoiceInfo(id=VOICE_ID, name="The model's own voice", description=model.name)
        self.info = EngineInfo(
            family=FAMILY,
            model=model.name,
            sample_rate=self.sample_rate,
            voices=(voice,),
            default_voice=voice.id,
            capabilities=EngineCapabilities(duplex=True),
            max_sessions=options.max_sessions,
            max_batch=options.max_sessions,
            workers=1,
            synthetic=model.random_weights,
            min_credit_ms=self.frame_s * 1000.0,
        )

    def _warm_up(self) -> None:
        """Steps at load, so live ticks pay for no kernel compilation, first allocation or graph capture: one eager
        step, then (with CUDA graphs) one step of every batch bucket, which captures its graph. Every later tick is
        one of these buckets, so no live tick captures."""
        graphs, masked = self.frames.use_graphs, self.frames.masked_rows
        silence = np.zeros((self.options.max_sessions, self.samples_per_frame), dtype=np.int16)
        try:
            with torch.inference_mode():
                self.frames.use_graphs = self.frames.masked_rows = False
                self.frames.reset(0, seed=0)
                self.frames.step([0], silence[:1])
                self.frames.use_graphs, self.frames.masked_rows = graphs, masked
                for bucket in self.frames.buckets if graphs else ():
                    for slot in range(bucket):
                        self.frames.reset(slot, seed=0)
                    self.frames.step(list(range(bucket)), silence[:bucket])
        finally:
            self.frames.use_graphs, self.frames.masked_rows = graphs, masked
            for slot in range(self.options.max_sessions):
                self.frames.reset(slot, seed=0)

    @classmethod
    def load(cls, model: str | None, **options: Any) -> DuplexEngine:
        """Build from ``--model`` (``preset:NAME`` or a checkpoint directory) and string or typed options."""
        try:
            parsed = msgspec.convert(options, DuplexOptions, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid duplex option: {exc}") from None
        loaded = load_duplex_model(model, seed=parsed.seed, device=parsed.device, dtype=TORCH_DTYPES[parsed.dtype])
        return cls(loaded, parsed)

    # ---- the text-stream contract: refused ----------------------------------------------------------------------

    def open(self, params: SynthesisParams) -> EngineStream:
        raise EngineError("unsupported", _NOT_TEXT)

    def step(self, streams: Sequence[EngineStream], budget_ms: Sequence[float]) -> list[list[EngineOutput]]:
        raise EngineError("unsupported", _NOT_TEXT)

    def close(self, stream: EngineStream) -> None:
        """Text streams are never opened, so there is nothing to release."""

    # ---- duplex sessions (event-loop side) ------------------------------------------------------------------

    @property
    def active_sessions(self) -> int:
        with self._cond:
            return len(self._sessions)

    async def admit(
        self,
        sink: FrameSink,
        *,
        max_input_bytes: int,
        initial_credit_frames: int,
        seed: int | None = None,
        on_end: SessionEnd | None = None,
    ) -> DuplexSession:
        """:meth:`open_session`, as the gateway's sessions call it (an engine core's client awaits the core here);
        the slots are this process's, so it answers at once."""
        return self.open_session(
            sink, max_input_bytes=max_input_bytes, initial_credit_frames=initial_credit_frames, seed=seed, on_end=on_end
        )

    def open_session(
        self,
        sink: FrameSink,
        *,
        max_input_bytes: int,
        initial_credit_frames: int,
        seed: int | None = None,
        on_end: SessionEnd | None = None,
    ) -> DuplexSession:
        """Admit a session; ``sink`` receives its frames on the calling event loop, ``on_end`` hears there when the
        engine ends the session itself (a failed step). Raises DuplexFull/DuplexClosed."""
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._closing:
                raise DuplexClosed()
            if not self._free_slots:
                raise DuplexFull(self.options.max_sessions, self.options.retry_after_s)
            session_id = next(self._ids)
            slot = min(self._free_slots)  # low slots first: a full batch then reads its caches as one range
            self._free_slots.discard(slot)
            if seed is None:
                seed = (self.options.seed * 1_000_003 + session_id) & _SEED_MASK
            session = DuplexSession(
                id=session_id,
                slot=slot,
                seed=seed,
                sink=sink,
                loop=loop,
                max_input_bytes=max_input_bytes,
                credit_frames=initial_credit_frames,
                on_end=on_end,
            )
            self._sessions[session_id] = session
            self.stats.sessions = len(self._sessions)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="omnigate-clock", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return session

    def push_audio(self, session: DuplexSession, pcm: bytes) -> bool:
        """Queue user audio (s16le mono at the engine rate); False, and nothing queued, when over the input cap."""
        with self._cond:
            if session.closed:
                return True
            if len(session.pending) + len(pcm) > session.max_input_bytes:
                return False
            session.pending.extend(pcm)
            return True

    def pending_input_bytes(self, session: DuplexSession) -> int:
        with self._cond:
            return len(session.pending)

    def clear_input(self, session: DuplexSession) -> int:
        """Drop the user audio not yet consumed; returns the bytes dropped."""
        with self._cond:
            dropped = len(session.pending)
            session.pending.clear()
            return dropped

    def grant(self, session: DuplexSession, frames: int) -> None:
        """The consumer has room for ``frames`` more output frames."""
        with self._cond:
            session.credit_frames += frames
            self._cond.notify_all()

    def close_session(self, session: DuplexSession) -> None:
        """End the session now and free its slot. Idempotent; nothing reaches its sink afterwards."""
        with self._cond:
            if session.closed:
                return
            session.closed = True
            session.pending.clear()
            self._sessions.pop(session.id, None)
            self.stats.sessions = len(self._sessions)
            # The slot's state is reset on the clock thread before its next session's first step, so it is safe
            # to hand out now even while a step that includes the old session is still running.
            self._free_slots.add(session.slot)
            self._cond.notify_all()

    def shutdown(self) -> None:
        with self._cond:
            self._closing = True
            for session in list(self._sessions.values()):
                session.closed = True
            self._sessions.clear()
            self.stats.sessions = 0
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(10.0)

    # ---- the clock (its own thread) -------------------------------------------------------------------------

    def _runnable_locked(self) -> bool:
        return any(s.credit_frames > 0 for s in self._sessions.values())

    def _run(self) -> None:
        name_os_thread()
        deadline: float | None = None
        while True:
            with self._cond:
                while not self._closing and not self._runnable_locked():
                    self._cond.wait()
                    deadline = None  # idle: the clock starts afresh when work returns
                now = time.monotonic()
                if deadline is None:
                    deadline = now
                while not self._closing and now < deadline:
                    self._cond.wait(deadline - now)
                    now = time.monotonic()
                if self._closing:
                    return
                batch = self._collect_locked()
            if batch:
                self._tick(batch, now)
            end = time.monotonic()
            due = deadline + self.frame_s
            if end > due:
                self.stats.late_ticks += 1
                self.stats.late_seconds_total += end - due
            deadline = due
            behind = int((end - deadline) / self.frame_s)
            if behind >= 1:
                # More than a tick behind: catching up would only burst stale frames; drop the backlog.
                self.stats.missed_ticks += behind
                deadline += behind * self.frame_s

    def _collect_locked(self) -> list[_Row]:
        """One input frame of every session with credit, lowest slot first. The others sit the tick out: the model
        computes their rows masked (:meth:`FrameModel.step`), so the batch stays one a captured graph serves."""
        frame_bytes = 2 * self.samples_per_frame
        batch: list[_Row] = []
        for session in self._sessions.values():
            if session.credit_frames <= 0:
                self.stats.sat_out += 1
                continue
            session.credit_frames -= 1
            if len(session.pending) >= frame_bytes:
                pcm = bytes(session.pending[:frame_bytes])
                del session.pending[:frame_bytes]
                batch.append(_Row(session.slot, session, pcm, True))
            else:
                batch.append(_Row(session.slot, session, self._silence, False))
        batch.sort(key=lambda row: row.slot)
        return batch

    def _tick(self, batch: list[_Row], started: float) -> None:
        cpu0 = time.thread_time()
        t0 = time.monotonic()
        for row in batch:
            if row.session.fresh:
                row.session.fresh = False
                self.frames.reset(row.slot, row.session.seed)
        slots = [row.slot for row in batch]
        pcm = np.stack([np.frombuffer(row.pcm, dtype="<i2") for row in batch])
        try:
            with torch.inference_mode():
                out = self.frames.step(slots, pcm)
        except Exception:
            log.exception("duplex step failed; closing the sessions in it")
            for row in batch:
                self._fail(row.session)
            return
        stats = self.stats
        stats.observe_step(time.monotonic() - t0)
        stats.ticks += 1
        stats.frames += len(batch)
        stats.rows += out.rows
        stats.last_batch = out.rows
        stats.last_frames = len(batch)
        if out.graph:
            stats.graph_ticks += 1
        else:
            stats.eager_ticks += 1
        if out.captured:
            stats.graph_captures += 1
            log.warning("the duplex clock captured a CUDA graph for %d rows on a live tick", out.rows)
        frame_ms = self.frame_s * 1000.0
        listen = self.options.listen_token_id
        # One hand-off per event loop per tick (not one per session): fewer wake-ups of the loop, less contention.
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[DuplexSession, DuplexFrame]]] = {}
        for index, row in enumerate(batch):
            session = row.session
            token = out.text[index]
            frame = DuplexFrame(
                tick=session.ticks,
                pcm=out.pcm[index].astype("<i2").tobytes(),
                sample_rate=self.sample_rate,
                text_token=token,
                text=self._piece(token),
                listening=token == listen,
                input_ms=frame_ms if row.real_input else 0.0,
            )
            session.ticks += 1
            deliveries.setdefault(session.loop, []).append((session, frame))
        for loop, frames in deliveries.items():
            with contextlib.suppress(RuntimeError):  # a closed loop has nobody left to receive
                loop.call_soon_threadsafe(self._deliver, frames)
        stats.tick_seconds_total += time.monotonic() - started
        stats.clock_cpu_seconds_total += time.thread_time() - cpu0

    def _fail(self, session: DuplexSession) -> None:
        with self._cond:
            if session.closed:
                return
            session.closed = True
            self._sessions.pop(session.id, None)
            self.stats.sessions = len(self._sessions)
            self._free_slots.add(session.slot)
        if session.on_end is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop has nobody left to tell
                session.loop.call_soon_threadsafe(session.on_end, "engine_error", "the duplex model step failed")

    def _piece(self, token: int) -> str:
        if self._tokenizer is None or token == self.options.listen_token_id:
            return ""
        if token in self._tokenizer.all_special_ids:
            return ""
        piece = self._tokenizer.convert_ids_to_tokens(token)
        return piece.replace("\u2581", " ") if isinstance(piece, str) else ""

    @staticmethod
    def _deliver(frames: list[tuple[DuplexSession, DuplexFrame]]) -> None:
        # Runs on the sessions' loop, where close_session runs too: nothing reaches a closed session's sink.
        for session, frame in frames:
            if session.closed:
                continue
            try:
                session.sink(frame)
            except Exception:  # one session's failure is its own: the others still get their frames
                log.exception("a duplex session's frame sink raised")
