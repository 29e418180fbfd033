"""The embedded LLM's engine: prompts in, answer text out token by token, on one worker thread for every conversation.

The worker loads the model first (the server is ready before it is: :attr:`LlmEngine.ready` says when answers can
start), then loops. Each loop samples the next token of every answer that has logits (its prompt is prefilled) in
one batched call, and runs ONE forward over one new token of each answer that goes on plus the next chunks of the
prompts being prefilled, within :data:`PREFILL_TOKENS_PER_STEP` prompt tokens a loop: a long prompt arriving delays
the answers in flight by one chunk's forward, never by its whole prefill. Sampling is seeded per answer (its uniforms
come from the answer's own seeded generator), so an answer's tokens do not depend on the others in its steps.

Bounded: ``max_sessions`` answers at once (one cache slot each; ``submit`` past it raises ``engine_busy``), a prompt
and its answer within ``max_context`` tokens (a longer prompt ends typed ``context_length_exceeded``), and at most
``max_answer_tokens`` tokens an answer. Outputs reach the caller's sink on its event loop (``call_soon_threadsafe``);
every admitted request ends with exactly one :class:`LlmDone`.

Prefix reuse: a slot keeps the token ids whose keys/values it holds after its answer ends. A new prompt goes to a
free slot and starts from the longest prefix (at least :data:`MIN_REUSED_TOKENS`) it shares with any slot's tokens:
a conversation's next turn repeats its whole history, and every conversation starts with the same system turn, so
only the tokens after that prefix are prefilled. The prefix is taken in place when the slot holding it is free and
loses fewer than :data:`MIN_REUSED_TOKENS` tokens past it (a conversation's next turn: at most the end of the last
answer, tokenized otherwise in the history), else copied into the free slot unused the longest, so that another
conversation's history is not overwritten for the system turn they share.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from omnigate.engines.base import EngineError
from omnigate.engines.llm.model import LlmModel
from omnigate.engines.omni.sampling import sample_rows
from omnigate.engines.omni.tokenizer import IncrementalDecoder

log = logging.getLogger(__name__)

# Prompt tokens prefilled a loop, beside the decode rows: ~0.2 s of forward for SmolLM2-135M on 2 CPU cores, so an
# answer in flight waits at most that for its next token while a new conversation's prompt goes in.
PREFILL_TOKENS_PER_STEP = 256
# Shorter shared prefixes are prefilled again: copying a slot's keys/values costs more than it saves for a few tokens.
MIN_REUSED_TOKENS = 16
DEFAULT_SESSIONS = 8
DEFAULT_MAX_CONTEXT = 2048
DEFAULT_MAX_ANSWER_TOKENS = 512
# torch's intra-op threads for the worker. One: on cores shared with the event loop, the voice and the VAD, a second
# thread makes every op wait for the busiest core at its barrier; on 2 loaded cores (load ~7) a SmolLM2 token took
# 0.7-1.5 s with 2 threads and 0.11 s with 1.
DEFAULT_THREADS = 1
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"

LlmStop = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True)
class LlmRequest:
    """A prompt (the chat already rendered as text), how many tokens to answer at most and how to sample."""

    prompt: str
    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class LlmText:
    """More of the answer's text."""

    text: str


@dataclass(frozen=True)
class LlmDone:
    """The end of an answer: why, its tokens and its prompt's; ``code`` types an ``error``."""

    reason: LlmStop
    completion_tokens: int
    prompt_tokens: int
    error: str | None = None
    code: str | None = None


LlmOutput = LlmText | LlmDone
LlmSink = Callable[[list[LlmOutput]], None]
ModelLoader = Callable[[], LlmModel]


@dataclass(eq=False)
class LlmJob:
    """An admitted request. ``cancel`` may be called from any thread."""

    request: LlmRequest
    sink: LlmSink
    loop: asyncio.AbstractEventLoop
    cancelled: bool = False
    done: bool = False
    slot: int | None = None
    prompt: list[int] | None = None  # token ids, once the worker encoded it
    prefilled: int = 0  # prompt tokens in the cache
    logits: torch.Tensor | None = None  # [vocab]: the next token's, once the whole prompt is in
    tokens: int = 0
    decoder: IncrementalDecoder | None = None
    generator: torch.Generator | None = None  # the answer's uniforms, seeded with its request's seed

    def cancel(self) -> None:
        self.cancelled = True

    def next_logits(self) -> torch.Tensor:
        if self.logits is None:
            raise RuntimeError("the job has no logits: its prompt is not in yet, or it has ended")
        return self.logits

    @property
    def answering(self) -> bool:
        return not (self.cancelled or self.done)


