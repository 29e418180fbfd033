"""Policy checkpoints from a local directory in LeRobot's pi0 layout, and saving one (tests, conversions).

The directory holds what ``PI0Policy.save_pretrained`` writes:

- ``config.json``: ``"type": "pi0"``, ``chunk_size`` (the action horizon), ``max_state_dim``, ``max_action_dim``,
  ``num_steps`` (flow steps), ``tokenizer_max_length``, ``input_features`` (``observation.state`` and one
  ``VISUAL`` entry per camera, e.g. ``observation.images.top``) and ``output_features`` (``action``). The network's
  shapes are pi0's unless ``paligemma_config`` (``vision_config`` / ``text_config``: SiglipVisionConfig and
  GemmaConfig arguments) and ``gemma_expert_config`` say otherwise;
- ``model.safetensors``: the parameters under ``model.paligemma_with_expert.…``, ``model.state_proj`` and the other
  action projections (the newer ``paligemma.model.language_model.…`` spelling is read too), and the normalization
  buffers ``normalize_inputs.buffer_observation_state.{mean,std}`` / ``unnormalize_outputs.buffer_action.{mean,std}``
  when the policy was trained with mean-std normalization.

On the wire, a feature's dots become slashes: ``observation.images.top`` is sent as ``observation/images/top``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from omnigate.engines.policy.model import Pi0Dims, Pi0Policy, pi0_dims

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
STATE_FEATURE = "observation.state"
ACTION_FEATURE = "action"
_NORM_KEYS = {
    "state_mean": "normalize_inputs.buffer_observation_state.mean",
    "state_std": "normalize_inputs.buffer_observation_state.std",
    "action_mean": "unnormalize_outputs.buffer_action.mean",
    "action_std": "unnormalize_outputs.buffer_action.std",
}
# transformers >= 4.52 moved PaliGemma's parts under ``model.``; LeRobot checkpoints saved since use that spelling.
_ALIASES = (
    ("paligemma.model.language_model.", "paligemma.language_model.model."),
    ("paligemma.model.vision_tower.", "paligemma.vision_tower."),
    ("paligemma.model.multi_modal_projector.", "paligemma.multi_modal_projector."),
)
_IGNORED_SUFFIXES = ("lm_head.weight",)  # the tied output head: pi0 never decodes text


class CheckpointError(ValueError):
    """The directory is not a loadable pi0 checkpoint; the message says what is missing or mismatched."""


@dataclass(frozen=True)
class Normalization:
    """Mean-std statistics of the state (input) and actions (output); identity where a tensor is None."""

    state_mean: torch.Tensor | None = None
    state_std: torch.Tensor | None = None
    action_mean: torch.Tensor | None = None
    action_std: torch.Tensor | None = None


@dataclass(frozen=True)
class PolicyCheckpoint:
    """What a checkpoint directory describes: shapes, wire keys, statistics and the loaded model."""

    dims: Pi0Dims
    image_keys: tuple[str, ...]
    state_dim: int
    action_dim: int
    normalization: Normalization
    policy: Pi0Policy


def wire_key(feature: str) -> str:
    return feature.replace(".", "/")


def _dims(config: dict[str, Any], cameras: int) -> Pi0Dims:
    dims = pi0_dims(cameras)
    paligemma = config.get("paligemma_config") or {}
    return replace(
        dims,
        vision={**dims.vision, **(paligemma.get("vision_config") or {})},
        backbone={**dims.backbone, **(paligemma.get("text_config") or {})},
        expert={**dims.expert, **(config.get("gemma_expert_config") or {})},
        max_state_dim=int(config.get("max_state_dim", dims.max_state_dim)),
        max_action_dim=int(config.get("max_action_dim", dims.max_action_dim)),
        action_horizon=int(config.get("chunk_size", dims.action_horizon)),
        flow_steps=int(config.get("num_steps", dims.flow_steps)),
        max_prompt_tokens=int(config.get("tokenizer_max_length", dims.max_prompt_tokens)),
    )


def _feature_size(features: dict[str, Any], name: str) -> int:
    try:
        shape = features[name]["shape"]
    except (KeyError, TypeError):
        raise CheckpointError(f"{CONFIG_FILE} declares no {name!r} feature") from None
    return int(shape[-1])


def load_checkpoint(directory: Path, device: torch.device, dtype: torch.dtype) -> PolicyCheckpoint:
    """Read ``config.json`` and ``model.safetensors``; every network parameter must be present with its shape."""
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise CheckpointError(f"{directory} needs {CONFIG_FILE} and {WEIGHTS_FILE} (LeRobot's pi0 layout)")
    config = json.loads(config_path.read_text())
    if config.get("type") != "pi0":
        raise CheckpointError(f"{config_path} is a {config.get('type')!r} policy; only pi0 is served")
    inputs = config.get("input_features") or {}
    image_features = sorted(name for name, f in inputs.items() if isinstance(f, dict) and f.get("type") == "VISUAL")
    if not image_features:
        raise CheckpointError(f"{CONFIG_FILE} declares no VISUAL input feature")
    dims = _dims(config, len(image_features))
    state_dim = _feature_size(inputs, STATE_FEATURE)
    action_dim = _feature_size(config.get("output_features") or {}, ACTION_FEATURE)
    if state_dim > dims.max_state_dim or action_dim > dims.max_action_dim:
        raise CheckpointError("state or action dimension exceeds max_state_dim / max_action_dim")
    tensors = load_file(str(weights_path), device=str(device))
    normalization = Normalization(
        **{field: tensors.pop(key).float() if key in tensors else None for field, key in _NORM_KEYS.items()}
    )
    weights: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if key.endswith(_IGNORED_SUFFIXES) or key.startswith(("normalize_", "unnormalize_")):
            continue
        for newer, ours in _ALIASES:
            key = key.replace(newer, ours)
        weights[key.removeprefix("_orig_mod.")] = tensor
    with torch.device("meta"):
        policy = Pi0Policy(dims)
    expected = policy.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{weights_path} does not match pi0's layout: missing {missing[:5]} ({len(missing)}), "
            f"unexpected {unexpected[:5]} ({len(unexpected)})"
        )
    for key, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise CheckpointError(f"{key} has shape {list(tensor.shape)}; the config needs {list(expected[key].shape)}")
    policy.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, assign=True)
    return PolicyCheckpoint(
        dims=dims,
        image_keys=tuple(wire_key(name) for name in image_features),
        state_dim=state_dim,
        action_dim=action_dim,
        normalization=normalization,
        policy=policy.to(device).eval(),
    )


def save_checkpoint(
    directory: Path,
    policy: Pi0Policy,
    *,
    image_features: tuple[str, ...],
    state_dim: int,
    action_dim: int,
    normalization: Normalization | None = None,
) -> None:
    """Write ``policy`` in the layout :func:`load_checkpoint` reads (the shapes spelled out in ``config.json``)."""
    dims = policy.dims
    directory.mkdir(parents=True, exist_ok=True)
    image_size = int(dims.vision["image_size"])
    config = {
        "type": "pi0",
        "chunk_size": dims.action_horizon,
        "n_action_steps": dims.action_horizon,
        "max_state_dim": dims.max_state_dim,
        "max_action_dim": dims.max_action_dim,
        "num_steps": dims.flow_steps,
        "tokenizer_max_length": dims.max_prompt_tokens,
        "input_features": {
            STATE_FEATURE: {"type": "STATE", "shape": [state_dim]},
            **{name: {"type": "VISUAL", "shape": [3, image_size, image_size]} for name in image_features},
        },
        "output_features": {ACTION_FEATURE: {"type": "ACTION", "shape": [action_dim]}},
        "paligemma_config": {"vision_config": dims.vision, "text_config": dims.backbone},
        "gemma_expert_config": dims.expert,
    }
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    tensors = {k: v.detach().contiguous().cpu() for k, v in policy.state_dict().items()}
    if normalization is not None:
        for field, key in _NORM_KEYS.items():
            value = getattr(normalization, field)
            if value is not None:
                tensors[key] = value.detach().contiguous().cpu()
    save_file(tensors, str(directory / WEIGHTS_FILE))
