"""Qwen3-Omni's decoder stacks (the thinker's text model, the talker, the code predictor) run over slot caches, one
row per new token, as :class:`~omnigate.engines.kv.decoder_stack.DecoderStack` runs the Llama-style ones.

What differs from that stack: a per-head RMSNorm on queries and keys before the rotation (Qwen3), and MLPs that are
mixtures of experts (:mod:`~omnigate.engines.qwen3_omni.experts`, with the talker's shared expert) or dense. The
q/k/v projections are fused into one matrix whose row blocks become the modules' own weights (no second copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnigate.engines.kv.decoder_stack import UnsupportedLayer, _fuse
from omnigate.engines.qwen3_omni.experts import ExpertWeights, grouped_experts
from omnigate.kernels.activation import silu_mul
from omnigate.kernels.attention import slot_attention
from omnigate.kernels.norm import rms_norm
from omnigate.kernels.rope import rope_store


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2 Hkv) * D, hidden]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    out: torch.Tensor  # [hidden, H * D]
    post_norm: torch.Tensor
    experts: ExpertWeights | None  # None: the dense MLP below
    gate_up: torch.Tensor | None
    down: torch.Tensor | None


def _experts(mlp: Any, config: Any) -> ExpertWeights:
    shared = getattr(mlp, "shared_expert", None)
    return ExpertWeights(
        router=mlp.gate.weight,
        gate_up=mlp.experts.gate_up_proj,
        down=mlp.experts.down_proj,
        top_k=int(config.num_experts_per_tok),
        norm_top_k=bool(config.norm_topk_prob),
        shared_gate_up=None if shared is None else _fuse((shared.gate_proj, shared.up_proj)),
        shared_down=None if shared is None else shared.down_proj.weight,
        shared_gate=None if shared is None else mlp.shared_expert_gate.weight,
    )


class MoeDecoderStack:
    """Runs Qwen3-style ``layers`` on token rows over a slot cache; :meth:`norm` applies the final norm."""

    def __init__(self, layers: Sequence[Any], norm: Any, config: Any) -> None:
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedLayer("only SiLU-gated MLPs are supported")
        if getattr(config, "attention_bias", False):
            raise UnsupportedLayer("attention projection biases are not supported")
        self.scaling = float(layers[0].self_attn.scaling)
        self._eps = float(config.rms_norm_eps)
        self._layers: list[_Layer] = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            moe = hasattr(mlp, "experts")
            self._layers.append(
                _Layer(
                    input_norm=layer.input_layernorm.weight,
                    qkv=_fuse((attn.q_proj, attn.k_proj, attn.v_proj)),
                    q_norm=attn.q_norm.weight,
                    k_norm=attn.k_norm.weight,
                    out=attn.o_proj.weight,
                    post_norm=layer.post_attention_layernorm.weight,
                    experts=_experts(mlp, config) if moe else None,
                    gate_up=None if moe else _fuse((mlp.gate_proj, mlp.up_proj)),
                    down=None if moe else mlp.down_proj.weight,
                )
            )
        self._norm_weight: torch.Tensor = norm.weight
        self._norm_eps = float(norm.variance_epsilon)

    @property
    def layers(self) -> int:
        return len(self._layers)

    def _qkv(self, h: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """The fused projection with the per-head norms applied to queries and keys: ``[R, (H + 2 Hkv) * D]``."""
        rows = h.shape[0]
        heads = (h @ layer.qkv.t()).view(rows, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = torch.split(heads, [self.heads, self.kv_heads, self.kv_heads], dim=1)
        q = rms_norm(q.contiguous(), layer.q_norm, self._eps)
        k = rms_norm(k.contiguous(), layer.k_norm, self._eps)
        return torch.cat((q, k, v), dim=1).view(rows, -1)

    def forward(
        self,
        x: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        keep_layer: int | None = None,
        deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` ``[R, hidden]``: one row per new token, row ``r`` written at ``[slots[r], positions[r]]`` of
        ``keys``/``values`` (``[layers, slots, capacity, Hkv, D]``) and attending causally over its slot. Returns the
        last layer's output (before the final norm) and, when ``keep_layer`` is ``n``, the output of the first ``n``
        layers (transformers' ``hidden_states[n]``). ``deepstack`` (rows ``[V]``, features ``[k, V, hidden]``): the
        vision features added at those rows after each of the first ``k`` layers (after ``hidden_states`` is taken,
        as transformers does)."""
        lengths = positions + 1
        kept: torch.Tensor | None = x if keep_layer == 0 else None
        for i, layer in enumerate(self._layers):
            h = rms_norm(x, layer.input_norm, self._eps)
            q = rope_store(
                self._qkv(h, layer), cos, sin, keys[i], values[i], slots, positions, self.heads, self.kv_heads
            )
            attended = slot_attention(q, keys[i], values[i], slots, lengths, self.scaling)
            x = torch.addmm(x, attended, layer.out.t())
            h = rms_norm(x, layer.post_norm, self._eps)
            if layer.experts is not None:
                x = x + grouped_experts(h, layer.experts)
            elif layer.gate_up is not None and layer.down is not None:
                x = torch.addmm(x, silu_mul(h @ layer.gate_up.t()), layer.down.t())
            if keep_layer == i + 1:
                kept = x
            if deepstack is not None and i < deepstack[1].shape[0]:
                x = x.index_add(0, deepstack[0], deepstack[1][i].to(x.dtype))
        return x, kept

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The stack's final RMSNorm."""
        return rms_norm(x, self._norm_weight, self._norm_eps)
