"""The omni engine: queries in, answer text out token by token, on one worker thread shared by every session.

A query carries the frames sampled for it (decoded pixels and a digest of each), the question's audio, and the
prompt text around them. Each loop of the worker first admits new queries (encoding their frames and audio and
prefilling the language model into a slot of its key/value cache, one slot per answer, taken at admission and
returned when the answer ends), then advances every running answer by one token in ONE batched step: the next tokens
are sampled together on the device and the thinker runs one forward over all the answers' new tokens. A long answer
never holds up another session's first token for more than one step. Each session keeps an :class:`EncoderCache`: a
frame whose digest was encoded before (an unchanged camera picture) reuses its vision tokens instead of running the
encoder.

Frames are also encoded as they arrive (:meth:`OmniEngine.encode_ahead`), before any question samples them: the
worker encodes them between its steps, newest first, into the session's cache, so a question's prefill finds its
vision tokens ready. A loop with nothing else to do encodes a few in one call; while answers are in flight, one frame
at a time, so a decode step waits at most one frame's encoding; either way at most a share of the worker's time.

Outputs reach the caller's sink on its event loop (``call_soon_threadsafe``); a cancelled query produces nothing
more, and every query that was admitted ends with exactly one :class:`ThinkDone`. A prompt longer than the context
(``max_context``) ends with the typed error ``context_length_exceeded``; an answer that fills its slot ends with
``max_context``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from omnigate.engines.base import EngineError
from omnigate.engines.omni.model import DEFAULT_MAX_CONTEXT, OmniModel, load_omni_model
from omnigate.engines.omni.request import (
    AUDIO_RATE,
    CONTEXT_LENGTH_EXCEEDED,
    EncoderCache,
    FrameInput,
    OmniInfo,
    TextDelta,
    ThinkDone,
    ThinkOutput,
    ThinkRequest,
    ThinkSink,
    ThinkStop,
)
from omnigate.engines.omni.sampling import sample_rows
from omnigate.engines.omni.stats import ThinkerStats
from omnigate.engines.omni.tokenizer import IncrementalDecoder

log = logging.getLogger(__name__)

# Prompt tokens one worker loop prefills, in one forward, before its decode step (at least one query's): a burst of
# 16 questions of 4 frames each (~650 tokens a question) starts in one or two loops, and the answers in flight wait
# at most one such forward (~0.1 s on an H200 for the 3B shape) for their next token.
PREFILL_TOKENS_PER_STEP = 8192
# New frames (not in their session's encoder cache) one loop encodes for the prompts it prefills (at least one
# prompt's): the answers in flight wait at most this many frames' encoding (~7 ms a frame on an H200) for their next
# token, not a whole burst's.
PREFILL_FRAMES_PER_STEP = 16
# Frames encoded ahead of their question: a loop with nothing else to do encodes at most this many in one call (a
# question arriving meanwhile waits for that call only), and such calls take at most this share of the worker's
# time: a camera whose every frame is new (2 a second, 64 sessions: ~1 s of encoder a second) must not take the GPU
# from the talker beside the thinker ...
AHEAD_FRAMES_IDLE = 8
AHEAD_IDLE_SHARE = 0.5
# ... and while answers are in flight one frame at a time, at most this share of the worker's time.
AHEAD_BUSY_SHARE = 0.25
# Frames waiting to be encoded ahead, every session's together; beyond it the oldest are forgotten (a question that
# samples one encodes it in its prefill, as it would without encoding ahead).
AHEAD_QUEUE_FRAMES = 512


@dataclass(eq=False)
class ThinkJob:
    """An admitted query. ``cancel`` may be called from any thread."""

    request: ThinkRequest
    sink: ThinkSink
    loop: asyncio.AbstractEventLoop
    cancelled: bool = False
    done: bool = False
    slot: int | None = None  # the model's cache slot, from admission to the end of the answer
    logits: torch.Tensor | None = None  # [vocab] on the device: the next token's
    decoder: IncrementalDecoder | None = None
    tokens: int = 0
    generator: torch.Generator | None = None
    prefill_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def answering(self) -> bool:
        """Neither cancelled nor ended: the job counts against ``max_sessions``."""
        return not (self.cancelled or self.done)

    def next_logits(self) -> torch.Tensor:
        """The logits the next token is sampled from (a job that was prefilled and has not ended has them)."""
        if self.logits is None:
            raise RuntimeError("the job has no logits: it was not prefilled or it has ended")
        return self.logits


class OmniEngine:
    """Runs queries of every session on one worker thread. ``submit`` and ``cancel`` never block.

    ``max_sessions`` answers at once (default: one per slot of the model's cache, at most that many); ``encode_ahead``
    turns encoding frames as they arrive on or off."""

    def __init__(self, model: OmniModel, *, max_sessions: int | None = None, encode_ahead: bool = True) -> None:
        sessions = model.slots if max_sessions is None else max_sessions
        if not 0 < sessions <= model.slots:
            raise ValueError(f"max_sessions {sessions} must be between 1 and the model's {model.slots} cache slots")
        self.model = model
        self.info = OmniInfo(
            model=model.name,
            max_sessions=sessions,
            frame_size=model.frame_size,
            tokens_per_frame=model.tokens_per_frame,
            random_weights=model.random_weights,
        )
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: list[ThinkJob] = []
        self._running: list[ThinkJob] = []
        self._free_slots = list(range(sessions))[::-1]  # worker thread only; the lowest slot is taken first
        self.ahead_enabled = encode_ahead
        self._ahead: deque[tuple[FrameInput, EncoderCache]] = deque(maxlen=AHEAD_QUEUE_FRAMES)
        self._ahead_next_at = 0.0  # no frame is encoded ahead before this time (perf_counter)
        self._stopping = False
        self._thread: threading.Thread | None = None
        # counters (read by metrics and benchmarks)
        self.frames_encoded_total = 0
        self.frames_reused_total = 0
        self.encode_seconds_total = 0.0
        self.frames_ahead_total = 0  # frames encoded ahead of their question (also in frames_encoded_total)
        self.frames_ahead_dropped_total = 0  # forgotten unencoded: the queue was full
        self.encode_ahead_seconds_total = 0.0
        self.prefill_seconds_total = 0.0  # prefill forwards (their frames' encoding is in encode_seconds_total)
        self.decode_seconds_total = 0.0  # decode steps, sampling included
        self.tokens_total = 0
        self.steps = 0  # batched decode steps
        self.decode_rows_total = 0  # answers advanced, summed over the steps (÷ steps: the mean batch)
        self.prefill_tokens_total = 0
        self.stats = ThinkerStats()

    @classmethod
    def load(cls, spec: str, **options: str) -> OmniEngine:
        """``--omni-model SPEC`` with ``--omni-option`` values: device, dtype, seed, max_sessions, frame_size,
        max_context (tokens of one answer's prompt and answer together, default 4096), encode_ahead (on or off:
        encode camera frames as they arrive, default on)."""
        known = {"device", "dtype", "seed", "max_sessions", "frame_size", "max_context", "encode_ahead"}
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"unknown omni option(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
        sessions = int(options.get("max_sessions", "16"))
        ahead = options.get("encode_ahead", "on")
        if ahead not in ("on", "off"):
            raise ValueError(f"encode_ahead must be on or off, not {ahead!r}")
        model = load_omni_model(
            spec,
            seed=int(options.get("seed", "0")),
            device=options.get("device", "cpu"),
            dtype=options.get("dtype"),
            frame_size=int(options["frame_size"]) if "frame_size" in options else None,
            slots=sessions,
            max_context=int(options.get("max_context", str(DEFAULT_MAX_CONTEXT))),
        )
        model.warm_up()
        return cls(model, max_sessions=sessions, encode_ahead=ahead == "on")

    @property
    def active(self) -> int:
        with self._lock:
            return len(self._pending) + len(self._running)

    @property
    def free_slots(self) -> int:
        """Cache slots no answer holds (read from the worker or with the worker stopped)."""
        return len(self._free_slots)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="omni-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End every query (cancelled) and join the worker. Blocking: call it off the event loop."""
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def submit(self, request: ThinkRequest, sink: ThinkSink) -> ThinkJob:
        """Admit a query; raises :class:`EngineError` ``engine_busy`` when every slot is taken."""
        job = ThinkJob(request, sink, asyncio.get_running_loop())
        with self._lock:
            if self._stopping:
                raise EngineError("shutting_down", "the server is shutting down")
            # A cancelled or ended job holds no slot: the worker drops it at its next step, and the query replacing
            # it (a new question cancels the one in flight, or follows the answer just ended) must not be refused.
            answering = sum(j.answering for j in self._pending) + sum(j.answering for j in self._running)
            if answering >= self.info.max_sessions:
                raise EngineError("engine_busy", "every omni engine slot is answering; retry shortly")
            self._pending.append(job)
            self._wake.notify()
        return job

    def encode_ahead(self, frame: FrameInput, cache: EncoderCache) -> None:
        """A camera frame a question may sample: the worker encodes it into ``cache`` (the session's) when it has
        room, before any question asks for it. Never blocks; the frames of a full queue are forgotten oldest first."""
        if not self.ahead_enabled:
            return
        with self._lock:
            if self._stopping:
                return
            if len(self._ahead) == self._ahead.maxlen:
                self.frames_ahead_dropped_total += 1
            self._ahead.append((frame, cache))
            self._wake.notify()

    def forget_frames(self, cache: EncoderCache) -> None:
        """Drop the frames waiting to be encoded ahead into ``cache`` (its session ended)."""
        with self._lock:
            kept = [entry for entry in self._ahead if entry[1] is not cache]
            self._ahead.clear()
            self._ahead.extend(kept)

    # ---- worker -----------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._pending and not self._running:
                    if not self._ahead:
                        self._wake.wait()
                        continue
                    pause = self._ahead_next_at - time.perf_counter()
                    if pause <= 0:
                        break
                    self._wake.wait(pause)  # the frames waiting to be encoded ahead keep to their share
                if self._stopping:
                    jobs = self._pending + self._running
                    self._pending, self._running = [], []
                    self._ahead.clear()
                    for job in jobs:
                        self._finish(job, "cancelled")
                    return
                admitted, self._pending = self._pending, []
                running = list(self._running)
            for job in running:
                if job.cancelled:
                    self._finish(job, "cancelled")  # first: its slot may be the one a new query needs
            running = [j for j in running if not j.done]
            waiting: list[ThinkJob] = []
            taken: list[ThinkJob] = []
            planned = frames = 0
            for job in admitted:
                if job.cancelled:
                    self._finish(job, "cancelled")
                    continue
                new_frames = self._new_frames(job.request)
                over = planned >= PREFILL_TOKENS_PER_STEP or frames + new_frames > PREFILL_FRAMES_PER_STEP
                if len(taken) >= len(self._free_slots) or (taken and over):
                    # No free slot: a job cancelled after this step began still holds its own (the next step frees
                    # it). Over the budget: the answers in flight get their next token before more prefills.
                    waiting.append(job)
                else:
                    taken.append(job)
                    planned += self._prompt_estimate(job.request)
                    frames += new_frames
            prefilled, prompts = self._prefill(taken) if taken else (0, 0)
            running.extend(job for job in taken if not job.done)
            rows = len(running)
            padded = False
            if running:
                step_started = time.perf_counter()
                padded = self._step(running)
                self.decode_seconds_total += time.perf_counter() - step_started
            if rows or prompts:
                self.stats.record_loop(rows, prefilled, prompts, padded=padded)
            with self._lock:
                self._running = [j for j in running if not j.done]
                self._pending[:0] = waiting
                busy = bool(self._running or self._pending)
            self._encode_ahead(busy)

    def _new_frames(self, request: ThinkRequest) -> int:
        """The request's frames its prefill would encode (not in its session's cache)."""
        cache = request.cache
        return sum(1 for f in request.frames if cache is None or f.digest not in cache)

    def _encode_ahead(self, busy: bool) -> None:
        """Encode the newest frames waiting to be encoded ahead, under the loop's budget: ``AHEAD_FRAMES_IDLE`` in
        one call when nothing else waits, else one frame; then nothing more ahead until the calls' time is the share
        (``AHEAD_IDLE_SHARE``, ``AHEAD_BUSY_SHARE``) of the worker's time since."""
        if time.perf_counter() < self._ahead_next_at:
            return
        limit = 1 if busy else AHEAD_FRAMES_IDLE
        batch: list[tuple[FrameInput, EncoderCache]] = []
        with self._lock:
            while self._ahead and len(batch) < limit:
                frame, cache = self._ahead.pop()  # the newest first: every question samples its newest frame
                if frame.digest in cache or any(c is cache and f.digest == frame.digest for f, c in batch):
                    continue  # encoded already (an unchanged picture, or asked about since)
                batch.append((frame, cache))
        if not batch:
            return
        started = time.perf_counter()
        try:
            encoded = self.model.encode_frames([frame.pixels for frame, _ in batch])
            self.model.synchronize()  # its time is the decode steps' wait
        except Exception:
            log.exception("omni frame encoding ahead failed")  # a question sampling them encodes them in its prefill
            return
        elapsed = time.perf_counter() - started
        for (frame, cache), tokens in zip(batch, encoded, strict=True):
            cache.put(frame.digest, tokens)
        self.frames_ahead_total += len(batch)
        self.frames_encoded_total += len(batch)
        self.encode_ahead_seconds_total += elapsed
        share = AHEAD_BUSY_SHARE if busy else AHEAD_IDLE_SHARE
        self._ahead_next_at = time.perf_counter() + elapsed * (1.0 / share - 1.0)

    def _prompt_estimate(self, request: ThinkRequest) -> int:
        """The prompt's tokens before encoding anything (audio at 25 tokens a second, rounded up): its share of a
        loop's prefill budget."""
        tok = self.model.tokenizer
        text = len(tok.encode(request.context + tok.user_open())) + len(tok.encode(tok.user_close(request.question)))
        audio = -(-len(request.audio) * 25 // (2 * AUDIO_RATE))
        return text + len(request.frames) * self.model.tokens_per_frame + audio

    def _prefill(self, jobs: list[ThinkJob]) -> tuple[int, int]:
        """Encode the jobs' prompts (every new frame of all of them in one vision call) and prefill them into free
        slots in ONE forward; (prompt tokens, prompts) prefilled. A job that could not start has ended."""
        started = time.perf_counter()
        try:
            frames = self._frame_tokens([job.request for job in jobs])
        except Exception as exc:
            log.exception("omni frame encoding failed")
            for job in jobs:
                self._finish(job, "error", f"{type(exc).__name__}: {exc}")
            return 0, 0
        ready: list[tuple[ThinkJob, torch.Tensor]] = []
        for job, vision in zip(jobs, frames, strict=True):
            try:
                embeds = self._prompt_embeds(job.request, vision)
            except Exception as exc:
                log.exception("omni prompt encoding failed")
                self._finish(job, "error", f"{type(exc).__name__}: {exc}")
                continue
            length = int(embeds.shape[0])
            if length > self.model.max_context:
                message = (
                    f"the prompt ({length} tokens: history, frames, audio and question) exceeds the thinker's "
                    f"context of {self.model.max_context} tokens; ask with fewer frames or a shorter history"
                )
                self._finish(job, "error", message, CONTEXT_LENGTH_EXCEEDED)
                continue
            job.slot = self._free_slots.pop()
            ready.append((job, embeds))
        if not ready:
            return 0, 0
        slots = [job.slot for job, _ in ready]
        forward_started = time.perf_counter()
        try:
            logits = self.model.prefill_many([s for s in slots if s is not None], [e for _, e in ready])
            self.model.synchronize()  # the step after it waits for it anyway; timed apart from the encoder
        except Exception as exc:
            log.exception("omni prefill failed")
            for job, _ in ready:
                self._finish(job, "error", f"{type(exc).__name__}: {exc}")
            return 0, 0
        finished = time.perf_counter()
        self.prefill_seconds_total += finished - forward_started
        elapsed = finished - started
        tokens = 0
        for (job, embeds), row in zip(ready, logits, strict=True):
            job.logits = row
            job.prefill_s = elapsed
            job.decoder = IncrementalDecoder(self.model.tokenizer)
            job.generator = torch.Generator(device="cpu").manual_seed(job.request.seed)
            tokens += int(embeds.shape[0])
        self.prefill_tokens_total += tokens
        return tokens, len(ready)

    def _prompt_embeds(self, request: ThinkRequest, frames: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The prompt's embeddings: history, its frames' vision tokens (encoded now unless given), audio, question."""
        model = self.model
        tok = model.tokenizer
        parts = [model.embed(tok.encode(request.context + tok.user_open()))]
        parts.extend(self._frame_tokens([request])[0] if frames is None else frames)
        if request.audio:
            parts.append(model.encode_audio(request.audio))
        parts.append(model.embed(tok.encode(tok.user_close(request.question))))
        return torch.cat([p.to(model.dtype) for p in parts])

    def _frame_tokens(self, requests: list[ThinkRequest]) -> list[list[torch.Tensor]]:
        """Each request's frames as vision tokens: reused from its session's cache, or encoded, the frames missing
        from every request in one encoder call."""
        found = [[r.cache.get(f.digest) if r.cache is not None else None for f in r.frames] for r in requests]
        missing = [(i, j) for i, row in enumerate(found) for j, t in enumerate(row) if t is None]
        self.frames_reused_total += sum(len(row) for row in found) - len(missing)
        if missing:
            started = time.perf_counter()
            encoded = self.model.encode_frames([requests[i].frames[j].pixels for i, j in missing])
            self.model.synchronize()
            self.encode_seconds_total += time.perf_counter() - started
            self.frames_encoded_total += len(missing)
            for (i, j), tokens in zip(missing, encoded, strict=True):
                found[i][j] = tokens
                cache = requests[i].cache
                if cache is not None:
                    cache.put(requests[i].frames[j].digest, tokens)
        return [[t for t in row if t is not None] for row in found]

    def _step(self, jobs: list[ThinkJob]) -> bool:
        """One token of every job: sample all of them at once, emit, and one forward over those that go on; whether
        the step ran padded (from a captured graph on the GPU: sampling and forward in one replay)."""
        model = self.model
        padded = model.padded_decode
        following: torch.Tensor | None = None
        try:
            logits = [job.next_logits() for job in jobs]
            temperature = [job.request.temperature for job in jobs]
            # One uniform per answer from its own generator (CPU), sent with the temperatures in one copy.
            draws = [float(torch.rand((), dtype=torch.float64, generator=job.generator)) for job in jobs]
            if padded:
                # Rows whose answer ends whatever they sample (their last token, or no room left) write nowhere.
                targets = [job.slot if self._can_go_on(job) else None for job in jobs]
                tokens, following = model.sample_decode(logits, temperature, draws, targets)
            else:
                stacked = torch.stack(logits)
                rows = torch.tensor([temperature, draws], dtype=torch.float64).to(stacked.device)
                sampled = sample_rows(stacked, rows[0], rows[1])
                tokens = sampled.tolist()
        except Exception as exc:
            log.exception("omni sampling failed")
            for job in jobs:
                self._finish(job, "error", f"{type(exc).__name__}: {exc}")
            return padded
        self.steps += 1
        self.decode_rows_total += len(jobs)
        going: list[int] = []
        slots: list[int] = []
        for i, (job, token) in enumerate(zip(jobs, tokens, strict=True)):
            if job.cancelled:
                self._finish(job, "cancelled")
                continue
            if token in model.tokenizer.eos_ids:
                self._finish(job, "completed")
                continue
            job.tokens += 1
            self.tokens_total += 1
            assert job.decoder is not None
            delta = job.decoder.push(token)
            if delta:
                self._emit(job, [TextDelta(delta)])
            slot = job.slot
            assert slot is not None
            if job.tokens >= job.request.max_new_tokens:
                self._finish(job, "max_tokens")
            elif model.room(slot) < 1:
                self._finish(job, "max_context")  # the token just sampled has no place in the cache
            else:
                going.append(i)
                slots.append(slot)
        if not going:
            return padded
        on = [jobs[i] for i in going]
        if following is not None:
            model.commit_decoded(slots)
            next_logits = following.index_select(0, torch.tensor(going, device=following.device))
        else:
            try:
                index = torch.tensor(going, device=sampled.device)
                next_logits = model.decode(slots, sampled.index_select(0, index))
            except Exception as exc:
                log.exception("omni decode failed")
                for job in on:
                    self._finish(job, "error", f"{type(exc).__name__}: {exc}")
                return padded
        for job, row in zip(on, next_logits, strict=True):
            job.logits = row
        return padded

    def _can_go_on(self, job: ThinkJob) -> bool:
        """Whether the job's next token may be followed by another, whatever it is (before sampling it)."""
        slot = job.slot
        return slot is not None and job.tokens + 1 < job.request.max_new_tokens and self.model.room(slot) >= 1

    def _finish(self, job: ThinkJob, reason: ThinkStop, error: str | None = None, code: str | None = None) -> None:
        if job.done:
            return
        job.done = True
        if job.slot is not None:
            self._free_slots.append(job.slot)
            job.slot = None
        job.logits = None
        text = job.decoder.text if job.decoder is not None else ""
        self._emit(job, [ThinkDone(reason, text, job.tokens, error, code)])

    def _emit(self, job: ThinkJob, outputs: list[ThinkOutput]) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            job.loop.call_soon_threadsafe(job.sink, outputs)
