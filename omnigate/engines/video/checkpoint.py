"""Self-Forcing generator checkpoints: ``torch.save`` dicts with ``generator`` and ``generator_ema`` state dicts.

Each state dict is Self-Forcing's ``WanDiffusionWrapper``: original Wan key names behind a ``model.`` prefix
(``model.blocks.0.self_attn.q.weight``). Loading strips the prefix and maps the names to diffusers' with diffusers'
own converter; writing does the inverse, so a test can write a small checkpoint and load it back. The checkpoint
holds only the transformer: the text encoder and the VAE come from a base model (a preset or a Wan directory), as
Self-Forcing takes them from ``Wan2.1-T2V-1.3B``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import torch
from diffusers.loaders import single_file_utils

# diffusers' converter carries no annotations: called through Any.
_CONVERT_WAN: Any = single_file_utils.convert_wan_transformer_to_diffusers

CheckpointKey = Literal["generator", "generator_ema"]
WRAPPER_PREFIX = "model."

# diffusers name -> original Wan name, applied in order (the inverse of diffusers' converter for Wan 2.1 T2V).
_TO_ORIGINAL: tuple[tuple[str, str], ...] = (
    (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"^condition_embedder\.time_proj\.", "time_projection.1."),
    (r"^scale_shift_table$", "head.modulation"),
    (r"^proj_out\.", "head.head."),
    (r"\.attn1\.", ".self_attn."),
    (r"\.attn2\.", ".cross_attn."),
    (r"\.to_out\.0\.", ".o."),
    (r"\.to_q\.", ".q."),
    (r"\.to_k\.", ".k."),
    (r"\.to_v\.", ".v."),
    (r"\.ffn\.net\.0\.proj\.", ".ffn.0."),
    (r"\.ffn\.net\.2\.", ".ffn.2."),
    (r"^(blocks\.\d+)\.scale_shift_table$", r"\1.modulation"),
    # diffusers' norm2 is the cross-attention norm, Wan's norm3 (the FFN norm has no weights).
    (r"^(blocks\.\d+)\.norm2\.", r"\1.norm3."),
)


class CheckpointError(ValueError):
    """A file that is not a usable Self-Forcing generator checkpoint for the base model."""


def to_original_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers ``WanTransformer3DModel`` state dict under Self-Forcing's names (``model.`` + original Wan)."""
    renamed: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        name = key
        for pattern, replacement in _TO_ORIGINAL:
            name = re.sub(pattern, replacement, name)
        renamed[WRAPPER_PREFIX + name] = tensor
    return renamed


def save_generator_checkpoint(transformer: Any, path: Path) -> None:
    """Write ``transformer``'s weights as a Self-Forcing checkpoint (the same weights as ``generator`` and EMA)."""
    weights = to_original_names({k: v.detach().cpu() for k, v in transformer.state_dict().items()})
    torch.save({"generator": weights, "generator_ema": dict(weights)}, path)


def load_generator_weights(path: Path, transformer: Any, key: CheckpointKey = "generator") -> None:
    """Load the ``key`` state dict of the checkpoint at ``path`` into ``transformer`` (a diffusers Wan transformer
    of the same shapes). Raises :class:`CheckpointError`."""
    try:
        # weights_only: a checkpoint is data, never code to run.
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(checkpoint, dict) or key not in checkpoint or not isinstance(checkpoint[key], dict):
        raise CheckpointError(f"{path}: no {key!r} state dict (a Self-Forcing checkpoint has generator, generator_ema)")
    original = {
        (name[len(WRAPPER_PREFIX) :] if name.startswith(WRAPPER_PREFIX) else name): tensor
        for name, tensor in checkpoint[key].items()
    }
    converted: dict[str, torch.Tensor] = _CONVERT_WAN(original)
    expected = transformer.state_dict()
    missing = sorted(set(expected) - set(converted))
    unexpected = sorted(set(converted) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: its weights do not fit the base model (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    for name, tensor in converted.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{path}: {name} is {tuple(tensor.shape)}, the base model wants {tuple(expected[name].shape)}"
            )
    transformer.load_state_dict(
        {name: tensor.to(expected[name].dtype) for name, tensor in converted.items()}, strict=True
    )
