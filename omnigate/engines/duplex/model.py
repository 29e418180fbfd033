"""Loading a Moshi model: a local Hugging Face checkpoint directory, or a named shape preset with random weights.

A checkpoint directory holds what ``MoshiForConditionalGeneration.save_pretrained`` writes (its Mimi codec is part
of the weights, ``audio_encoder.*``) and, optionally, the text tokenizer; without one the text stream still drives
turn-taking but transcripts are empty.

Presets (``preset:NAME``) are configurations only until loaded; the model is then built directly on its device in
its dtype (so ``moshi-7b`` never exists as a float32 copy in host memory) with random weights. Their output is noise,
not speech: they exist to test and measure serving, whose cost does not depend on weight values.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, MoshiConfig, MoshiForConditionalGeneration

from omnigate.engines.talker.model import randomize_codebooks

log = logging.getLogger(__name__)

PRESET_PREFIX = "preset:"


class ModelSpecError(ValueError):
    """A ``--model`` value that names no checkpoint directory or preset."""


@dataclass
class DuplexModel:
    """A loaded Moshi model in eval mode on its device, with its tokenizer when it has one."""

    moshi: Any  # MoshiForConditionalGeneration
    tokenizer: Any | None
    name: str
    random_weights: bool


def _tiny_config() -> MoshiConfig:
    """A few million parameters with Moshi's structure and a tiny Mimi: real-time on one CPU core."""
    return MoshiConfig(
        vocab_size=64,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=512,
        num_codebooks=8,
        max_position_embeddings=250,
        sliding_window=250,
        audio_encoder_config={
            "model_type": "mimi",
            "hidden_size": 64,
            "num_filters": 8,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "intermediate_size": 128,
            "codebook_dim": 32,
            "codebook_size": 256,
            "vector_quantization_hidden_dimension": 32,
            "upsample_groups": 64,
            "num_quantizers": 8,
        },
        depth_decoder_config={"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "ffn_dim": 256},
    )


def _moshi_7b_config() -> MoshiConfig:
    """The published Moshi shape: a 7B temporal transformer (4096 wide, 32 layers, 32 heads, a 3000-step window),
    a 6-layer 1024-wide depth transformer over 8 codebooks, and the default Mimi codec (24 kHz, 12.5 Hz)."""
    return MoshiConfig(audio_encoder_config={"model_type": "mimi"}, depth_decoder_config={})


PRESETS: dict[str, Callable[[], MoshiConfig]] = {"tiny": _tiny_config, "moshi-7b": _moshi_7b_config}


def build_preset(name: str, *, seed: int, device: str, dtype: torch.dtype) -> DuplexModel:
    """Build preset ``name`` on ``device`` with weights drawn from ``seed`` (deterministic for a device)."""
    try:
        config = PRESETS[name]()
    except KeyError:
        raise ModelSpecError(f"unknown duplex preset {name!r}; choose one of {', '.join(sorted(PRESETS))}") from None
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        moshi_class: Any = MoshiForConditionalGeneration
        moshi: Any = moshi_class._from_config(config, dtype=dtype)
    with torch.no_grad():
        randomize_codebooks(moshi.audio_encoder, torch.Generator().manual_seed(seed))
    log.warning(
        "\n%s\nDUPLEX PRESET %r HAS RANDOM WEIGHTS: its audio is noise, not speech.\n"
        "It measures serving speed only; load a real checkpoint with --model PATH for speech.\n%s",
        "=" * 78,
        name,
        "=" * 78,
    )
    return DuplexModel(moshi=_prepared(moshi), tokenizer=None, name=f"{PRESET_PREFIX}{name}", random_weights=True)


def load_checkpoint(path: Path, *, device: str, dtype: torch.dtype) -> DuplexModel:
    """Load a Moshi checkpoint directory (no network: only local files are read)."""
    if not (path / "config.json").is_file():
        raise ModelSpecError(f"{path} is not a checkpoint directory (no config.json)")
    moshi_class: Any = MoshiForConditionalGeneration
    moshi, info = moshi_class.from_pretrained(
        path, local_files_only=True, output_loading_info=True, dtype=dtype, device_map=device
    )
    if info["missing_keys"]:
        raise ModelSpecError(f"{path}: checkpoint lacks weights: {', '.join(sorted(info['missing_keys'])[:5])}")
    try:
        tokenizer: Any | None = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        log.warning("%s has no usable text tokenizer (%s): transcripts will be empty", path, exc)
        tokenizer = None
    return DuplexModel(moshi=_prepared(moshi), tokenizer=tokenizer, name=str(path), random_weights=False)


def _prepared(moshi: Any) -> Any:
    # The codec stays in float32: below it, Mimi's quantizer distances and transposed convolutions lose accuracy.
    moshi.audio_encoder.to(torch.float32)
    return moshi.eval()


def load_duplex_model(spec: str | None, *, seed: int, device: str, dtype: torch.dtype) -> DuplexModel:
    """Resolve ``--model``: ``preset:NAME`` or a checkpoint directory."""
    if not spec:
        raise ModelSpecError("the duplex engine needs --model PATH (a Moshi checkpoint directory) or preset:NAME")
    if spec.startswith(PRESET_PREFIX):
        return build_preset(spec[len(PRESET_PREFIX) :], seed=seed, device=device, dtype=dtype)
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ModelSpecError(f"duplex model {spec!r} is neither preset:NAME nor a directory")
    return load_checkpoint(path, device=device, dtype=dtype)
