"""A pi0-style vision-language-action model: PaliGemma (SigLIP + Gemma) reads the cameras and the prompt once per
observation; a smaller Gemma, the action expert, turns noise into an action chunk by flow matching in a fixed number
of steps, attending at every layer to the backbone's keys and values of the same layer.

The module tree and parameter names are LeRobot's pi0 (``PI0Policy``: ``model.paligemma_with_expert.paligemma.…``,
``model.paligemma_with_expert.gemma_expert.…``, ``model.state_proj``, ``model.action_in_proj``, …), so a LeRobot pi0
``model.safetensors`` loads into it (see :mod:`omnigate.engines.policy.checkpoint`). Shapes come from transformers'
``SiglipVisionConfig`` and ``GemmaConfig``. The layers are written here rather than taken from transformers because
the two experts share one attention per layer, and because the sampling loop must be capturable as a CUDA graph:
static shapes, no host synchronisation, no cache objects.

The prefix (images, then prompt tokens) attends bidirectionally to itself; the suffix (one state token, then the
action tokens) attends to the prefix and to itself, except that the state token does not see the actions. So the
prefix is computed once per observation and its keys and values serve every flow step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GemmaConfig, SiglipVisionConfig

from omnigate.kernels.gelu_mul import gelu_tanh_mul
from omnigate.kernels.prefix_attention import key_bias, prefix_attention
from omnigate.kernels.rope import rope_store

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Pi0Dims:
    """The model's shapes: the three transformers configs' arguments and pi0's action-side sizes."""

    vision: dict[str, Any]
    backbone: dict[str, Any]
    expert: dict[str, Any]
    cameras: int = 2
    max_state_dim: int = 32
    max_action_dim: int = 32
    action_horizon: int = 50
    flow_steps: int = 10
    max_prompt_tokens: int = 48

    def vision_config(self) -> SiglipVisionConfig:
        return SiglipVisionConfig(**self.vision)

    def backbone_config(self) -> GemmaConfig:
        return GemmaConfig(**self.backbone)

    def expert_config(self) -> GemmaConfig:
        return GemmaConfig(**self.expert)


def pi0_dims(cameras: int = 2) -> Pi0Dims:
    """pi0's published shapes: PaliGemma 3B (SigLIP so400m/14 at 224, Gemma 2B) and the 300M Gemma action expert."""
    return Pi0Dims(
        vision={
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_hidden_layers": 27,
            "num_attention_heads": 16,
            "image_size": 224,
            "patch_size": 14,
            "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6,
        },
        backbone={
            "vocab_size": 257_152,
            "hidden_size": 2048,
            "intermediate_size": 16_384,
            "num_hidden_layers": 18,
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "head_dim": 256,
        },
        expert={
            "vocab_size": 257_152,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 18,
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "head_dim": 256,
        },
        cameras=cameras,
    )


def tiny_dims(cameras: int = 2) -> Pi0Dims:
    """The same architecture at a size that steps in milliseconds on a CPU (tests)."""
    return Pi0Dims(
        vision={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 8,
            "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6,
        },
        backbone={
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
        },
        expert={
            "vocab_size": 512,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
        },
        cameras=cameras,
        action_horizon=10,
        flow_steps=4,
        max_prompt_tokens=16,
    )


# ---- SigLIP --------------------------------------------------------------------------------------------------------


