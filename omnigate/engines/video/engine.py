"""The video engine: text-to-video generations on one model instance, streamed out one latent frame at a time.

One worker thread owns the model (it is not re-entrant) and serves up to ``max_sessions`` generations, one piece of
work at a time in turn: a prompt encoding, one denoising step, or the VAE decode of one latent frame. So a new
generation starts while others run, and :meth:`VideoJob.cancel` takes effect at the next piece of work.

Decoded frames are credit-limited: a generation may have at most ``max_frames_in_flight`` frames handed out and
not yet reported consumed (:meth:`VideoJob.consumed`); beyond that its decoding waits, and the worker serves the
others. A consumer that stops reading therefore stops its own decoding and holds bounded memory.

Requests are checked in full before anything runs (sizes, frame rule, the width x height x frames cap), and a
generation over the slot count is refused, not queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import secrets
import threading
import time
from collections import deque
from typing import Any

import msgspec
import torch

from omnigate.engines.base import EngineError
from omnigate.engines.video.denoise import Denoiser, encode_prompt, initial_latents, to_rgb_frames
from omnigate.engines.video.model import VideoModel, load_video_model
from omnigate.engines.video.outputs import (
    FrameGroup,
    TimelineEvent,
    TimelineKind,
    VideoDone,
    VideoOutput,
    VideoStatus,
)
from omnigate.engines.video.request import VideoOptions, VideoRequest, validate_request
from omnigate.engines.video.vae_stream import StreamingVaeDecoder, VaeTiling
from omnigate.os_threads import name_os_thread

log = logging.getLogger(__name__)

FAMILY = "video"


class VideoEngineInfo(msgspec.Struct, frozen=True):
    """Static facts about a loaded video engine."""

    family: str
    model: str
    random_weights: bool
    max_sessions: int
    max_frames_in_flight: int
    max_video_pixels: int
    size_multiple: int
    temporal_scale: int
    default_width: int
    default_height: int
    default_num_frames: int
    default_fps: int
    default_steps: int


class _Phase(enum.Enum):
    ENCODE = "encode"
    DENOISE = "denoise"
    DECODE = "decode"


class VideoJob:
    """One generation: the consumer's handle (outputs, credit, cancel) and the worker's working state.

    Outputs are read with :meth:`next_output` (asyncio; the job was submitted with a loop) or :meth:`wait_output`
    (blocking). They are bounded by the credit: at most ``max_frames_in_flight`` frames, plus the final
    :class:`VideoDone`.
    """

    def __init__(self, engine: VideoEngine, request: VideoRequest, loop: asyncio.AbstractEventLoop | None) -> None:
        self.request = request
        self.latent_frames = engine.model.latent_frames(request.num_frames)
        self._engine = engine
        self._lock = engine._cond
        self._loop = loop
        self._ready = asyncio.Event() if loop is not None else None
        self._outputs: deque[VideoOutput] = deque()
        self._timeline: list[TimelineEvent] = []
        self.frames_out = 0
        self.in_flight = 0
        self.cancel_requested = False
        self.finished = False
        # The worker's state; only the worker thread touches these.
        self.phase = _Phase.ENCODE
        self.denoiser: Denoiser | None = None
        self.vae_latents: torch.Tensor | None = None
        self.decoder: StreamingVaeDecoder | None = None
        self.next_latent = 0

    # ---- the consumer's side ----------------------------------------------------------------------------------

    def cancel(self) -> None:
        """Stop at the next piece of work; a :class:`VideoDone` with status ``cancelled`` follows. Idempotent."""
        with self._lock:
            if not self.finished:
                self.cancel_requested = True
                self._lock.notify_all()

    def consumed(self, frames: int) -> None:
        """Report ``frames`` handed-out frames as done with (sent): their credit returns to the decoder."""
        with self._lock:
            self.in_flight = max(0, self.in_flight - frames)
            self._record("consumed", frames)
            self._lock.notify_all()

    def poll(self) -> VideoOutput | None:
        """The next output if one is ready."""
        with self._lock:
            return self._outputs.popleft() if self._outputs else None

    def wait_output(self, timeout: float | None = None) -> VideoOutput:
        """Block until the next output; raises TimeoutError."""
        with self._lock:
            if not self._lock.wait_for(lambda: bool(self._outputs), timeout):
                raise TimeoutError("no video output within the timeout")
            return self._outputs.popleft()

    async def next_output(self) -> VideoOutput:
        """Await the next output (the job must have been submitted with ``loop``)."""
        ready = self._ready
        if ready is None:
            raise RuntimeError("this job was submitted without an event loop; use wait_output")
        while True:
            with self._lock:
                if self._outputs:
                    return self._outputs.popleft()
                # Cleared under the lock: an output appended after this schedules a fresh set().
                ready.clear()
            await ready.wait()

    @property
    def timeline(self) -> tuple[TimelineEvent, ...]:
        with self._lock:
            return tuple(self._timeline)

    @property
    def parked(self) -> bool:
        """True while the job waits for its consumer: decoding, and out of credit."""
        with self._lock:
            return not self.finished and self.phase is _Phase.DECODE and not self._engine._has_credit(self)

    # ---- the worker's side (lock held) ------------------------------------------------------------------------

    def _record(self, kind: TimelineKind, index: int) -> None:
        self._timeline.append(TimelineEvent(kind, index, time.perf_counter()))

    def _emit(self, output: VideoOutput) -> None:
        self._outputs.append(output)
        self._lock.notify_all()
        if self._loop is not None and self._ready is not None:
            # A closed loop means nobody is left to read.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._ready.set)

    def _release(self) -> None:
        """Drop the tensors and decoder caches this generation holds."""
        if self.decoder is not None:
            self.decoder.close()
        self.decoder = None
        self.denoiser = None
        self.vae_latents = None


class VideoEngine:
    """Serves text-to-video generations from one :class:`VideoModel` on one worker thread."""

    def __init__(self, model: VideoModel, options: VideoOptions | None = None) -> None:
        self.model = model
        self.options = options or VideoOptions()
        tile = self.options.vae_tile
        self.tiling = (
            VaeTiling(tile=tile, stride=self.options.vae_tile_stride or tile * 3 // 4) if tile is not None else None
        )
        defaults = model.defaults
        self.info = VideoEngineInfo(
            family=FAMILY,
            model=model.name,
            random_weights=model.random_weights,
            max_sessions=self.options.max_sessions,
            max_frames_in_flight=self.options.max_frames_in_flight,
            max_video_pixels=self.options.max_video_pixels,
            size_multiple=model.size_multiple,
            temporal_scale=model.temporal_scale,
            default_width=defaults.width,
            default_height=defaults.height,
            default_num_frames=defaults.num_frames,
            default_fps=defaults.fps,
            default_steps=defaults.steps,
        )
        self._cond = threading.Condition()
        self._jobs: list[VideoJob] = []
        self._cursor = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._negative_embeds: torch.Tensor | None = None
        # Work counters (written by the worker thread only).
        self.prompts_encoded = 0
        self.steps_run = 0
        self.latent_frames_decoded = 0
        self.finished_total: dict[VideoStatus, int] = {"completed": 0, "cancelled": 0, "error": 0}

    @classmethod
    def load(cls, model: str | None, **options: Any) -> VideoEngine:
        """Build from a model spec (``preset:NAME``, a Diffusers directory, a Self-Forcing checkpoint) and string or
        typed options; a chunk-causal model gets a :class:`~omnigate.engines.video.live.LiveVideoEngine`."""
        try:
            parsed = msgspec.convert(options, VideoOptions, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid video option: {exc}") from None
        loaded = load_video_model(
            model,
            device=parsed.device,
            dtype=parsed.dtype,
            vae_dtype=parsed.vae_dtype,
            seed=parsed.seed,
            max_sequence_length=parsed.max_sequence_length,
            causal_base=parsed.causal_base,
            checkpoint_key=parsed.checkpoint_key,
        )
        if loaded.causal:
            # Imported here: the live engine builds on this module.
            from omnigate.engines.video.live import LiveVideoEngine

            return LiveVideoEngine(loaded, parsed)
        return cls(loaded, parsed)

    # ---- requests ---------------------------------------------------------------------------------------------

    def resolve(
        self,
        prompt: str,
        *,
        width: int | None = None,
        height: int | None = None,
        num_frames: int | None = None,
        fps: int | None = None,
        steps: int | None = None,
        seed: int | None = None,
        guidance_scale: float | None = None,
        live: bool = False,
        chunk_frames: int | None = None,
    ) -> VideoRequest:
        """A request with the model's defaults for what is not given (a random seed if none); a live one has no
        frame count."""
        defaults = self.model.defaults
        return VideoRequest(
            prompt=prompt,
            live=live,
            chunk_frames=defaults.chunk_frames if chunk_frames is None else chunk_frames,
            width=defaults.width if width is None else width,
            height=defaults.height if height is None else height,
            num_frames=0 if live else defaults.num_frames if num_frames is None else num_frames,
            fps=defaults.fps if fps is None else fps,
            steps=defaults.steps if steps is None else steps,
            seed=secrets.randbelow(2**31) if seed is None else seed,
            guidance_scale=defaults.guidance_scale if guidance_scale is None else guidance_scale,
        )

    def validate(self, request: VideoRequest) -> None:
        """Raise :class:`EngineError` for a request this engine must refuse."""
        validate_request(
            request, self.options, size_multiple=self.model.size_multiple, temporal_scale=self.model.temporal_scale
        )

    def submit(self, request: VideoRequest, *, loop: asyncio.AbstractEventLoop | None = None) -> VideoJob:
        """Validate, take a slot and queue the generation. Raises :class:`EngineError` (nothing runs then)."""
        self.validate(request)
        with self._cond:
            if self._stopping:
                raise EngineError("shutting_down", "the video engine is shutting down")
            if len(self._jobs) >= self.options.max_sessions:
                raise EngineError("server_busy", f"all {self.options.max_sessions} video generation slots are in use")
            job = self._new_job(request, loop)
            job._record("admitted", 0)
            self._jobs.append(job)
            self._cond.notify_all()
        return job

    def _new_job(self, request: VideoRequest, loop: asyncio.AbstractEventLoop | None) -> VideoJob:
        """The job of an admitted request (lock held); raises :class:`EngineError` to refuse it."""
        return VideoJob(self, request, loop)

    @property
    def active(self) -> int:
        """Generations holding a slot."""
        with self._cond:
            return len(self._jobs)

    @property
    def free_slots(self) -> int:
        with self._cond:
            return self.options.max_sessions - len(self._jobs)

    # ---- the worker thread ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        with self._cond:
            if self._thread is not None:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="omnigate-video", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Cancel every generation (each ends with ``shutting_down``) and join the worker. Blocks."""
        with self._cond:
            self._stopping = True
            for job in self._jobs:
                job.cancel_requested = True
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)

    def _group_size(self, latent_index: int) -> int:
        return 1 if latent_index == 0 else self.model.temporal_scale

    def _has_credit(self, job: VideoJob) -> bool:
        needed = self._group_size(job.next_latent)
        return job.in_flight == 0 or job.in_flight + needed <= self.options.max_frames_in_flight

    def _next_runnable(self) -> VideoJob | None:
        """The next job, in turn, that can make progress (lock held)."""
        count = len(self._jobs)
        for offset in range(count):
            position = (self._cursor + offset) % count
            job = self._jobs[position]
            if job.cancel_requested or job.phase is not _Phase.DECODE or self._has_credit(job):
                self._cursor = position + 1
                return job
        return None

    def _run(self) -> None:
        name_os_thread()
        with torch.inference_mode():
            while True:
                with self._cond:
                    job = self._next_runnable()
                    while job is None:
                        if self._stopping and not self._jobs:
                            return
                        self._cond.wait()
                        job = self._next_runnable()
                if job.cancel_requested:
                    self._finish(job, "cancelled", "shutting_down" if self._stopping else None)
                    continue
                try:
                    self._advance(job)
                except torch.OutOfMemoryError:
                    log.warning("a video generation ran out of device memory")
                    self._finish(job, "error", "out_of_memory", "the generation ran out of device memory")
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                except Exception as exc:
                    log.exception("video generation failed")
                    self._finish(job, "error", "engine_error", f"{type(exc).__name__}: {exc}")

    def _advance(self, job: VideoJob) -> None:
        """One piece of work for ``job``."""
        model, request = self.model, job.request
        if job.phase is _Phase.ENCODE:
            guided = request.guidance_scale > 1.0
            job.denoiser = Denoiser(
                model,
                initial_latents(
                    model, width=request.width, height=request.height, num_frames=request.num_frames, seed=request.seed
                ),
                encode_prompt(model, request.prompt),
                self._negative() if guided else None,
                steps=request.steps,
                guidance_scale=request.guidance_scale,
            )
            job.phase = _Phase.DENOISE
            self.prompts_encoded += 1
            with self._cond:
                job._record("encoded", 0)
        elif job.phase is _Phase.DENOISE:
            assert job.denoiser is not None
            job.denoiser.step()
            self.steps_run += 1
            with self._cond:
                job._record("step", job.denoiser.steps_done)
            if job.denoiser.done:
                job.vae_latents = job.denoiser.vae_latents()
                job.denoiser = None
                job.decoder = StreamingVaeDecoder(model.vae, self.tiling)
                job.phase = _Phase.DECODE
        else:
            assert job.decoder is not None and job.vae_latents is not None
            index = job.next_latent
            frames = to_rgb_frames(job.decoder.decode(job.vae_latents[:, :, index : index + 1]))
            job.next_latent += 1
            self.latent_frames_decoded += 1
            with self._cond:
                job._record("decoded", index)
                job.in_flight += frames.shape[0]
                job._emit(FrameGroup(latent_index=index, first_frame=job.frames_out, frames=frames))
                job.frames_out += frames.shape[0]
            if job.next_latent == job.latent_frames:
                self._finish(job, "completed")

    def _negative(self) -> torch.Tensor:
        """The empty negative prompt's embeddings: the same for every guided generation, so encoded once."""
        if self._negative_embeds is None:
            self._negative_embeds = encode_prompt(self.model, "")
        return self._negative_embeds

    def _finish(self, job: VideoJob, status: VideoStatus, code: str | None = None, error: str | None = None) -> None:
        """Free the generation's memory and slot, then hand out its one :class:`VideoDone`."""
        job._release()
        self.finished_total[status] += 1
        with self._cond:
            if job in self._jobs:
                self._jobs.remove(job)
            job.finished = True
            job._record("done", job.frames_out)
            job._emit(
                VideoDone(
                    status=status,
                    frames=job.frames_out,
                    latent_frames=job.latent_frames,
                    timeline=tuple(job._timeline),
                    code=code,
                    error=error,
                )
            )
