"""The omni engine: queries in, answer text out token by token, on one worker thread shared by every session.

A query carries the frames sampled for it (decoded pixels and a digest of each), the question's audio, and the
prompt text around them. Each loop of the worker first admits new queries (encoding their frames and audio and
prefilling the language model into a slot of its key/value cache, one slot per answer, taken at admission and
returned when the answer ends), then advances every running answer by one token in ONE batched step: the next tokens
are sampled together on the device and the thinker runs one forward over all the answers' new tokens. A long answer
never holds up another session's first token for more than one step. Each session keeps an :class:`EncoderCache`: a
frame whose digest was encoded before (an unchanged camera picture) reuses its vision tokens instead of running the
encoder.

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
from dataclasses import dataclass, field

import torch

from omnigate.engines.base import EngineError
from omnigate.engines.omni.model import DEFAULT_MAX_CONTEXT, OmniModel, load_omni_model
from omnigate.engines.omni.request import (
    CONTEXT_LENGTH_EXCEEDED,
    OmniInfo,
    TextDelta,
    ThinkDone,
    ThinkOutput,
    ThinkRequest,
    ThinkSink,
    ThinkStop,
)
from omnigate.engines.omni.sampling import sample_rows
from omnigate.engines.omni.tokenizer import IncrementalDecoder

log = logging.getLogger(__name__)

# Prompt tokens one worker loop prefills before its decode step (at least one query's): a burst of questions
# (each with frames to encode) is admitted over several steps, so the answers in flight keep streaming meanwhile.
PREFILL_TOKENS_PER_STEP = 1024


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

    ``max_sessions`` answers at once (default: one per slot of the model's cache, at most that many)."""

    def __init__(self, model: OmniModel, *, max_sessions: int | None = None) -> None:
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
        self._stopping = False
        self._thread: threading.Thread | None = None
        # counters (read by metrics and benchmarks)
        self.frames_encoded_total = 0
        self.frames_reused_total = 0
        self.encode_seconds_total = 0.0
        self.tokens_total = 0
        self.steps = 0  # batched decode steps
        self.decode_rows_total = 0  # answers advanced, summed over the steps (÷ steps: the mean batch)
        self.prefill_tokens_total = 0

    @classmethod
    def load(cls, spec: str, **options: str) -> OmniEngine:
        """``--omni-model SPEC`` with ``--omni-option`` values: device, dtype, seed, max_sessions, frame_size,
        max_context (tokens of one answer's prompt and answer together, default 4096)."""
        known = {"device", "dtype", "seed", "max_sessions", "frame_size", "max_context"}
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"unknown omni option(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
        sessions = int(options.get("max_sessions", "16"))
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
        return cls(model, max_sessions=sessions)

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

    # ---- worker -----------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._pending and not self._running:
                    self._wake.wait()
                if self._stopping:
                    jobs = self._pending + self._running
                    self._pending, self._running = [], []
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
            prefilled = 0
            for job in admitted:
                if job.cancelled:
                    self._finish(job, "cancelled")
                elif not self._free_slots or prefilled >= PREFILL_TOKENS_PER_STEP:
                    # No free slot: a job cancelled after this step began still holds its own (the next step frees
                    # it). Over the budget: the answers in flight get their next token before more prefills.
                    waiting.append(job)
                else:
                    prefilled += self._prefill(job)
                    if not job.done:
                        running.append(job)
            if running:
                self._step(running)
            with self._lock:
                self._running = [j for j in running if not j.done]
                self._pending[:0] = waiting

    def _prefill(self, job: ThinkJob) -> int:
        """Encode the job's prompt into a slot; the prompt's tokens (the job has ended when it could not start)."""
        job.slot = self._free_slots.pop()
        try:
            started = time.perf_counter()
            embeds = self._prompt_embeds(job.request)
            tokens = int(embeds.shape[0])
            if tokens > self.model.max_context:
                message = (
                    f"the prompt ({tokens} tokens: history, frames, audio and question) exceeds the thinker's "
                    f"context of {self.model.max_context} tokens; ask with fewer frames or a shorter history"
                )
                self._finish(job, "error", message, CONTEXT_LENGTH_EXCEEDED)
                return 0
            job.logits = self.model.prefill(job.slot, embeds)
            job.prefill_s = time.perf_counter() - started
        except Exception as exc:
            log.exception("omni prefill failed")
            self._finish(job, "error", f"{type(exc).__name__}: {exc}")
            return 0
        self.prefill_tokens_total += tokens
        job.decoder = IncrementalDecoder(self.model.tokenizer)
        job.generator = torch.Generator(device="cpu").manual_seed(job.request.seed)
        return tokens

    def _prompt_embeds(self, request: ThinkRequest) -> torch.Tensor:
        model = self.model
        tok = model.tokenizer
        parts = [model.embed(tok.encode(request.context + tok.user_open()))]
        parts.extend(self._frame_tokens(request))
        if request.audio:
            parts.append(model.encode_audio(request.audio))
        parts.append(model.embed(tok.encode(tok.user_close(request.question))))
        return torch.cat([p.to(model.dtype) for p in parts])

    def _frame_tokens(self, request: ThinkRequest) -> list[torch.Tensor]:
        cache = request.cache
        found: list[torch.Tensor | None] = [cache.get(f.digest) if cache is not None else None for f in request.frames]
        missing = [i for i, t in enumerate(found) if t is None]
        self.frames_reused_total += len(found) - len(missing)
        if missing:
            started = time.perf_counter()
            encoded = self.model.encode_frames([request.frames[i].pixels for i in missing])
            self.encode_seconds_total += time.perf_counter() - started
            self.frames_encoded_total += len(missing)
            for i, tokens in zip(missing, encoded, strict=True):
                found[i] = tokens
                if cache is not None:
                    cache.put(request.frames[i].digest, tokens)
        return [t for t in found if t is not None]

    def _step(self, jobs: list[ThinkJob]) -> None:
        """One token of every job: sample all of them at once, emit, then one forward over those that go on."""
        model = self.model
        try:
            logits = torch.stack([job.next_logits() for job in jobs])
            # One uniform per answer from its own generator (CPU), sent with the temperatures in one copy.
            draws = [float(torch.rand((), dtype=torch.float64, generator=job.generator)) for job in jobs]
            rows = torch.tensor([[job.request.temperature for job in jobs], draws], dtype=torch.float64)
            rows = rows.to(logits.device)
            sampled = sample_rows(logits, rows[0], rows[1])
            tokens = sampled.tolist()
        except Exception as exc:
            log.exception("omni sampling failed")
            for job in jobs:
                self._finish(job, "error", f"{type(exc).__name__}: {exc}")
            return
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
            return
        on = [jobs[i] for i in going]
        try:
            index = torch.tensor(going, device=sampled.device)
            next_logits = model.decode(slots, sampled.index_select(0, index))
        except Exception as exc:
            log.exception("omni decode failed")
            for job in on:
                self._finish(job, "error", f"{type(exc).__name__}: {exc}")
            return
        for job, row in zip(on, next_logits, strict=True):
            job.logits = row

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