class _SiglipAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape

        def split(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(b, t, self.heads, w // self.heads).transpose(1, 2)  # type: ignore[no-any-return]

        out = F.scaled_dot_product_attention(split(self.q_proj), split(self.k_proj), split(self.v_proj))
        return self.out_proj(out.transpose(1, 2).reshape(b, t, w))  # type: ignore[no-any-return]

    def pack(self) -> None:
        """Keep q, k and v as one matrix (a copy: the Linear weights keep the checkpoint's layout)."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = torch.cat([p.weight for p in projections])
        self.qkv_bias = torch.cat([p.bias for p in projections])

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` with one projection GEMM for q, k and v (after :meth:`pack`)."""
        b, t, w = x.shape
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias).view(b, t, 3, self.heads, w // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, w))  # type: ignore[no-any-return]


class _SiglipMlp(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))  # type: ignore[no-any-return]


class _SiglipLayer(nn.Module):
    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        width = config.hidden_size
        self.layer_norm1 = nn.LayerNorm(width, eps=config.layer_norm_eps)
        self.self_attn = _SiglipAttention(width, config.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(width, eps=config.layer_norm_eps)
        self.mlp = _SiglipMlp(width, config.intermediate_size)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        normed = self.layer_norm1(x)
        x = x + (self.self_attn.fused(normed) if fused else self.self_attn(normed))
        return x + self.mlp(self.layer_norm2(x))  # type: ignore[no-any-return]


class _SiglipEmbeddings(nn.Module):
    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        patch, size = int(config.patch_size), int(config.image_size)  # type: ignore[arg-type]
        self.patch_embedding = nn.Conv2d(3, config.hidden_size, patch, stride=patch)
        self.position_embedding = nn.Embedding((size // patch) ** 2, config.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight  # type: ignore[no-any-return]


class _SiglipEncoder(nn.Module):
    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_SiglipLayer(config) for _ in range(config.num_hidden_layers))


class _SiglipVisionModel(nn.Module):
    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.embeddings = _SiglipEmbeddings(config)
        self.encoder = _SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor, fused: bool = False) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x, fused)
        return self.post_layernorm(x)  # type: ignore[no-any-return]


class _VisionTower(nn.Module):
    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.vision_model = _SiglipVisionModel(config)


class _Projector(nn.Module):
    def __init__(self, vision_width: int, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(vision_width, width)


# ---- Gemma ---------------------------------------------------------------------------------------------------------


class _RmsNorm(nn.Module):
    """Gemma's RMSNorm: the weight is an offset from one, and the norm is computed in float32."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # y * (1 + w) as one addcmul: every elementwise kernel counts, run 180 times per inference in the expert
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return torch.addcmul(y, y, self.weight.float()).to(x.dtype)


class _GemmaAttention(nn.Module):
    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        width = config.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, width, bias=False)

    def qkv(self, x: torch.Tensor, rope: KV) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return _rotate(q, rope), _rotate(k, rope), v

    def out(self, attended: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attended.shape
        return self.o_proj(attended.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))  # type: ignore[no-any-return]


class _GemmaMlp(nn.Module):
    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))  # type: ignore[no-any-return]


class _GemmaLayer(nn.Module):
    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        self.input_layernorm = _RmsNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = _GemmaAttention(config)
        self.post_attention_layernorm = _RmsNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = _GemmaMlp(config)

    def forward(
        self, x: torch.Tensor, rope: KV, mask: torch.Tensor, context: KV | None = None
    ) -> tuple[torch.Tensor, KV]:
        """One layer over ``x``; returns its output and ``x``'s keys and values (one per KV head).

        ``context`` (the action expert's case): key and value buffers of every query head, (B, heads, P + T, D), whose
        first P positions hold the prefix's keys and values of this layer; ``x``'s own are written into the last T.
        """
        q, k, v = self.self_attn.qkv(self.input_layernorm(x), rope)
        heads = q.shape[1]
        if context is None:
            keys, values = _per_head(k, heads), _per_head(v, heads)
        else:
            keys, values = context
            t = x.shape[1]
            keys[:, :, -t:] = _per_head(k, heads)
            values[:, :, -t:] = _per_head(v, heads)
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        x = x + self.self_attn.out(attended)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, (k, v)

    def pack(self) -> None:
        """Merged weights for :meth:`fused` (copies: the Linear weights keep the checkpoint's layout): q, k and v as
        one matrix, gate and up as one, and each RMSNorm's ``1 + weight`` as the scale the fused norm takes."""
        attn, mlp = self.self_attn, self.mlp
        if attn.kv_heads != 1:
            raise ValueError("the fused layer folds the query heads over one key-value head (pi0's attention)")
        self.qkv_weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        self.gate_up_weight = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        self.input_scale = 1.0 + self.input_layernorm.weight
        self.post_attention_scale = 1.0 + self.post_attention_layernorm.weight

    def fused(
        self, x: torch.Tensor, rope: KV, mask: torch.Tensor, context: KV | None = None, kv_only: bool = False
    ) -> tuple[torch.Tensor, KV]:
        """:meth:`forward` in about half the kernels (after :meth:`pack`), for the same function.

        One GEMM for q, k and v and one for gate and up; the norms as one kernel each; RoPE of q and k in one pass;
        the residual adds inside the output GEMMs (``addmm``). The query heads are folded into the query length
        against the single key-value head, so attention reads keys and values of shape (B, 1, S, D), never copied
        per head: ``mask`` is (B, 1, 1 or T * heads, S), and ``context`` buffers (B, 1, P + T, D). ``kv_only``: the
        last backbone layer, whose output nobody reads, stops at its keys and values.
        """
        b, t, width = x.shape
        attn = self.self_attn
        heads, dim = attn.heads, attn.head_dim
        normed = F.rms_norm(x, (width,), self.input_scale, self.input_layernorm.eps)
        qkv = F.linear(normed, self.qkv_weight).view(b, t, heads + 2, dim)
        qk = _rotate_folded(qkv[:, :, : heads + 1], rope)
        k, v = qk[:, :, heads:].transpose(1, 2), qkv[:, :, heads + 1 :].transpose(1, 2)
        if kv_only:
            return x, (k, v)
        if context is None:
            keys, values = k, v
        else:
            keys, values = context
            keys[:, :, -t:] = k
            values[:, :, -t:] = v
        q = qk[:, :, :heads].reshape(b, 1, t * heads, dim)
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self._fused_output(x, attended), (k, v)

    def fused_over_cache(
        self, x: torch.Tensor, suffix: _CachedSuffix, cache: KV, kv_only: bool = False
    ) -> torch.Tensor:
        """:meth:`fused` for the action expert over its layer's cache (``cache``: keys and values (B, S, 1, D) whose
        first positions hold the prefix's): ``x``'s keys and values rotated and written at ``suffix.positions`` and
        its queries rotated, in one kernel; then its attention over the cache's first ``suffix.span`` positions with
        only the prefix's padding masked (the state token's keys and values are already in the cache, so no row
        needs a mask of its own). ``kv_only``: stop once the keys and values are written."""
        b, t, width = x.shape
        attn = self.self_attn
        normed = F.rms_norm(x, (width,), self.input_scale, self.input_layernorm.eps)
        qkv = F.linear(normed.view(b * t, width), self.qkv_weight)
        keys, values = cache
        q = rope_store(qkv, suffix.cos, suffix.sin, keys, values, suffix.slots, suffix.positions, attn.heads, 1)
        if kv_only:
            return x
        span = suffix.span
        query = q.view(b, t, attn.heads, attn.head_dim)
        attended = prefix_attention(query, keys[:, :span, 0], values[:, :span, 0], suffix.key_bias[:, :span])
        return self._fused_output(x, attended)

    def _fused_output(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rest of a fused layer after attention: the output projection with the residual, then the MLP."""
        b, t, width = x.shape
        flat = torch.addmm(x.reshape(b * t, width), attended.reshape(b * t, -1), self.self_attn.o_proj.weight.t())
        normed = F.rms_norm(flat, (width,), self.post_attention_scale, self.post_attention_layernorm.eps)
        flat = torch.addmm(flat, gelu_tanh_mul(F.linear(normed, self.gate_up_weight)), self.mlp.down_proj.weight.t())
        return flat.view(b, t, width)


def _per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Keys or values for every query head (pi0 has one KV head): the masked fused attention kernels take no GQA."""
    if t.shape[1] == heads:
        return t
    if t.shape[1] == 1:
        return t.expand(-1, heads, -1, -1)
    return t.repeat_interleave(heads // t.shape[1], 1)


class _GemmaStack(nn.Module):
    def __init__(self, config: GemmaConfig, embeddings: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if embeddings else None
        self.layers = nn.ModuleList(_GemmaLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = _RmsNorm(config.hidden_size, config.rms_norm_eps)


class _LanguageModel(nn.Module):
    def __init__(self, config: GemmaConfig, embeddings: bool) -> None:
        super().__init__()
        self.model = _GemmaStack(config, embeddings)


def _rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> KV:
    """cos and sin of each position (B, T) for rotate-half RoPE, shaped (B, 1, T, head_dim)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv
    angles = torch.cat([angles, angles], -1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, rope: KV) -> torch.Tensor:
    cos, sin = rope
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def _folded_rope(rope: KV) -> KV:
    """:func:`_rope_tables` for :func:`_rotate_folded`: (B, T, 1, D), the sine's first half negated."""
    cos, sin = rope
    half = sin.shape[-1] // 2
    return cos.transpose(1, 2), torch.cat([-sin[..., :half], sin[..., half:]], -1).transpose(1, 2)


def _rotate_folded(x: torch.Tensor, rope: KV) -> torch.Tensor:
    """:func:`_rotate` of (B, T, heads, D) in three kernels: the halves swapped, times the signed sine, plus x cos."""
    cos, signed_sin = rope
    *lead, dim = x.shape
    swapped = x.reshape(*lead, 2, dim // 2).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, swapped, signed_sin)


# ---- pi0 -----------------------------------------------------------------------------------------------------------


class _PaliGemma(nn.Module):
    def __init__(self, dims: Pi0Dims) -> None:
        super().__init__()
        vision, backbone = dims.vision_config(), dims.backbone_config()
        self.vision_tower = _VisionTower(vision)
        self.multi_modal_projector = _Projector(vision.hidden_size, backbone.hidden_size)
        self.language_model = _LanguageModel(backbone, embeddings=True)


class _PaliGemmaWithExpert(nn.Module):
    def __init__(self, dims: Pi0Dims) -> None:
        super().__init__()
        self.paligemma = _PaliGemma(dims)
        self.gemma_expert = _LanguageModel(dims.expert_config(), embeddings=False)


class Pi0FlowMatching(nn.Module):
    """The network: the two experts and the projections in and out of the action expert."""

    def __init__(self, dims: Pi0Dims) -> None:
        super().__init__()
        width = dims.expert_config().hidden_size
        self.paligemma_with_expert = _PaliGemmaWithExpert(dims)
        self.state_proj = nn.Linear(dims.max_state_dim, width)
        self.action_in_proj = nn.Linear(dims.max_action_dim, width)
        self.action_out_proj = nn.Linear(width, dims.max_action_dim)
        self.action_time_mlp_in = nn.Linear(2 * width, width)
        self.action_time_mlp_out = nn.Linear(width, width)


class Pi0Policy(nn.Module):
    """LeRobot's ``PI0Policy`` shape: the network under ``model``. :meth:`sample_actions` is the whole inference."""

    def __init__(self, dims: Pi0Dims) -> None:
        super().__init__()
        self.dims = dims
        self.model = Pi0FlowMatching(dims)
        backbone = dims.backbone_config()
        self._head_dim = backbone.head_dim
        expert = dims.expert_config()
        if (expert.head_dim, expert.num_hidden_layers) != (backbone.head_dim, backbone.num_hidden_layers):
            raise ValueError("the action expert must match the backbone's head size and depth (it attends to it)")
        self._expert_heads = expert.num_attention_heads
        self._theta = float(getattr(backbone, "rope_theta", None) or 10_000.0)
        self.packed = False

    def pack(self) -> None:
        """Build the merged weights the fused path reads (``fused=True``); once, after the weights are final."""
        vision = self.model.paligemma_with_expert.paligemma.vision_tower.vision_model
        for siglip in vision.encoder.layers:
            assert isinstance(siglip, _SiglipLayer)
            siglip.self_attn.pack()
        for layer in (*self._backbone_layers(), *self._expert_layers()):
            layer.pack()
        self.packed = True

    def _backbone_layers(self) -> list[_GemmaLayer]:
        return list(self.model.paligemma_with_expert.paligemma.language_model.model.layers)  # type: ignore[arg-type]

    def _expert_layers(self) -> list[_GemmaLayer]:
        return list(self.model.paligemma_with_expert.gemma_expert.model.layers)  # type: ignore[arg-type]

    def embed_prefix(
        self, images: torch.Tensor, tokens: torch.Tensor, token_mask: torch.Tensor, fused: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Image tokens of every camera, then prompt tokens: (B, P, width) and the valid mask (B, P).

        The vision tower runs once over every camera of every observation (B * cameras images in one batch)."""
        paligemma = self.model.paligemma_with_expert.paligemma
        b, cameras = images.shape[:2]
        seen = paligemma.vision_tower.vision_model(images.flatten(0, 1), fused)
        image_emb = paligemma.multi_modal_projector.linear(seen)
        image_emb = image_emb * math.sqrt(image_emb.shape[-1])
        image_emb = image_emb.view(b, cameras * image_emb.shape[1], image_emb.shape[2])
        embed = paligemma.language_model.model.embed_tokens
        assert embed is not None
        text_emb = embed(tokens) * math.sqrt(embed.embedding_dim)
        valid = torch.cat([torch.ones(image_emb.shape[:2], dtype=torch.bool, device=tokens.device), token_mask], 1)
        return torch.cat([image_emb, text_emb.to(image_emb.dtype)], 1), valid

    def prefix_kv(
        self, images: torch.Tensor, tokens: torch.Tensor, token_mask: torch.Tensor, fused: bool = False
    ) -> tuple[list[KV], torch.Tensor]:
        """Run the backbone over the prefix once, all observations in one forward (padding masked): its per-layer
        keys and values and the prefix's valid mask."""
        x, valid = self.embed_prefix(images, tokens, token_mask, fused)
        positions = valid.long().cumsum(1) - 1
        rope = _rope_tables(positions, self._head_dim, self._theta, x.dtype)
        mask = valid[:, None, None, :]
        kv: list[KV] = []
        layers = self._backbone_layers()
        if fused:
            folded = _folded_rope(rope)
            for i, layer in enumerate(layers):
                x, layer_kv = layer.fused(x, folded, mask, kv_only=i == len(layers) - 1)
                kv.append(layer_kv)
        else:
            for layer in layers:
                x, layer_kv = layer(x, rope, mask)
                kv.append(layer_kv)
        return kv, valid

    def velocity(
        self, context: list[KV], state_emb: torch.Tensor, actions: torch.Tensor, suffix: _Suffix, time_emb: torch.Tensor
    ) -> torch.Tensor:
        """The action expert's flow velocity for the noisy ``actions`` (B, H, max_action_dim) at one flow time."""
        model = self.model
        b, horizon, _ = actions.shape
        mixed = torch.cat([model.action_in_proj(actions), time_emb.expand(b, horizon, -1)], -1)
        action_emb = model.action_time_mlp_out(F.silu(model.action_time_mlp_in(mixed)))
        x = torch.cat([state_emb, action_emb], 1)
        for layer, buffers in zip(self._expert_layers(), context, strict=True):
            if suffix.fused:
                x, _ = layer.fused(x, suffix.rope, suffix.mask, buffers)
            else:
                x, _ = layer(x, suffix.rope, suffix.mask, buffers)
        x = model.paligemma_with_expert.gemma_expert.model.norm(x)
        return model.action_out_proj(x[:, 1:])  # type: ignore[no-any-return]

    def _denoise_over_cache(
        self, kv: list[KV], valid: torch.Tensor, state: torch.Tensor, noise: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`denoise` with the state token's keys and values cached (``state_cache``)."""
        b, horizon, _ = noise.shape
        prefix = valid.shape[1]
        caches: list[KV] = []
        for k, v in kv:  # (B, 1, P, D) each: the cache holds the prefix, then the state token, then the actions
            keys = torch.empty(b, prefix + 1 + horizon, 1, self._head_dim, device=noise.device, dtype=k.dtype)
            values = torch.empty_like(keys)
            keys[:, :prefix, 0] = k[:, 0]
            values[:, :prefix, 0] = v[:, 0]
            caches.append((keys, values))
        bias = key_bias(valid, 1 + horizon)
        state_rows = self._cached_suffix(valid, 0, 1, bias, noise.dtype)
        x = self.model.state_proj(state.to(noise.dtype))[:, None]
        layers = self._expert_layers()
        for i, (layer, cache) in enumerate(zip(layers, caches, strict=True)):
            x = layer.fused_over_cache(x, state_rows, cache, kv_only=i == len(layers) - 1)
        action_rows = self._cached_suffix(valid, 1, horizon, bias, noise.dtype)
        steps = self.dims.flow_steps
        dt = -1.0 / steps
        times = _time_embeddings(1.0, dt, steps, x.shape[-1], noise.device, noise.dtype)
        x = noise
        for i in range(steps):
            x = x + dt * self._velocity_over_cache(caches, x, action_rows, times[i])
        return x

    def _cached_suffix(
        self, valid: torch.Tensor, first: int, count: int, bias: torch.Tensor, dtype: torch.dtype
    ) -> _CachedSuffix:
        """The rows of suffix tokens ``first .. first + count - 1`` (0: the state token, then the actions)."""
        b, prefix = valid.shape
        offsets = first + torch.arange(count, device=valid.device)
        cos, sin = _rope_tables(valid.long().sum(1, keepdim=True) + offsets, self._head_dim, self._theta, dtype)
        return _CachedSuffix(
            cos=cos.reshape(b * count, -1),
            sin=sin.reshape(b * count, -1),
            slots=torch.arange(b, device=valid.device).repeat_interleave(count),
            positions=(prefix + offsets).repeat(b),
            key_bias=bias,
            span=prefix + first + count,
        )

    def _velocity_over_cache(
        self, caches: list[KV], actions: torch.Tensor, rows: _CachedSuffix, time_emb: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`velocity` of the action tokens alone, over the expert's caches (the state token's in them)."""
        model = self.model
        b, horizon, _ = actions.shape
        mixed = torch.cat([model.action_in_proj(actions), time_emb.expand(b, horizon, -1)], -1)
        x = model.action_time_mlp_out(F.silu(model.action_time_mlp_in(mixed)))
        for layer, cache in zip(self._expert_layers(), caches, strict=True):
            x = layer.fused_over_cache(x, rows, cache)
        return model.action_out_proj(model.paligemma_with_expert.gemma_expert.model.norm(x))  # type: ignore[no-any-return]

    def _suffix(self, valid: torch.Tensor, horizon: int, dtype: torch.dtype, fused: bool) -> _Suffix:
        """The suffix's RoPE tables and attention mask, the same at every flow step."""
        b, length = valid.shape[0], 1 + horizon
        positions = valid.long().sum(1, keepdim=True) + torch.arange(length, device=valid.device)
        rope = _rope_tables(positions, self._head_dim, self._theta, dtype)
        # rows: state, then actions; columns: prefix, state, actions. The state token does not see the actions.
        sees_suffix = torch.ones(length, length, dtype=torch.bool, device=valid.device)
        sees_suffix[0, 1:] = False
        mask = torch.cat([valid[:, None, :].expand(b, length, -1), sees_suffix.expand(b, -1, -1)], 2)[:, None]
        if fused:  # the query heads folded into the rows: row t * heads + h is token t's head h
            return _Suffix(_folded_rope(rope), mask.repeat_interleave(self._expert_heads, 2), fused=True)
        return _Suffix(rope, mask, fused=False)

    def sample_actions(
        self,
        images: torch.Tensor,
        tokens: torch.Tensor,
        token_mask: torch.Tensor,
        state: torch.Tensor,
        noise: torch.Tensor,
        fused: bool = False,
        state_cache: bool = False,
    ) -> torch.Tensor:
        """Flow-matching sampling in ``flow_steps`` Euler steps from ``noise`` (t = 1) to actions (t = 0).

        ``images`` (B, cameras, 3, S, S) in [-1, 1]; ``tokens``/``token_mask`` (B, L); ``state`` (B, max_state_dim),
        already normalized and padded; ``noise`` (B, horizon, max_action_dim). Returns (B, horizon, max_action_dim).
        ``fused``: the merged-weight layers (after :meth:`pack`), the same function in about half the kernels.
        ``state_cache`` (with ``fused``): the state token's keys and values computed once, not at every flow step
        (:meth:`denoise`).
        """
        kv, valid = self.prefix_kv(images, tokens, token_mask, fused)
        return self.denoise(kv, valid, state, noise, fused, state_cache)

    def denoise(
        self,
        kv: list[KV],
        valid: torch.Tensor,
        state: torch.Tensor,
        noise: torch.Tensor,
        fused: bool = False,
        state_cache: bool = False,
    ) -> torch.Tensor:
        """The action expert's ``flow_steps`` Euler steps over the prefix's keys and values (:meth:`prefix_kv`).

        ``state_cache``: the state token sees the prefix and itself, never the actions, and gets no time embedding,
        so its hidden state, hence its keys and values, are the same at every layer of every flow step. They are
        computed once (one pass of that token through the expert) and cached after the prefix's; each flow step then
        runs the action tokens alone, and their attention needs no mask but the prefix's padding.
        """
        if state_cache:
            if not fused:
                raise ValueError("the state cache runs on the fused layers (fused=True, after pack())")
            return self._denoise_over_cache(kv, valid, state, noise)
        b, horizon, _ = noise.shape
        heads = 1 if fused else self._expert_heads
        prefix, total = valid.shape[1], valid.shape[1] + 1 + horizon
        # Per layer, key and value buffers: the prefix part is filled once, the suffix at each step.
        context: list[KV] = []
        for k, v in kv:
            keys = torch.empty(b, heads, total, self._head_dim, device=noise.device, dtype=k.dtype)
            values = torch.empty_like(keys)
            keys[:, :, :prefix] = _per_head(k, heads)
            values[:, :, :prefix] = _per_head(v, heads)
            context.append((keys, values))
        suffix = self._suffix(valid, horizon, noise.dtype, fused)
        state_emb = self.model.state_proj(state.to(noise.dtype))[:, None]
        steps = self.dims.flow_steps
        dt = -1.0 / steps
        times = _time_embeddings(1.0, dt, steps, state_emb.shape[-1], noise.device, noise.dtype)
        x = noise
        for i in range(steps):
            x = x + dt * self.velocity(context, state_emb, x, suffix, times[i])
        return x


@dataclass(frozen=True)
class _Suffix:
    rope: KV
    mask: torch.Tensor
    fused: bool


@dataclass(frozen=True)
class _CachedSuffix:
    """Tokens run over the expert's caches: their rows' RoPE tables (B * T, D), the batch row and cache position each
    writes its keys and values at (B * T,), the additive key mask (B, S) and how many cache positions they attend."""

    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    key_bias: torch.Tensor
    span: int


def _time_embeddings(
    start: float, step: float, steps: int, width: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """pi0's sine-cosine embedding of the flow times ``start + i * step`` (periods 4e-3 to 4): (steps, 1, 1, width)."""
    fraction = torch.linspace(0.0, 1.0, width // 2, device=device, dtype=torch.float32)
    period = 4e-3 * (4.0 / 4e-3) ** fraction
    # built on the device from arange: a host tensor copied in would break CUDA graph capture
    t = start + step * torch.arange(steps, device=device, dtype=torch.float32)[:, None]
    angle = (2 * math.pi / period) * t
    return torch.cat([angle.sin(), angle.cos()], -1)[:, None, None].to(dtype)


def build_random(dims: Pi0Dims, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Pi0Policy:
    """The model with random weights (normal, std 0.02; norms at one), allocated straight on ``device``."""
    with torch.device("meta"):
        policy = Pi0Policy(dims)
    policy = policy.to_empty(device=device).to(dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
            else:
                parameter.normal_(0.0, 0.02, generator=generator)
        for module in policy.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
            elif isinstance(module, _RmsNorm):
                module.weight.zero_()
    return policy.eval()
