"""The live video engine: chunk-causal generation, chunk by chunk, for as long as a stream runs.

Each generation (a live stream, or a clip of ``num_frames``) runs in chunks of latent frames: a few flow steps on
the chunk's noise, each a block-causal forward over the chunk that attends to the stream's KV cache; the clean
chunk goes through the stream's streaming VAE decoder at once and out as one frame group; then one more forward at
timestep 0 writes the clean chunk into the cache (Self-Forcing's order), whose rolling window drops the oldest
chunks. The forwards of all streams that have one to run, at the same size and cache length (every stream once its
window is full), go through the transformer as one batch, whatever step each is at.

A live stream's prompt can change while it runs (:meth:`LiveJob.set_prompt`): the chunk in progress finishes with
the old prompt, the next one is generated with the new (a :class:`PromptUpdated` before its frames), and the cache
is kept, so the scene turns without a cut. A live stream ends when cancelled, or with code ``max_duration`` once it
has generated ``max_live_seconds`` of video.

Admission: the engine's slots, and the memory headroom for every stream's full KV cache window (refused typed, not
queued). Frame credit paces a stream to its consumer as in :class:`VideoEngine`: a chunk starts only once the frames
it makes fit the stream's credit.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
from typing import TYPE_CHECKING

import torch

from omnigate.engines.base import EngineError
from omnigate.engines.video.causal import ChunkKvCache, causal_forward, few_step_sigmas
from omnigate.engines.video.denoise import encode_prompt, to_rgb_frames, vae_latents
from omnigate.engines.video.engine import VideoEngine, VideoJob
from omnigate.engines.video.outputs import FrameGroup, PromptUpdated
from omnigate.engines.video.request import validate_common, validate_prompt, validate_size
from omnigate.engines.video.vae_stream import StreamingVaeDecoder
from omnigate.os_threads import name_os_thread

if TYPE_CHECKING:
    from omnigate.engines.video.model import VideoModel
    from omnigate.engines.video.request import VideoOptions, VideoRequest

log = logging.getLogger(__name__)

# The sampler's flow shift: Self-Forcing's scheduler warps its few timesteps with 5.0.
FLOW_SHIFT = 5.0
# Without a budget, the KV caches of all streams may take this share of the device memory free at start.
CUDA_BUDGET_SHARE = 0.8
CPU_CACHE_BUDGET_BYTES = 4 << 30
LIVE_END_CODE = "max_duration"


class _Stage(enum.Enum):
    ENCODE = "encode"  # the first prompt
    START = "start"  # a chunk begins (waits for credit; takes a new prompt)
    DENOISE = "denoise"  # flow steps on the chunk (batched)
    DECODE = "decode"  # the clean chunk through the VAE
    CACHE = "cache"  # the clean chunk's forward at timestep 0 into the cache (batched)


class LiveJob(VideoJob):
    """A chunk-causal generation: :class:`VideoJob`'s handle, plus prompt changes and the chunk state."""

    def __init__(self, engine: LiveVideoEngine, request: VideoRequest, loop: asyncio.AbstractEventLoop | None) -> None:
        super().__init__(engine, request, loop)
        self.prompt_id = 0  # the latest prompt given (0: the request's)
        self._pending_prompt: tuple[int, str] | None = None
        # Worker state.
        self.stage = _Stage.ENCODE
        self.context: torch.Tensor | None = None
        self.active_prompt = 0
        self.cache = ChunkKvCache(engine.options.cache_frames)
        self.sigmas = few_step_sigmas(request.steps, FLOW_SHIFT)
        self.noise = torch.Generator(device="cpu").manual_seed(request.seed)
        self.chunk_index = 0
        self.chunk_size = 0  # latent frames of the chunk in progress
        self.step = 0
        self.sample: torch.Tensor | None = None  # the chunk's noisy latents, then its clean ones
        self.latents_done = 0
        self.max_frames = (
            math.floor(engine.options.max_live_seconds * request.fps) if request.live else request.num_frames
        )

    def set_prompt(self, prompt: str) -> int:
        """Generate from the next chunk on with ``prompt``; returns its id (a :class:`PromptUpdated` with this id
        says which chunk is the first with it). Raises :class:`EngineError` for a prompt the engine refuses."""
        validate_prompt(prompt, self._engine.options)
        with self._lock:
            if self.finished:
                raise EngineError("no_stream", "the stream has ended")
            self.prompt_id += 1
            self._pending_prompt = (self.prompt_id, prompt)
            self._lock.notify_all()
            return self.prompt_id

    def take_prompt(self) -> tuple[int, str] | None:
        with self._lock:
            pending, self._pending_prompt = self._pending_prompt, None
            return pending

    @property
    def parked(self) -> bool:
        """True while the job waits for its consumer: between chunks, and out of credit."""
        engine = self._engine
        assert isinstance(engine, LiveVideoEngine)
        with self._lock:
            return not self.finished and self.stage is _Stage.START and not engine._can_start(self)

    @property
    def remaining_latents(self) -> int | None:
        """Latent frames still to generate for a clip; None for a live stream."""
        return None if self.request.live else self.latent_frames - self.latents_done

    def _release(self) -> None:
        super()._release()
        self.cache.clear()
        self.sample = None
        self.context = None