class LlmEngine:
    """Loads the model on its worker thread, then answers every conversation's requests there, batched.
    ``submit`` and ``cancel`` never block."""

    def __init__(
        self,
        load: ModelLoader,
        *,
        max_sessions: int = DEFAULT_SESSIONS,
        max_answer_tokens: int = DEFAULT_MAX_ANSWER_TOKENS,
        threads: int | None = DEFAULT_THREADS,
        prefix_reuse: bool = True,
    ) -> None:
        if max_sessions < 1 or max_answer_tokens < 1:
            raise ValueError("max_sessions and max_answer_tokens must be positive")
        self.max_sessions = max_sessions
        self.max_answer_tokens = max_answer_tokens
        self.threads = threads  # None: torch's own setting
        self.prefix_reuse = prefix_reuse
        self._load = load
        self.model: LlmModel | None = None
        self.load_error: str | None = None
        self.load_s: float | None = None
        self._loaded = threading.Event()  # set once loading ended, loaded or failed
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: list[LlmJob] = []
        self._running: list[LlmJob] = []
        self._free_slots: list[int] = []
        self._held: list[list[int]] = []  # per slot: the token ids whose keys/values it holds, in order
        self._freed_at: list[int] = []  # per slot: when it was last freed (0: never used), for least recently used
        self._frees = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        # counters (read by benchmarks)
        self.steps = 0
        self.decode_rows_total = 0
        self.prefill_tokens_total = 0
        self.reused_tokens_total = 0  # prompt tokens not prefilled: their keys/values were in a slot already

    @property
    def ready(self) -> bool:
        """The model is loaded: requests are answered."""
        return self.model is not None

    @property
    def loading(self) -> bool:
        return not self._loaded.is_set()

    def wait_loaded(self, timeout_s: float) -> bool:
        """Block until loading ended (loaded or failed), at most ``timeout_s``; whether it did. Off the event loop."""
        return self._loaded.wait(timeout_s)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="llm-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End every request (cancelled) and join the worker once it is past loading (loading cannot be interrupted;
        the daemon worker then exits by itself). Blocking: call it off the event loop."""
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None and self._loaded.is_set():
            self._thread.join()
            self._thread = None

    def submit(self, request: LlmRequest, sink: LlmSink) -> LlmJob:
        """Admit a request. Raises :class:`EngineError`: ``engine_busy`` past ``max_sessions`` answers,
        ``model_loading`` before the model is loaded, ``model_unavailable`` if it failed to load."""
        if self.load_error is not None:
            raise EngineError("model_unavailable", f"the embedded LLM failed to load: {self.load_error}")
        if self.model is None:
            raise EngineError("model_loading", "the embedded LLM is still loading; retry in a few seconds")
        if request.max_tokens < 1:
            raise EngineError("invalid_value", "max_tokens must be positive", "max_tokens")
        job = LlmJob(request, sink, asyncio.get_running_loop())
        with self._lock:
            if self._stopping:
                raise EngineError("shutting_down", "the server is shutting down")
            # Cancelled and ended answers hold no place: the worker frees their slots at its next loop.
            answering = sum(j.answering for j in self._pending) + sum(j.answering for j in self._running)
            if answering >= self.max_sessions:
                raise EngineError(
                    "engine_busy", f"the embedded LLM answers {self.max_sessions} conversations at once; retry shortly"
                )
            self._pending.append(job)
            self._wake.notify()
        return job

    # ---- worker -----------------------------------------------------------------------------------------------

    def _run(self) -> None:
        started = time.perf_counter()
        if self.threads is not None:
            torch.set_num_threads(self.threads)  # the process's intra-op pool, set here where the forwards run
        try:
            model = self._load()
        except Exception as exc:
            log.exception("the embedded LLM failed to load")
            self.load_error = f"{type(exc).__name__}: {exc}"
            self._loaded.set()
            return
        if model.slots < self.max_sessions:
            self.load_error = f"the model has {model.slots} cache slots for {self.max_sessions} conversations"
            self._loaded.set()
            return
        self._free_slots = list(range(self.max_sessions))
        self._held = [[] for _ in range(self.max_sessions)]
        self._freed_at = [0] * self.max_sessions
        self.load_s = time.perf_counter() - started
        self.model = model
        self._loaded.set()
        log.info("the embedded LLM %s is loaded (%.1f s)", model.name, self.load_s)
        while self._loop_once(model):
            pass

    def _loop_once(self, model: LlmModel) -> bool:
        with self._lock:
            while not self._stopping and not self._pending and not self._running:
                self._wake.wait()
            if self._stopping:
                for job in self._pending + self._running:
                    self._finish(job, "cancelled")
                self._pending, self._running = [], []
                return False
            admitted, self._pending = self._pending, []
            running = list(self._running)
        waiting: list[LlmJob] = []
        for job in running + admitted:
            if job.cancelled:
                self._finish(job, "cancelled")  # first: its slot may be the one a new request needs
        for job in admitted:
            if job.done:
                continue
            if not self._free_slots:
                waiting.append(job)  # a cancelled answer still in the step being planned holds the slot
            elif self._admit(model, job):
                running.append(job)
        running = [j for j in running if not j.done]
        if running:
            self._step(model, running)
        with self._lock:
            self._running = [j for j in running if not j.done]
            self._pending[:0] = waiting
        return True

    def _admit(self, model: LlmModel, job: LlmJob) -> bool:
        """Encode the job's prompt and give it a slot; False if it ended instead (too long, or not encodable)."""
        try:
            prompt = model.tokenizer.encode(job.request.prompt)
        except Exception as exc:
            log.exception("the embedded LLM could not encode a prompt")
            self._finish(job, "error", f"{type(exc).__name__}: {exc}")
            return False
        if not prompt or len(prompt) >= model.max_context:
            message = (
                f"the prompt ({len(prompt)} tokens) leaves no room for an answer in the embedded LLM's context of "
                f"{model.max_context} tokens; shorten the conversation"
            )
            self._finish(job, "error", message, CONTEXT_LENGTH_EXCEEDED)
            return False
        job.prompt = prompt
        job.slot, job.prefilled = self._place(model, prompt)
        job.decoder = IncrementalDecoder(model.tokenizer)
        job.generator = torch.Generator().manual_seed(job.request.seed)
        return True

    def _place(self, model: LlmModel, prompt: list[int]) -> tuple[int, int]:
        """Take a free slot for ``prompt`` holding the longest prefix of it found in any slot; the slot and how many
        prompt tokens it then holds. At least the prompt's last token is left to prefill: its logits start the
        answer."""
        source, shared = -1, 0
        if self.prefix_reuse:
            for slot, held in enumerate(self._held):
                common = _common_prefix(held, prompt, len(prompt) - 1)
                if common > shared:
                    source, shared = slot, common
        if shared < MIN_REUSED_TOKENS:
            source, shared = -1, 0
        if source in self._free_slots and len(self._held[source]) - shared < MIN_REUSED_TOKENS:
            slot = source
        else:
            slot = min(self._free_slots, key=lambda s: self._freed_at[s])
        self._free_slots.remove(slot)
        if shared:
            model.keep_prefix(slot, source, shared)
        else:
            model.reset(slot)
        self._held[slot] = prompt[:shared]
        self.reused_tokens_total += shared
        return slot, shared

    def _step(self, model: LlmModel, jobs: list[LlmJob]) -> None:
        """Sample one token of every job that has logits, then one forward: the tokens of those that go on and the
        next prompt chunks of those prefilling."""
        slots: list[int] = []
        rows: list[list[int]] = []
        fed: list[LlmJob] = []
        sampling = [j for j in jobs if j.logits is not None]
        if sampling:
            for job, token in zip(sampling, self._sample(sampling), strict=True):
                if self._emit_token(model, job, token):
                    slots.append(self._slot(job))
                    rows.append([token])
                    fed.append(job)
        decoding = len(fed)
        budget = PREFILL_TOKENS_PER_STEP
        for job in jobs:
            if job.done or job.prompt is None or job.prefilled == len(job.prompt) or budget <= 0:
                continue
            chunk = job.prompt[job.prefilled : job.prefilled + budget]
            budget -= len(chunk)
            job.prefilled += len(chunk)
            slots.append(self._slot(job))
            rows.append(chunk)
            fed.append(job)
        if not fed:
            return
        try:
            logits = model.forward(slots, rows)
        except Exception as exc:
            log.exception("the embedded LLM's forward failed")
            for job in fed:
                self._finish(job, "error", f"{type(exc).__name__}: {exc}")
            return
        self.steps += 1
        self.decode_rows_total += decoding
        self.prefill_tokens_total += sum(len(row) for row in rows[decoding:])
        for job, row in zip(fed, rows, strict=True):
            self._held[self._slot(job)].extend(row)
        for job, out in zip(fed, logits, strict=True):
            if job.prompt is not None and job.prefilled == len(job.prompt):
                job.logits = out

    @staticmethod
    def _sample(jobs: list[LlmJob]) -> list[int]:
        """The next token of each job: greedy at temperature 0, else drawn by inverse CDF with a uniform from the
        job's own seeded generator (an answer's tokens do not depend on the answers beside it), from the smallest
        set of ids holding ``top_p`` of the probability when that is below 1. The sort that set needs is done only
        for the rows that ask for it: over SmolLM2's 49k ids it costs more than the rest of the sampling."""
        logits = torch.stack([j.next_logits() for j in jobs])
        temperature = torch.tensor([max(j.request.temperature, 0.0) for j in jobs])
        uniforms = torch.tensor([float(torch.rand((), generator=j.generator)) for j in jobs], dtype=torch.float64)
        nucleus = [i for i, j in enumerate(jobs) if j.request.temperature > 0 and j.request.top_p < 1]
        if nucleus:
            index = torch.tensor(nucleus)
            top_p = torch.tensor([jobs[i].request.top_p for i in nucleus])[:, None]
            rows = logits.index_select(0, index)
            probs = torch.softmax(rows / temperature.index_select(0, index)[:, None], dim=-1)
            ordered, order = probs.sort(dim=-1, descending=True)
            outside = (ordered.cumsum(dim=-1) - ordered) >= top_p  # the ids after the set reached top_p
            drop = torch.zeros_like(outside).scatter(1, order, outside)
            logits.index_copy_(0, index, rows.masked_fill(drop, float("-inf")))
        tokens: list[int] = sample_rows(logits, temperature, uniforms).tolist()
        return tokens

    def _emit_token(self, model: LlmModel, job: LlmJob, token: int) -> bool:
        """Count and emit the job's sampled token; whether the answer goes on (it ends at an end-of-answer token,
        at its token limit, or with its slot full)."""
        job.logits = None
        if token in model.tokenizer.eos_ids:
            self._finish(job, "stop")
            return False
        job.tokens += 1
        assert job.decoder is not None
        text = job.decoder.push(token)
        if text:
            self._emit(job, [LlmText(text)])
        limit = min(job.request.max_tokens, self.max_answer_tokens)
        if job.tokens >= limit or model.length(self._slot(job)) >= model.max_context:
            self._finish(job, "length")
            return False
        return True

    @staticmethod
    def _slot(job: LlmJob) -> int:
        assert job.slot is not None
        return job.slot

    def _finish(self, job: LlmJob, reason: LlmStop, error: str | None = None, code: str | None = None) -> None:
        if job.done:
            return
        job.done = True
        if job.slot is not None:
            self._frees += 1
            self._freed_at[job.slot] = self._frees
            self._free_slots.append(job.slot)
            job.slot = None
        job.logits = None
        prompt = len(job.prompt) if job.prompt is not None else 0
        self._emit(job, [LlmDone(reason, job.tokens, prompt, error, code)])

    @staticmethod
    def _emit(job: LlmJob, outputs: list[LlmOutput]) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            job.loop.call_soon_threadsafe(job.sink, outputs)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``limit``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if n >= limit or x != y:
            break
        n += 1
    return n
