"""The live video engine: chunk-causal generation, chunk by chunk, for as long as a stream runs.

Each generation (a live stream, or a clip of ``num_frames``) runs in chunks of latent frames: a few flow steps on
the chunk's noise, each a block-causal forward over the chunk that attends to the stream's KV cache; the clean
chunk goes through the stream's streaming VAE decoder at once and out as one frame group; then one more forward at
timestep 0 writes the clean chunk into the cache (Self-Forcing's order), whose rolling window drops the oldest
chunks. The forwards of all streams that have one to run, at the same size and cache length (every stream once its
window is full), go through the transformer as one batch, whatever step each is at.

By default each clean chunk is decoded on the worker, in line. With ``overlap_decode=true`` the VAE decode of a clean
chunk runs on a decode thread (with its own CUDA stream on a GPU) while the worker goes on with the chunk's cache
forward and the next chunk's steps: a chunk costs the longer of the two where they do not share the device's compute
(on the H200 they do, and the serial path is faster).
Each stream has at most one chunk handed to the decode thread and not yet out, so the hand-over is bounded; the
decode thread decodes the handed chunks of several streams in one batched VAE call where their shapes match.
A single stream's frames are the same bit for bit either way.

A live stream's prompt can change while it runs (:meth:`LiveJob.set_prompt`): it applies from the stream's next
denoising step, also mid-chunk, and a clean chunk still waiting for the VAE runs its last step again under it (the
same input: exactly as if the prompt had come before that step). Self-Forcing's few steps each predict the clean
chunk afresh from a sample that is still mostly noise (sigma >= 0.625 at its 4 shifted steps), and a forward takes
the text through cross-attention only, so a step under the new prompt steers that chunk towards it; the cache of
earlier chunks is kept, so the scene turns without a cut. A :class:`PromptUpdated` (before that chunk's frames)
names the chunk and its first step under the new prompt (step 0: the whole chunk); the chunk's cache forward uses
it too. A live stream ends when cancelled, or with code ``max_duration`` once it has generated
``max_live_seconds`` of video.

Admission: the engine's slots, and the memory headroom for every stream's full KV cache window (refused typed, not
queued). Frame credit paces a stream to its consumer as in :class:`VideoEngine`: a chunk is decoded only once its
frames fit the stream's credit, and a stream denoises at most one chunk past the one waiting for credit.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch

from omnigate.engines.base import EngineError
from omnigate.engines.video.causal import ChunkKvCache, causal_forward, few_step_sigmas
from omnigate.engines.video.denoise import encode_prompt, to_rgb_frames, vae_latents
from omnigate.engines.video.engine import VideoEngine, VideoJob
from omnigate.engines.video.outputs import FrameGroup, PromptUpdated, VideoOutput
from omnigate.engines.video.request import validate_common, validate_prompt, validate_size
from omnigate.engines.video.vae_stream import StreamingVaeDecoder, decode_together
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
    START = "start"  # a chunk begins: its noise
    DENOISE = "denoise"  # flow steps on the chunk (batched)
    DECODE = "decode"  # the clean chunk waits to be handed to the VAE decode
    CACHE = "cache"  # the clean chunk's forward at timestep 0 into the cache (batched)
    LAST = "last"  # the last chunk is handed over: the stream ends once it is out


@dataclass(eq=False)
class _Chunk:
    """A clean chunk handed to the VAE decode: what its frames are handed out with."""

    job: LiveJob
    latents: torch.Tensor
    index: int
    prompt_id: int
    latent_index: int
    ready: torch.cuda.Event | None  # recorded on the worker's stream after the latents were written
    decoding: bool = False
    then: list[VideoOutput] = field(default_factory=list)  # outputs to hand out right after its frames


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
        self.last_input: torch.Tensor | None = None  # the input of the chunk's last step, until it is handed over
        self.latents_done = 0  # latent frames denoised and handed to the decode
        self.frames_handed = 0  # the video frames they decode to
        # Shared with the decode thread (under the engine's lock).
        self.handed: _Chunk | None = None  # the chunk handed over and not yet out
        self.failure: tuple[str, str] | None = None  # (code, message) the worker ends it with
        self.max_frames = (
            math.floor(engine.options.max_live_seconds * request.fps) if request.live else request.num_frames
        )

    def set_prompt(self, prompt: str) -> int:
        """Generate from the next denoising step on with ``prompt``; returns its id (a :class:`PromptUpdated` with
        this id says which chunk and step are the first with it). Raises :class:`EngineError` for a prompt the
        engine refuses."""
        validate_prompt(prompt, self._engine.options)
        with self._lock:
            if self.finished:
                raise EngineError("no_stream", "the stream has ended")
            self.prompt_id += 1
            self._pending_prompt = (self.prompt_id, prompt)
            self._lock.notify_all()
            return self.prompt_id

    @property
    def prompt_pending(self) -> bool:
        """Whether a new prompt waits for the next denoising step."""
        with self._lock:
            return self._pending_prompt is not None

    def take_prompt(self) -> tuple[int, str] | None:
        with self._lock:
            pending, self._pending_prompt = self._pending_prompt, None
            return pending

    @property
    def parked(self) -> bool:
        """True while the job waits for its consumer: a clean chunk out of credit, and nothing else to do."""
        engine = self._engine
        assert isinstance(engine, LiveVideoEngine)
        with self._lock:
            if self.finished or self.stage not in (_Stage.DECODE, _Stage.LAST):
                return False
            handed = self.handed
            if handed is None:  # decodes in line wait for credit before the hand-over
                overlapped = engine.options.overlap_decode
                return (
                    self.stage is _Stage.DECODE
                    and not overlapped
                    and not engine._has_chunk_credit(engine._chunk_of(self))
                )
            return not handed.decoding and not engine._has_chunk_credit(handed)

    @property
    def remaining_latents(self) -> int | None:
        """Latent frames still to generate for a clip; None for a live stream."""
        return None if self.request.live else self.latent_frames - self.latents_done

    def _release(self) -> None:
        super()._release()
        self.cache.clear()
        self.sample = None
        self.context = None
        self.last_input = None
        self.handed = None


class LiveVideoEngine(VideoEngine):
    """Serves chunk-causal generations (live streams and clips) from one model on one worker thread."""

    def __init__(self, model: VideoModel, options: VideoOptions | None = None) -> None:
        super().__init__(model, options)
        self.cache_budget_bytes = self.options.cache_budget_bytes or self._default_budget()
        self.forwards_run = 0
        self.batched_samples = 0
        self.chunks_decoded = 0
        self.decode_calls = 0  # VAE calls: fewer than chunks_decoded when streams' chunks were decoded together
        self._decode_thread: threading.Thread | None = None
        self._decode_dead = False

    def _default_budget(self) -> int:
        device = torch.device(self.options.device)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * CUDA_BUDGET_SHARE)
        return CPU_CACHE_BUDGET_BYTES

    def cache_bytes(self, request: VideoRequest) -> int:
        """A stream's KV cache at its full window: every layer's keys, rotated keys and values of ``cache_frames``
        latent frames, plus the chunk being written."""
        config = self.model.transformer.config
        scale = self.model.size_multiple
        tokens = (request.width // scale) * (request.height // scale)
        frames = 3 * self.options.cache_frames + 2 * request.chunk_frames
        dim = int(config.num_attention_heads) * int(config.attention_head_dim)
        element = torch.finfo(self.model.dtype).bits // 8
        return int(config.num_layers) * frames * tokens * dim * element

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

    def start(self) -> None:
        """Start the worker thread, and the decode thread unless decodes run in line (idempotent)."""
        super().start()
        with self._cond:
            if self.options.overlap_decode and self._decode_thread is None:
                self._decode_dead = False
                self._decode_thread = threading.Thread(target=self._run_decode, name="omnigate-video-vae", daemon=True)
                self._decode_thread.start()

    def stop(self, timeout: float | None = None) -> None:
        super().stop(timeout)
        with self._cond:
            thread, self._decode_thread = self._decode_thread, None
            self._cond.notify_all()
        if thread is not None:
            thread.join(timeout)

    def _video_frames(self, size: int, first: bool) -> int:
        """Video frames a chunk of ``size`` latent frames decodes to (the first latent frame of a video gives one)."""
        scale = self.model.temporal_scale
        return size * scale - (scale - 1 if first else 0)

    def _next_chunk_size(self, job: LiveJob) -> int:
        remaining = job.remaining_latents
        return job.request.chunk_frames if remaining is None else min(job.request.chunk_frames, remaining)

    def _has_chunk_credit(self, chunk: _Chunk) -> bool:
        """Whether the chunk's frames fit its stream's credit (lock held)."""
        job = chunk.job
        needed = self._chunk_frames_out(chunk)
        return job.in_flight == 0 or job.in_flight + needed <= self.options.max_frames_in_flight

    def _chunk_frames_out(self, chunk: _Chunk) -> int:
        """Frames the chunk hands out: what it decodes to, cut at the stream's end."""
        job = chunk.job
        frames = self._video_frames(int(chunk.latents.shape[2]), chunk.latent_index == 0)
        return min(frames, job.max_frames - job.frames_out)

    def _ready(self, job: LiveJob) -> bool:
        """Whether the job has single work the worker can do now (lock held)."""
        handed = job.handed
        if job.cancel_requested or job.failure is not None:
            return handed is None or not handed.decoding  # a chunk being decoded is waited for
        if job.stage in (_Stage.ENCODE, _Stage.START):
            return True
        if job.stage is _Stage.LAST:
            return handed is None
        if job.stage is _Stage.DECODE:
            if job.prompt_pending:
                return True  # its last step again, under the new prompt
            if handed is not None:
                return False
            if self.options.overlap_decode:
                return True
            assert job.sample is not None
            return self._has_chunk_credit(self._chunk_of(job))
        return False

    def _pick(self) -> tuple[LiveJob | None, list[LiveJob]]:
        """A job with single work to do (cancel, encode, start, hand over), else a batch of forwards (lock held)."""
        jobs = [job for job in self._jobs if isinstance(job, LiveJob)]
        count = len(jobs)
        order = [jobs[(self._cursor + i) % count] for i in range(count)] if count else []
        for job in order:
            if self._ready(job):
                self._cursor += 1
                return job, []
        forward = [
            job
            for job in order
            if job.stage in (_Stage.DENOISE, _Stage.CACHE) and not job.cancel_requested and job.failure is None
        ]
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
                        if single.failure is not None:
                            self._finish(single, "error", *single.failure)
                        elif single.cancel_requested:
                            self._finish(single, "cancelled", "shutting_down" if self._stopping else None)
                        else:
                            self._advance_one(single)
                    else:
                        self._forward(batch)
                except torch.OutOfMemoryError:
                    log.warning("a live video step ran out of device memory")
                    self._fail(work, "out_of_memory", "the generation ran out of device memory")
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                except Exception as exc:
                    log.exception("live video generation failed")
                    self._fail(work, "engine_error", f"{type(exc).__name__}: {exc}")

    def _fail(self, jobs: list[LiveJob], code: str, message: str) -> None:
        """End the jobs with an error once no chunk of theirs is being decoded (the worker finishes them)."""
        with self._cond:
            for job in jobs:
                job.failure = job.failure or (code, message)
            self._cond.notify_all()

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
            job.chunk_size = self._next_chunk_size(job)
            scale = model.spatial_scale
            shape = (1, model.latent_channels, job.chunk_size, job.request.height // scale, job.request.width // scale)
            job.sample = torch.randn(shape, generator=job.noise, dtype=torch.float32).to(model.device)
            job.step = 0
            job.stage = _Stage.DENOISE
        elif job.stage is _Stage.LAST:
            self._finish(job, "completed", LIVE_END_CODE if job.request.live else None)
        elif job.prompt_pending and job.last_input is not None:
            # A clean chunk still waiting for the VAE is not out yet: a new prompt reruns its last step (the same
            # input, no noise drawn), exactly as if the prompt had come just before that step.
            job.sample, job.step, job.stage = job.last_input, len(job.sigmas) - 1, _Stage.DENOISE
        else:
            self._hand_over(job)

    def _chunk_of(self, job: LiveJob) -> _Chunk:
        assert job.sample is not None
        return _Chunk(job, job.sample, job.chunk_index, job.active_prompt, job.latents_done, None)

    def _hand_over(self, job: LiveJob) -> None:
        """The clean chunk to the VAE: to the decode thread, or decoded here in line; then its cache forward."""
        chunk = self._chunk_of(job)
        if chunk.latents.is_cuda:
            chunk.ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            chunk.ready.record()
        frames = self._video_frames(job.chunk_size, job.latents_done == 0)
        job.latents_done += job.chunk_size
        job.frames_handed += frames
        job.last_input = None
        ended = job.frames_handed >= job.max_frames
        job.stage = _Stage.LAST if ended else _Stage.CACHE
        in_line = not self.options.overlap_decode
        with self._cond:
            job.handed = chunk
            chunk.decoding = in_line
            if self._decode_dead and not in_line:
                job.failure = ("engine_error", "the video decode thread has stopped")
            self._cond.notify_all()
        if in_line:
            self._decode([chunk])

    def _take_prompt(self, job: LiveJob) -> None:
        """A prompt given since the last step applies from this step on."""
        pending = job.take_prompt()
        if pending is None:
            return
        prompt_id, prompt = pending
        job.context = encode_prompt(self.model, prompt)
        job.active_prompt = prompt_id
        self.prompts_encoded += 1
        update = PromptUpdated(prompt_id=prompt_id, chunk_index=job.chunk_index, step=job.step)
        with self._cond:
            if job.handed is not None:
                job.handed.then.append(update)  # after the earlier chunk's frames, as they were made
            else:
                job._emit(update)

    # ---- the decode thread ------------------------------------------------------------------------------------

    def _decodable(self) -> list[_Chunk]:
        """Handed chunks with credit, the first one's and those that decode together with it (lock held)."""
        ready = [
            job.handed
            for job in self._jobs
            if isinstance(job, LiveJob)
            and job.handed is not None
            and not job.handed.decoding
            and not job.cancel_requested
            and job.failure is None
            and self._has_chunk_credit(job.handed)
        ]
        if not ready:
            return []
        key = self._decode_key(ready[0])
        return [chunk for chunk in ready if self._decode_key(chunk) == key]

    @staticmethod
    def _decode_key(chunk: _Chunk) -> tuple[int, ...]:
        """Chunks decode in one VAE call when their latents and their decoders' cache layouts match."""
        decoder = chunk.job.decoder
        assert decoder is not None
        return (*chunk.latents.shape[2:], min(decoder.latent_frames_decoded, 2))

    def _run_decode(self) -> None:
        name_os_thread()
        device = torch.device(self.options.device)
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        try:
            with torch.inference_mode(), torch.cuda.stream(stream):
                while True:
                    with self._cond:
                        chunks = self._decodable()
                        while not chunks:
                            if self._decode_thread is None or (self._stopping and not self._jobs):
                                return
                            self._cond.wait()
                            chunks = self._decodable()
                        for chunk in chunks:
                            chunk.decoding = True
                    self._decode(chunks)
        finally:
            # Whatever ended this thread, no stream may wait on it: their handed chunks fail, typed.
            with self._cond:
                self._decode_dead = True
                for job in self._jobs:
                    if isinstance(job, LiveJob) and job.handed is not None:
                        job.handed.decoding = False
                        job.failure = job.failure or ("engine_error", "the video decode thread has stopped")
                self._cond.notify_all()

    def _decode(self, chunks: list[_Chunk]) -> None:
        """Decode the chunks in one VAE call and hand out their frames; a failure ends their streams typed."""
        try:
            for chunk in chunks:
                if chunk.ready is not None:
                    torch.cuda.current_stream().wait_event(chunk.ready)
            decoders = [chunk.job.decoder for chunk in chunks]
            assert all(decoder is not None for decoder in decoders)
            videos = decode_together(
                [decoder for decoder in decoders if decoder is not None],
                [vae_latents(self.model, chunk.latents) for chunk in chunks],
            )
            frames = [to_rgb_frames(video) for video in videos]
        except torch.OutOfMemoryError:
            log.warning("a live video decode ran out of device memory")
            self._decode_failed(chunks, "out_of_memory", "the generation ran out of device memory")
            return
        except Exception as exc:
            log.exception("a live video decode failed")
            self._decode_failed(chunks, "engine_error", f"{type(exc).__name__}: {exc}")
            return
        self.decode_calls += 1
        with self._cond:
            for chunk, rgb in zip(chunks, frames, strict=True):
                self._hand_out(chunk, rgb)
            self._cond.notify_all()

    def _decode_failed(self, chunks: list[_Chunk], code: str, message: str) -> None:
        with self._cond:
            for chunk in chunks:
                chunk.decoding = False  # done with: the worker may now free its stream
        self._fail([chunk.job for chunk in chunks], code, message)

    def _hand_out(self, chunk: _Chunk, rgb: npt.NDArray[np.uint8]) -> None:
        """The chunk's frames, then what waited for them (lock held)."""
        job = chunk.job
        job.handed = None
        if job.finished:
            return
        rgb = rgb[: job.max_frames - job.frames_out]
        self.chunks_decoded += 1
        self.latent_frames_decoded += int(chunk.latents.shape[2])
        job._record("decoded", chunk.index)
        job.in_flight += rgb.shape[0]
        job._emit(
            FrameGroup(
                latent_index=chunk.latent_index,
                first_frame=job.frames_out,
                frames=rgb,
                chunk_index=chunk.index,
                prompt_id=chunk.prompt_id,
            )
        )
        job.frames_out += rgb.shape[0]
        if job.request.live:
            job.latent_frames = chunk.latent_index + int(chunk.latents.shape[2])
        for output in chunk.then:
            job._emit(output)

    def _forward(self, batch: list[LiveJob]) -> None:
        """One batched transformer forward: a flow step for denoising jobs, the cache write for clean ones."""
        model = self.model
        samples: list[torch.Tensor] = []
        timesteps: list[float] = []
        for job in batch:
            assert job.sample is not None
            if job.stage is _Stage.DENOISE:
                self._take_prompt(job)
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
            if job.step == len(job.sigmas) - 1:
                job.last_input = job.sample
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
