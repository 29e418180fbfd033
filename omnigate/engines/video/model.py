"""Loading a Wan 2.1-style text-to-video model: a local Diffusers directory, or a shape preset with random weights.

A directory has the ``WanPipeline`` layout that ``save_pretrained`` writes (``model_index.json``, ``tokenizer/``,
``text_encoder/``, ``transformer/``, ``vae/``, ``scheduler/``); only local files are read. The VAE is kept in its
own dtype (float32 by default, as Wan runs it) whatever the transformer's dtype.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

from omnigate.engines.video.checkpoint import CheckpointError, CheckpointKey, load_generator_weights
from omnigate.engines.video.presets import PRESETS, VideoDefaults
from omnigate.engines.video.tokenizer import byte_level_tokenizer

log = logging.getLogger(__name__)

PRESET_PREFIX = "preset:"
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# diffusers' constructors carry no annotations (a config decorator wraps them): they are called through Any.
_WAN_TRANSFORMER: Any = WanTransformer3DModel
_WAN_VAE: Any = AutoencoderKLWan
_UNIPC: Any = UniPCMultistepScheduler
_WAN_PIPELINE: Any = WanPipeline
WAN_CAUSAL_PRESET = "wan-1.3b-causal"
# Where a Self-Forcing checkpoint takes its shapes, text encoder and VAE unless told otherwise.
DEFAULT_CAUSAL_BASE = PRESET_PREFIX + WAN_CAUSAL_PRESET
# Wan's default prompt length; presets may use a shorter one.
DIRECTORY_MAX_SEQUENCE_LENGTH = 512


class ModelSpecError(ValueError):
    """A model spec that names no preset or usable directory."""


@dataclass
class VideoModel:
    """The components of one loaded model, in eval mode on one device. Not re-entrant: one caller at a time."""

    tokenizer: Any
    text_encoder: Any  # transformers UMT5EncoderModel
    transformer: Any  # diffusers WanTransformer3DModel
    vae: Any  # diffusers AutoencoderKLWan
    scheduler: Any  # a diffusers scheduler: the template each generation copies (schedulers keep state)
    name: str
    random_weights: bool
    defaults: VideoDefaults
    max_sequence_length: int
    causal: bool = False  # chunk-causal (served by the live engine), or a whole-clip model

    @property
    def device(self) -> torch.device:
        device: torch.device = self.transformer.device
        return device

    @property
    def dtype(self) -> torch.dtype:
        dtype: torch.dtype = self.transformer.dtype
        return dtype

    @property
    def temporal_scale(self) -> int:
        """Video frames per latent frame (after the first, which is one frame)."""
        return int(self.vae.config.scale_factor_temporal)

    @property
    def spatial_scale(self) -> int:
        return int(self.vae.config.scale_factor_spatial)

    @property
    def size_multiple(self) -> int:
        """Width and height must be multiples of this: the VAE's downscale times the transformer's patch."""
        patch = self.transformer.config.patch_size
        return self.spatial_scale * max(int(patch[1]), int(patch[2]))

    @property
    def latent_channels(self) -> int:
        return int(self.transformer.config.in_channels)

    def latent_frames(self, num_frames: int) -> int:
        return (num_frames - 1) // self.temporal_scale + 1

    def parameter_count(self) -> int:
        return sum(p.numel() for m in (self.text_encoder, self.transformer, self.vae) for p in m.parameters())


def cast_weights(module: Any, dtype: torch.dtype) -> Any:
    """Cast parameters to ``dtype`` except those the class keeps in float32, as ``from_pretrained(torch_dtype=)`` does
    (buffers such as rotary tables keep the precision they were built in)."""
    keep = tuple(getattr(module, "_keep_in_fp32_modules", None) or ())
    for name, param in module.named_parameters():
        target = torch.float32 if any(part in keep for part in name.split(".")) else dtype
        if param.dtype != target:
            param.data = param.data.to(target)
    return module


def _check_supported(transformer: Any, vae: Any) -> None:
    if vae.config.patch_size is not None:
        raise ModelSpecError("only Wan 2.1 VAEs are supported (this one patchifies its output, as Wan 2.2's does)")
    if int(vae.config.z_dim) != int(transformer.config.in_channels):
        raise ModelSpecError("the VAE's latent channels do not match the transformer's input channels")


def build_preset(
    name: str,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    vae_dtype: str = "float32",
    seed: int = 0,
) -> VideoModel:
    """Build preset ``name`` directly on ``device`` with weights drawn from ``seed``."""
    try:
        preset = PRESETS[name]
    except KeyError:
        raise ModelSpecError(f"unknown video preset {name!r}; choose one of {', '.join(sorted(PRESETS))}") from None
    target = torch.device(device)
    forked = [target.index or 0] if target.type == "cuda" else []
    with torch.random.fork_rng(devices=forked), target:
        torch.manual_seed(seed)
        transformer: Any = _WAN_TRANSFORMER(**preset.transformer)
        vae: Any = _WAN_VAE(**preset.vae)
        text_encoder: Any = UMT5EncoderModel(UMT5Config(**preset.text_encoder))
    _check_supported(transformer, vae)
    log.warning(
        "\n%s\nVIDEO PRESET %r HAS RANDOM WEIGHTS: its output is noise, not meaningful video.\n"
        "It measures serving speed only; load a real Wan 2.1 Diffusers directory for video.\n%s",
        "=" * 78,
        name,
        "=" * 78,
    )
    return VideoModel(
        tokenizer=byte_level_tokenizer(),
        text_encoder=cast_weights(text_encoder, TORCH_DTYPES[dtype]).eval(),
        transformer=cast_weights(transformer, TORCH_DTYPES[dtype]).eval(),
        vae=cast_weights(vae, TORCH_DTYPES[vae_dtype]).eval(),
        scheduler=_UNIPC(**preset.scheduler),
        name=f"{PRESET_PREFIX}{name}",
        random_weights=True,
        defaults=preset.defaults,
        max_sequence_length=preset.max_sequence_length,
        causal=preset.causal,
    )


def load_directory(
    path: Path,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    vae_dtype: str = "float32",
    max_sequence_length: int = DIRECTORY_MAX_SEQUENCE_LENGTH,
) -> VideoModel:
    """Load a ``WanPipeline`` directory from local files."""
    if not (path / "model_index.json").is_file():
        raise ModelSpecError(f"{path} is not a Diffusers pipeline directory (no model_index.json)")
    vae = _WAN_VAE.from_pretrained(path, subfolder="vae", dtype=TORCH_DTYPES[vae_dtype], local_files_only=True)
    pipeline = _WAN_PIPELINE.from_pretrained(path, vae=vae, dtype=TORCH_DTYPES[dtype], local_files_only=True)
    if pipeline.transformer is None or getattr(pipeline, "transformer_2", None) is not None:
        raise ModelSpecError(f"{path}: only single-transformer (Wan 2.1) pipelines are supported")
    _check_supported(pipeline.transformer, vae)
    target = torch.device(device)
    return VideoModel(
        tokenizer=pipeline.tokenizer,
        text_encoder=pipeline.text_encoder.to(target).eval(),
        transformer=pipeline.transformer.to(target).eval(),
        vae=vae.to(target).eval(),
        scheduler=pipeline.scheduler,
        name=str(path),
        random_weights=False,
        defaults=VideoDefaults(),
        max_sequence_length=max_sequence_length,
    )


def save_directory(model: VideoModel, path: Path) -> None:
    """Write ``model`` as a ``WanPipeline`` directory, the layout :func:`load_directory` reads."""
    pipeline = _WAN_PIPELINE(
        tokenizer=model.tokenizer,
        text_encoder=model.text_encoder,
        vae=model.vae,
        scheduler=model.scheduler,
        transformer=model.transformer,
    )
    pipeline.save_pretrained(path)


def load_generator_checkpoint(
    path: Path,
    *,
    base: str,
    key: CheckpointKey,
    device: str = "cpu",
    dtype: str = "float32",
    vae_dtype: str = "float32",
    seed: int = 0,
) -> VideoModel:
    """A chunk-causal model: ``base`` (a causal preset or a Wan directory) with its transformer's weights from the
    Self-Forcing checkpoint at ``path``; the base gives the shapes, the text encoder and the VAE."""
    model = load_video_model(base, device=device, dtype=dtype, vae_dtype=vae_dtype, seed=seed)
    try:
        load_generator_weights(path, model.transformer, key)
    except CheckpointError as exc:
        raise ModelSpecError(str(exc)) from None
    if not model.causal:
        # A whole-clip base (a Wan directory) has Wan's 50 guided steps as defaults; the generator runs 4 unguided.
        causal = PRESETS[WAN_CAUSAL_PRESET].defaults
        model.defaults = replace(model.defaults, steps=causal.steps, guidance_scale=causal.guidance_scale)
    model.name = str(path)
    model.causal = True
    return model


def load_video_model(
    spec: str | None,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    vae_dtype: str = "float32",
    seed: int = 0,
    max_sequence_length: int | None = None,
    causal_base: str = DEFAULT_CAUSAL_BASE,
    checkpoint_key: CheckpointKey = "generator",
) -> VideoModel:
    """Resolve a model spec: ``preset:NAME``, a directory, or a Self-Forcing checkpoint file (its transformer on
    ``causal_base``'s text encoder and VAE). ``max_sequence_length`` overrides the model's."""
    if not spec:
        raise ModelSpecError("the video engine needs a model: a Wan 2.1 Diffusers directory or preset:NAME")
    if dtype not in TORCH_DTYPES or vae_dtype not in TORCH_DTYPES:
        raise ModelSpecError(f"dtype must be one of {', '.join(TORCH_DTYPES)}")
    if spec.startswith(PRESET_PREFIX):
        model = build_preset(spec[len(PRESET_PREFIX) :], device=device, dtype=dtype, vae_dtype=vae_dtype, seed=seed)
        if max_sequence_length is not None:
            model.max_sequence_length = max_sequence_length
        return model
    path = Path(spec).expanduser()
    if path.is_file():
        return load_generator_checkpoint(
            path, base=causal_base, key=checkpoint_key, device=device, dtype=dtype, vae_dtype=vae_dtype, seed=seed
        )
    if not path.is_dir():
        raise ModelSpecError(f"video model {spec!r} is neither preset:NAME, a directory nor a checkpoint file")
    return load_directory(
        path,
        device=device,
        dtype=dtype,
        vae_dtype=vae_dtype,
        max_sequence_length=max_sequence_length or DIRECTORY_MAX_SEQUENCE_LENGTH,
    )
