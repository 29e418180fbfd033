"""A video generation request, the engine's options, and the checks a request passes before any work starts."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from omnigate.engines.base import EngineError

DType = Literal["float32", "bfloat16", "float16"]

# The 480p Wan clip (832 x 480 x 81 frames): what one generation may ask for unless the operator says otherwise.
DEFAULT_MAX_VIDEO_PIXELS = 832 * 480 * 81


class VideoRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One text-to-video generation, every field resolved (the gateway fills defaults from the model)."""

    prompt: str
    width: int
    height: int
    num_frames: int
    fps: int
    steps: int
    seed: int
    guidance_scale: float = 5.0
    live: bool = False  # generated chunk by chunk until cancelled (num_frames is then 0)
    chunk_frames: int = 3  # latent frames per chunk (chunk-causal models)

    @property
    def pixels(self) -> int:
        """Width x height x frames: the size a generation is admitted by."""
        return self.width * self.height * self.num_frames


class VideoOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Engine-wide settings (``--video-option KEY=VALUE``); strings from the command line are converted."""

    max_sessions: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2  # generations in progress at once (slots)
    # decoded frames handed out and not yet consumed, per generation: the decoder waits beyond it
    max_frames_in_flight: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 16
    max_video_pixels: Annotated[int, msgspec.Meta(ge=1)] = DEFAULT_MAX_VIDEO_PIXELS  # width * height * frames
    max_steps: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 100
    max_fps: Annotated[int, msgspec.Meta(ge=1, le=240)] = 60
    max_prompt_chars: Annotated[int, msgspec.Meta(ge=1)] = 4096
    max_guidance_scale: Annotated[float, msgspec.Meta(ge=1.0)] = 20.0
    device: str = "cpu"
    dtype: DType = "float32"  # transformer and text encoder
    vae_dtype: DType = "float32"
    seed: Annotated[int, msgspec.Meta(ge=0)] = 0  # weights of presets
    # prompt tokens the text encoder sees, padded (None: the preset's, or Wan's 512 for a directory)
    max_sequence_length: Annotated[int, msgspec.Meta(ge=1, le=4096)] | None = None
    # spatial VAE tiling in video pixels (None: decode whole frames); equal to diffusers' tiled decode, not exact
    vae_tile: Annotated[int, msgspec.Meta(ge=64)] | None = None
    vae_tile_stride: Annotated[int, msgspec.Meta(ge=8)] | None = None  # None: three quarters of the tile
    # Chunk-causal models (live streams):
    max_chunk_frames: Annotated[int, msgspec.Meta(ge=1, le=21)] = 4  # latent frames per chunk
    max_chunk_steps: Annotated[int, msgspec.Meta(ge=1, le=50)] = 8  # denoising steps per chunk
    max_frame_pixels: Annotated[int, msgspec.Meta(ge=1)] = 832 * 480  # width * height of a live stream
    max_live_seconds: Annotated[float, msgspec.Meta(gt=0)] = 600.0  # of video per live stream; then it ends typed
    cache_frames: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 12  # latent frames of past chunks kept (the window)
    # decode each clean chunk on a second thread while the next chunk denoises (False: in line, on the worker). Off by
    # default: on the H200 the denoising forwards already fill the GPU, so the overlapped VAE only slowed them (one
    # stream 15.2 fps against 15.9, first fragment 0.62 s against 0.49 s: docs/benchmarks/video_live.md)
    overlap_decode: bool = False
    # bytes of KV caches all streams may hold together (None: 80 % of the free device memory at start; 4 GiB on CPU)
    cache_budget_bytes: Annotated[int, msgspec.Meta(ge=1)] | None = None
    causal_base: str = "preset:wan-1.3b-causal"  # shapes, text encoder and VAE for a Self-Forcing checkpoint file
    checkpoint_key: Literal["generator", "generator_ema"] = "generator"


def validate_request(
    request: VideoRequest,
    options: VideoOptions,
    *,
    size_multiple: int,
    temporal_scale: int,
) -> None:
    """Refuse what cannot or must not run, before any work. Raises :class:`EngineError` naming the field."""
    validate_prompt(request.prompt, options)
    if request.live:
        raise EngineError(
            "live_unsupported",
            "this model generates whole clips; live streams need a chunk-causal model (preset:tiny-causal, "
            "preset:wan-1.3b-causal, a Self-Forcing checkpoint)",
            "live",
        )
    validate_size(request, size_multiple)
    if request.num_frames < 1 or (request.num_frames - 1) % temporal_scale:
        raise EngineError(
            "invalid_frames",
            f"num_frames must be 1 + {temporal_scale}k (1, {1 + temporal_scale}, {1 + 2 * temporal_scale}, ...); "
            f"got {request.num_frames}",
            "num_frames",
        )
    if not 1 <= request.steps <= options.max_steps:
        raise EngineError("invalid_value", f"steps must be within 1..{options.max_steps}", "steps")
    validate_common(request, options)
    if request.pixels > options.max_video_pixels:
        raise EngineError(
            "too_large",
            f"width x height x num_frames = {request.pixels} exceeds this server's limit of {options.max_video_pixels}",
            "num_frames",
        )


def validate_prompt(prompt: str, options: VideoOptions) -> None:
    """A prompt must have text and fit the limit."""
    if not prompt.strip():
        raise EngineError("invalid_value", "prompt must not be empty", "prompt")
    if len(prompt) > options.max_prompt_chars:
        raise EngineError("invalid_value", f"prompt is longer than {options.max_prompt_chars} characters", "prompt")


def validate_size(request: VideoRequest, size_multiple: int) -> None:
    """Width and height are positive multiples of what the model patches."""
    for name, value in (("width", request.width), ("height", request.height)):
        if value < size_multiple or value % size_multiple:
            raise EngineError(
                "invalid_size", f"{name} must be a positive multiple of {size_multiple}; got {value}", name
            )


def validate_common(request: VideoRequest, options: VideoOptions) -> None:
    """The checks of frame rate, seed and guidance every request passes."""
    if not 1 <= request.fps <= options.max_fps:
        raise EngineError("invalid_value", f"fps must be within 1..{options.max_fps}", "fps")
    if not 0 <= request.seed < 2**63:
        raise EngineError("invalid_value", "seed must be within 0..2^63-1", "seed")
    if not 0.0 <= request.guidance_scale <= options.max_guidance_scale:
        raise EngineError(
            "invalid_value", f"guidance_scale must be within 0..{options.max_guidance_scale:g}", "guidance_scale"
        )