class LiveVideoEngine(VideoEngine):
    """Serves chunk-causal generations (live streams and clips) from one model on one worker thread."""

    def __init__(self, model: VideoModel, options: VideoOptions | None = None) -> None:
        super().__init__(model, options)
        self.cache_budget_bytes = self.options.cache_budget_bytes or self._default_budget()
        self.forwards_run = 0
        self.batched_samples = 0
        self.chunks_decoded = 0

    def _default_budget(self) -> int:
        device = torch.device(self.options.device)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * CUDA_BUDGET_SHARE)
        return CPU_CACHE_BUDGET_BYTES

    def cache_bytes(self, request: VideoRequest) -> int:
        """A stream's KV cache at its full window: every layer's keys and values of ``cache_frames`` latent frames,
        plus the chunk being written."""
        config = self.model.transformer.config
        scale = self.model.size_multiple
        tokens = (request.width // scale) * (request.height // scale)
        frames = self.options.cache_frames + request.chunk_frames
        dim = int(config.num_attention_heads) * int(config.attention_head_dim)
        element = torch.finfo(self.model.dtype).bits // 8
        return int(config.num_layers) * 2 * frames * tokens * dim * element

    # ---- requests ---------------------------------------------------------------------------------------------

    def validate(self, request: VideoRequest) -> None:
        options = self.options
        validate_prompt(request.prompt, options)
        validate_size(request, self.model.size_multiple)
        if request.width * request.height > options.max_frame_pixels:
            raise EngineError(
                "too_large",
                f"width x height = {request.width * request.height} exceeds this server's limit of "
                f"{options.max_frame_pixels}",
                "width",
            )
        if not 1 <= request.chunk_frames <= options.max_chunk_frames:
            raise EngineError(
                "invalid_value", f"chunk_frames must be within 1..{options.max_chunk_frames}", "chunk_frames"
            )
        if not 1 <= request.steps <= options.max_chunk_steps:
            raise EngineError("invalid_value", f"steps must be within 1..{options.max_chunk_steps}", "steps")
        if request.guidance_scale > 1.0:
            raise EngineError(
                "invalid_value",
                "this chunk-causal model runs without classifier-free guidance (guidance_scale at most 1)",
                "guidance_scale",
            )
        validate_common(request, options)
        if not request.live:
            scale = self.model.temporal_scale
            if request.num_frames < 1 or (request.num_frames - 1) % scale:
                raise EngineError(
                    "invalid_frames", f"num_frames must be 1 + {scale}k; got {request.num_frames}", "num_frames"
                )
            if request.pixels > options.max_video_pixels:
                raise EngineError(
                    "too_large",
                    f"width x height x num_frames = {request.pixels} exceeds this server's limit of "
                    f"{options.max_video_pixels}",
                    "num_frames",
                )

    def _new_job(self, request: VideoRequest, loop: asyncio.AbstractEventLoop | None) -> VideoJob:
        reserved = sum(self.cache_bytes(job.request) for job in self._jobs)
        needed = self.cache_bytes(request)
        if reserved + needed > self.cache_budget_bytes:
            raise EngineError(
                "server_busy",
                f"no memory headroom for another stream's KV cache ({needed} bytes; {reserved} of "
                f"{self.cache_budget_bytes} reserved)",
            )
        return LiveJob(self, request, loop)

    # ---- the worker thread ------------------------------------------------------------------------------------

    def _chunk_video_frames(self, job: LiveJob, size: int) -> int:
        """Video frames a chunk of ``size`` latent frames decodes to."""
        first = 1 if job.latents_done == 0 else 0
        return size * self.model.temporal_scale - first * (self.model.temporal_scale - 1)

    def _next_chunk_size(self, job: LiveJob) -> int:
        remaining = job.remaining_latents
        return job.request.chunk_frames if remaining is None else min(job.request.chunk_frames, remaining)

    def _can_start(self, job: LiveJob) -> bool:
        needed = self._chunk_video_frames(job, self._next_chunk_size(job))
        return job.in_flight == 0 or job.in_flight + needed <= self.options.max_frames_in_flight

    def _pick(self) -> tuple[LiveJob | None, list[LiveJob]]:
        """A job with single work to do (cancel, encode, start, decode), else a batch of forwards (lock held)."""
        jobs = [job for job in self._jobs if isinstance(job, LiveJob)]
        count = len(jobs)
        order = [jobs[(self._cursor + i) % count] for i in range(count)] if count else []
        for job in order:
            ready = job.stage is _Stage.START and self._can_start(job)
            if ready or job.cancel_requested or job.stage in (_Stage.ENCODE, _Stage.DECODE):
                self._cursor += 1
                return job, []
        forward = [job for job in order if job.stage in (_Stage.DENOISE, _Stage.CACHE)]
        if not forward:
            return None, []
        self._cursor += 1
        key = self._batch_key(forward[0])
        return None, [job for job in forward if self._batch_key(job) == key]

    @staticmethod
    def _batch_key(job: LiveJob) -> tuple[int, int, int, int]:
        """Forwards batch when their chunks and caches have the same shapes."""
        return job.request.width, job.request.height, job.chunk_size, job.cache.frames

    def _run(self) -> None:
        name_os_thread()
        with torch.inference_mode():
            while True:
                with self._cond:
                    single, batch = self._pick()
                    while single is None and not batch:
                        if self._stopping and not self._jobs:
                            return
                        self._cond.wait()
                        single, batch = self._pick()
                work = [single] if single is not None else batch
                try:
                    if single is not None:
                        if single.cancel_requested:
                            self._finish(single, "cancelled", "shutting_down" if self._stopping else None)
                        else:
                            self._advance_one(single)
                    else:
                        self._forward(batch)
                except torch.OutOfMemoryError:
                    log.warning("a live video step ran out of device memory")
                    for job in work:
                        self._finish(job, "error", "out_of_memory", "the generation ran out of device memory")
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                except Exception as exc:
                    log.exception("live video generation failed")
                    for job in work:
                        self._finish(job, "error", "engine_error", f"{type(exc).__name__}: {exc}")

    def _advance_one(self, job: LiveJob) -> None:
        model = self.model
        if job.stage is _Stage.ENCODE:
            job.context = encode_prompt(model, job.request.prompt)
            job.decoder = StreamingVaeDecoder(model.vae, self.tiling)
            self.prompts_encoded += 1
            job.stage = _Stage.START
            with self._cond:
                job._record("encoded", 0)
        elif job.stage is _Stage.START:
            pending = job.take_prompt()
            if pending is not None:
                prompt_id, prompt = pending
                job.context = encode_prompt(model, prompt)
                job.active_prompt = prompt_id
                self.prompts_encoded += 1
                with self._cond:
                    job._emit(PromptUpdated(prompt_id=prompt_id, chunk_index=job.chunk_index))
            job.chunk_size = self._next_chunk_size(job)
            scale = model.spatial_scale
            shape = (1, model.latent_channels, job.chunk_size, job.request.height // scale, job.request.width // scale)
            job.sample = torch.randn(shape, generator=job.noise, dtype=torch.float32).to(model.device)
            job.step = 0
            job.stage = _Stage.DENOISE
        else:
            self._decode(job)

    def _decode(self, job: LiveJob) -> None:
        assert job.decoder is not None and job.sample is not None
        video = job.decoder.decode(vae_latents(self.model, job.sample))
        frames = to_rgb_frames(video)
        limit = job.max_frames - job.frames_out
        ended = frames.shape[0] >= limit
        frames = frames[:limit]
        self.chunks_decoded += 1
        self.latent_frames_decoded += job.chunk_size
        with self._cond:
            job._record("decoded", job.chunk_index)
            job.in_flight += frames.shape[0]
            job._emit(
                FrameGroup(
                    latent_index=job.latents_done,
                    first_frame=job.frames_out,
                    frames=frames,
                    chunk_index=job.chunk_index,
                    prompt_id=job.active_prompt,
                )
            )
            job.frames_out += frames.shape[0]
        job.latents_done += job.chunk_size
        if job.request.live:
            job.latent_frames = job.latents_done
        if ended:
            self._finish(job, "completed", LIVE_END_CODE if job.request.live else None)
            return
        job.stage = _Stage.CACHE

    def _forward(self, batch: list[LiveJob]) -> None:
        """One batched transformer forward: a flow step for denoising jobs, the cache write for clean ones."""
        model = self.model
        samples: list[torch.Tensor] = []
        timesteps: list[float] = []
        for job in batch:
            assert job.sample is not None
            samples.append(job.sample)
            timesteps.append(0.0 if job.stage is _Stage.CACHE else job.sigmas[job.step] * 1000.0)
        frames = batch[0].chunk_size
        latents = torch.cat(samples)
        times = torch.tensor(timesteps, device=model.device).view(-1, 1).expand(-1, frames)
        contexts = [job.context for job in batch if job.context is not None]
        flow, new_kv = causal_forward(
            model.transformer, latents, times, torch.cat(contexts), [job.cache for job in batch]
        )
        self.forwards_run += 1
        self.batched_samples += len(batch)
        for row, job in enumerate(batch):
            if job.stage is _Stage.CACHE:
                job.cache.append([(k[row : row + 1], v[row : row + 1]) for k, v in new_kv], job.chunk_size)
                job.chunk_index += 1
                job.stage = _Stage.START
                continue
            assert job.sample is not None
            sigma = job.sigmas[job.step]
            clean = job.sample - sigma * flow[row : row + 1].float()
            job.step += 1
            self.steps_run += 1
            with self._cond:
                job._record("step", job.step)
            if job.step < len(job.sigmas):
                following = job.sigmas[job.step]
                noise = torch.randn(clean.shape, generator=job.noise, dtype=torch.float32).to(clean.device)
                job.sample = (1.0 - following) * clean + following * noise
            else:
                job.sample = clean
                job.stage = _Stage.DECODE
        with self._cond:
            self._cond.notify_all()
