"""The omni engine: queries in, answer text out token by token, on one worker thread shared by every session.

A query carries the frames sampled for it (decoded pixels and a digest of each), the question's audio, and the
prompt text around them. The worker admits new queries first (encoding their frames and audio and prefilling the
language model) and then advances every running answer by one token, round-robin, so a long answer never holds up
another session's first token for more than one step. Each session keeps an :class:`EncoderCache`: a frame whose
digest was encoded before (an unchanged camera picture) reuses its vision tokens instead of running the encoder.

Outputs reach the caller's sink on its event loop (``call_soon_threadsafe``); a cancelled query produces nothing
more, and every query that was admitted ends with exactly one :class:`ThinkDone`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from omnigate.engines.base import EngineError
from omnigate.engines.omni.model import OmniModel, load_omni_model
from omnigate.engines.omni.request import (
    OmniInfo,
    TextDelta,
    ThinkDone,
    ThinkOutput,
    ThinkRequest,
    ThinkSink,
    ThinkStop,
)
from omnigate.engines.omni.tokenizer import IncrementalDecoder

log = logging.getLogger(__name__)


@dataclass(eq=False)
class ThinkJob:
    """An admitted query. ``cancel`` may be called from any thread."""

    request: ThinkRequest
    sink: ThinkSink
    loop: asyncio.AbstractEventLoop
    cancelled: bool = False
    done: bool = False
    kv: Any = None
    logits: torch.Tensor | None = None
    decoder: IncrementalDecoder | None = None
    tokens: int = 0
    generator: torch.Generator | None = None
    prefill_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def cancel(self) -> None:
        self.cancelled = True


class OmniEngine:
    """Runs queries of every session on one worker thread. ``submit`` and ``cancel`` never block."""

    def __init__(self, model: OmniModel, *, max_sessions: int = 16) -> None:
        self.model = model
        self.info = OmniInfo(
            model=model.name,
            max_sessions=max_sessions,
            frame_size=model.frame_size,
            tokens_per_frame=model.tokens_per_frame,
            random_weights=model.random_weights,
        )
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: list[ThinkJob] = []
        self._running: list[ThinkJob] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        # counters (read by metrics and benchmarks)
        self.frames_encoded_total = 0
        self.frames_reused_total = 0
        self.encode_seconds_total = 0.0
        self.tokens_total = 0
        self.steps = 0

    @classmethod
    def load(cls, spec: str, **options: str) -> OmniEngine:
        """``--omni-model SPEC`` with ``--omni-option`` values: device, dtype, seed, max_sessions, frame_size."""
        known = {"device", "dtype", "seed", "max_sessions", "frame_size"}
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"unknown omni option(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
        model = load_omni_model(
            spec,
            seed=int(options.get("seed", "0")),
            device=options.get("device", "cpu"),
            dtype=options.get("dtype"),
            frame_size=int(options["frame_size"]) if "frame_size" in options else None,
        )
        return cls(model, max_sessions=int(options.get("max_sessions", "16")))

    @property
    def active(self) -> int:
        with self._lock:
            return len(self._pending) + len(self._running)

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
            # A cancelled job holds no slot: the worker drops it at its next step, and the query replacing it
            # (a new question cancels the one in flight) must not be refused for it.
            answering = sum(not j.cancelled for j in self._pending) + sum(not j.cancelled for j in self._running)
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
            for job in admitted:
                if self._prefill(job):
                    running.append(job)
            for job in running:
                if job.cancelled and not job.done:
                    self._finish(job, "cancelled")
                elif not job.done:
                    self._decode(job)
            self.steps += 1
            with self._lock:
                self._running = [j for j in running if not j.done]

    def _prefill(self, job: ThinkJob) -> bool:
        if job.cancelled:
            self._finish(job, "cancelled")
            return False
        try:
            started = time.perf_counter()
            embeds = self._prompt_embeds(job.request)
            job.kv = self.model.new_cache()
            job.logits = self.model.forward(embeds, job.kv)
            job.prefill_s = time.perf_counter() - started
        except Exception as exc:
            log.exception("omni prefill failed")
            self._finish(job, "error", f"{type(exc).__name__}: {exc}")
            return False
        job.decoder = IncrementalDecoder(self.model.tokenizer)
        job.generator = torch.Generator(device="cpu").manual_seed(job.request.seed)
        return True

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

    def _decode(self, job: ThinkJob) -> None:
        assert job.logits is not None and job.decoder is not None
        try:
            token = self._sample(job.logits, job.request.temperature, job.generator)
            if token in self.model.tokenizer.eos_ids:
                self._finish(job, "completed")
                return
            job.tokens += 1
            self.tokens_total += 1
            delta = job.decoder.push(token)
            if delta:
                self._emit(job, [TextDelta(delta)])
            if job.tokens >= job.request.max_new_tokens:
                self._finish(job, "max_tokens")
                return
            job.logits = self.model.forward(self.model.embed([token]), job.kv)
        except Exception as exc:
            log.exception("omni decode failed")
            self._finish(job, "error", f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
        if temperature <= 0.0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.cpu() / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))

    def _finish(self, job: ThinkJob, reason: ThinkStop, error: str | None = None) -> None:
        if job.done:
            return
        job.done = True
        job.kv = None
        job.logits = None
        text = job.decoder.text if job.decoder is not None else ""
        self._emit(job, [ThinkDone(reason, text, job.tokens, error)])

    def _emit(self, job: ThinkJob, outputs: list[ThinkOutput]) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            job.loop.call_soon_threadsafe(job.sink, outputs)
