"""A Llama-style decoder stack (CSM's backbone and depth decoder, Qwen2's layers) run over slot caches, one row per
new token.

It reuses the transformers modules' weights, with the q/k/v and the gate/up projections fused into one matrix each
(the modules' own weights become views into those, so nothing is stored twice); Qwen2's q/k/v biases are fused the
same way and added after the projection. A forward takes any set of tokens, each with its cache slot and position:
a row writes its key and value at that position and attends over its slot's keys up to it, so rows of different
streams at different lengths, several new tokens of one stream (a prefill), and the fixed-size rows of a CUDA-graph
step all share one code path. Every op is a kernel from ``omnigate.kernels``:
Triton on CUDA, plain torch elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from omnigate.kernels.activation import silu_mul
from omnigate.kernels.attention import slot_attention
from omnigate.kernels.norm import rms_norm
from omnigate.kernels.rope import rope_store


class UnsupportedLayer(ValueError):
    """A decoder layer with a feature this forward does not implement (output or MLP biases, another activation)."""


@dataclass(frozen=True)
class _LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2 Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None  # [(H + 2 Hkv) * D]
    out: torch.Tensor  # [hidden, H * D]
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


def _fuse(modules: Sequence[nn.Linear], name: str = "weight") -> torch.Tensor:
    """One ``[sum(out), ...]`` tensor whose row blocks become the modules' ``name`` parameters (views, no second
    copy)."""
    params = [getattr(m, name) for m in modules]
    fused = torch.cat([p.detach() for p in params])
    start = 0
    for param in params:
        rows = param.shape[0]
        param.data = fused[start : start + rows]
        start += rows
    return fused


def _fuse_bias(modules: Sequence[nn.Linear]) -> torch.Tensor | None:
    """The modules' biases fused like their weights, or None when none has one."""
    present = [m.bias is not None for m in modules]
    if not any(present):
        return None
    if not all(present):
        raise UnsupportedLayer("q/k/v projections must all have biases or none")
    return _fuse(modules, "bias")


class DecoderStack:
    """Runs ``layers`` on token rows over a slot cache; :meth:`norm` applies the final norm."""

    def __init__(self, layers: Sequence[Any], norm: Any, config: Any) -> None:
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedLayer("only SiLU-gated MLPs are supported")
        self._layers: list[_LayerWeights] = []
        self._eps: list[tuple[float, float]] = []
        self.scaling = float(layers[0].self_attn.scaling)
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            if any(m.bias is not None for m in (attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
                raise UnsupportedLayer("output and MLP projection biases are not supported")
            qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
            self._layers.append(
                _LayerWeights(
                    input_norm=layer.input_layernorm.weight,
                    qkv=_fuse(qkv),
                    qkv_bias=_fuse_bias(qkv),
                    out=attn.o_proj.weight,
                    post_norm=layer.post_attention_layernorm.weight,
                    gate_up=_fuse((mlp.gate_proj, mlp.up_proj)),
                    down=mlp.down_proj.weight,
                )
            )
            self._eps.append(
                (float(layer.input_layernorm.variance_epsilon), float(layer.post_attention_layernorm.variance_epsilon))
            )
        self._norm_weight: torch.Tensor = norm.weight
        self._norm_eps = float(norm.variance_epsilon)

    @property
    def layers(self) -> int:
        return len(self._layers)

    def forward(
        self,
        x: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` ``[R, hidden]``: one row per new token; ``keys``/``values`` ``[layers, slots, capacity, Hkv, D]``;
        ``cos``/``sin`` ``[R, D]`` at each row's position. Row ``r`` writes at ``[slots[r], positions[r]]`` and
        attends over that slot's first ``lengths[r]`` keys (default ``positions + 1``, i.e. causal). Returns the
        last layer's output (before the final norm)."""
        if lengths is None:
            lengths = positions + 1
        for i, layer in enumerate(self._layers):
            eps_in, eps_post = self._eps[i]
            h = rms_norm(x, layer.input_norm, eps_in)
            bias = layer.qkv_bias
            qkv = h @ layer.qkv.t() if bias is None else torch.addmm(bias, h, layer.qkv.t())
            q = rope_store(qkv, cos, sin, keys[i], values[i], slots, positions, self.heads, self.kv_heads)
            attended = slot_attention(q, keys[i], values[i], slots, lengths, self.scaling)
            x = torch.addmm(x, attended, layer.out.t())
            h = rms_norm(x, layer.post_norm, eps_post)
            x = torch.addmm(x, silu_mul(h @ layer.gate_up.t()), layer.down.t())
        return x

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The stack's final RMSNorm."""
        return rms_norm(x, self._norm_weight, self._norm_eps)
