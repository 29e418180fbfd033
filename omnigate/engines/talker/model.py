"""Loading a CSM talker: a local Hugging Face checkpoint directory, or a named shape preset with random weights.

A checkpoint directory holds what ``CsmForConditionalGeneration.save_pretrained`` and the tokenizer's
``save_pretrained`` write (config, weights, tokenizer files). The Mimi codec is part of the CSM weights
(``codec_model.*``); a checkpoint without them may keep a Mimi checkpoint in a ``mimi/`` subdirectory.

Presets (``preset:NAME``) build the architecture from a config with random weights and a byte-level tokenizer.
Their output is noise, not speech: they exist to test and measure serving, whose cost does not depend on weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, CsmConfig, CsmForConditionalGeneration, MimiModel

from omnigate.engines.talker.tokenizer import BYTE_VOCAB_SIZE, SegmentTokenizer, byte_level_tokenizer

log = logging.getLogger(__name__)

PRESET_PREFIX = "preset:"
CODEC_SUBDIR = "mimi"


class ModelSpecError(ValueError):
    """A ``--model`` value that names no checkpoint directory or preset."""


@dataclass
class TalkerModel:
    """A loaded CSM model with its tokenizer, in eval mode on its device."""

    csm: Any  # CsmForConditionalGeneration
    tokenizer: Any  # a transformers tokenizer
    segments: SegmentTokenizer
    name: str
    random_weights: bool


def _tiny_config() -> CsmConfig:
    """A few million parameters with CSM's structure: fast enough for tests on a laptop CPU."""
    codebooks = 8
    return CsmConfig(
        num_codebooks=codebooks,
        text_vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=256,
        pad_token_id=258,
        audio_token_id=258,
        audio_eos_token_id=259,
        depth_decoder_config={
            "num_codebooks": codebooks,
            "backbone_hidden_size": 128,
            "hidden_size": 64,
            "intermediate_size": 192,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": codebooks + 1,
        },
        codec_config={
            "model_type": "mimi",
            "hidden_size": 64,
            "num_filters": 8,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "intermediate_size": 128,
            "codebook_dim": 32,
            "vector_quantization_hidden_dimension": 32,
            "upsample_groups": 64,
            "num_quantizers": codebooks,
        },
    )


def _csm_1b_config() -> CsmConfig:
    """The published sesame/csm-1b shape: Llama-3.2-1B backbone (2048 hidden, 16 layers, 32/8 heads, llama3 rope),
    a 4-layer 1024-wide depth decoder, 32 codebooks of 2051 ids, and the default Mimi codec."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
    }
    return CsmConfig(
        rope_parameters=rope,
        depth_decoder_config={"num_codebooks": 32, "backbone_hidden_size": 2048, "rope_parameters": dict(rope)},
        codec_config={"model_type": "mimi"},
    )


PRESETS: dict[str, Callable[[], CsmConfig]] = {"tiny": _tiny_config, "csm-1b": _csm_1b_config}


def clear_codebook_cache(mimi: Any) -> None:
    """Drop the codebook vectors Mimi caches on first use, after its buffers changed (values, dtype or device)."""
    for module in mimi.modules():
        if hasattr(module, "_embed"):
            module._embed = None


def randomize_codebooks(mimi: Any, generator: torch.Generator) -> None:
    """Fill Mimi's codebooks with noise; fresh ones are all zero, so every code would decode to the same vector."""
    for name, buffer in mimi.named_buffers():
        if name.endswith("embed_sum"):
            buffer.copy_(torch.randn(buffer.shape, generator=generator, dtype=buffer.dtype))
    clear_codebook_cache(mimi)


def build_preset(name: str, *, seed: int = 0, device: str = "cpu") -> TalkerModel:
    """Build preset ``name`` with weights drawn from ``seed`` and a byte-level tokenizer.

    The weights are drawn on ``device`` (a billion-parameter preset initialises in seconds on a GPU, minutes on a
    CPU), so they are deterministic per device type, not across them.
    """
    try:
        config = PRESETS[name]()
    except KeyError:
        raise ModelSpecError(f"unknown talker preset {name!r}; choose one of {', '.join(sorted(PRESETS))}") from None
    target = torch.device(device)
    with torch.random.fork_rng(devices=[target] if target.type == "cuda" else []), target:
        torch.manual_seed(seed)
        csm: Any = CsmForConditionalGeneration(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        randomize_codebooks(csm.codec_model, generator)
    tokenizer = byte_level_tokenizer()
    log.warning(
        "\n%s\nTALKER PRESET %r HAS RANDOM WEIGHTS: its audio is noise, not speech.\n"
        "It measures serving speed only; load a real checkpoint with --model PATH for speech.\n%s",
        "=" * 78,
        name,
        "=" * 78,
    )
    return TalkerModel(
        csm=csm.eval(),
        tokenizer=tokenizer,
        segments=SegmentTokenizer(tokenizer, source="bytes"),
        name=f"{PRESET_PREFIX}{name}",
        random_weights=True,
    )


def load_checkpoint(path: Path) -> TalkerModel:
    """Load a CSM checkpoint directory (no network: only local files are read)."""
    if not (path / "config.json").is_file():
        raise ModelSpecError(f"{path} is not a checkpoint directory (no config.json)")
    csm_class: Any = CsmForConditionalGeneration
    csm, info = csm_class.from_pretrained(path, local_files_only=True, output_loading_info=True)
    missing = [key for key in info["missing_keys"] if not key.startswith("codec_model.")]
    if missing:
        raise ModelSpecError(f"{path}: checkpoint lacks weights: {', '.join(sorted(missing)[:5])}")
    if any(key.startswith("codec_model.") for key in info["missing_keys"]):
        codec_dir = path / CODEC_SUBDIR
        if not (codec_dir / "config.json").is_file():
            raise ModelSpecError(f"{path}: no Mimi weights in the checkpoint and no {CODEC_SUBDIR}/ directory")
        csm.codec_model = MimiModel.from_pretrained(codec_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer_file = path / "tokenizer.json"
    source = str(tokenizer_file.resolve()) if tokenizer_file.is_file() else None
    return TalkerModel(
        csm=csm.eval(),
        tokenizer=tokenizer,
        segments=SegmentTokenizer(tokenizer, source=source),
        name=str(path),
        random_weights=False,
    )


def load_talker_model(spec: str | None, *, seed: int = 0, device: str = "cpu") -> TalkerModel:
    """Resolve ``--model``: ``preset:NAME`` (built on ``device``) or a checkpoint directory."""
    if not spec:
        raise ModelSpecError("the talker engine needs --model PATH (a CSM checkpoint directory) or preset:NAME")
    if spec.startswith(PRESET_PREFIX):
        return build_preset(spec[len(PRESET_PREFIX) :], seed=seed, device=device)
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ModelSpecError(f"talker model {spec!r} is neither preset:NAME nor a directory")
    return load_checkpoint(path)
