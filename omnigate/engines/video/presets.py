"""Shape presets of Wan 2.1-style text-to-video models, built with random weights (``--video-model preset:NAME``).

A preset is a set of constructor arguments, not a model: nothing is allocated until a preset is built, because
``wan-1.3b`` is 1.3 billion transformer parameters. Random weights measure serving speed (it does not depend on
weight values) but produce noise, not video.

The text encoder of every preset is a small UMT5 over a byte-level tokenizer: Wan's UMT5-XXL (5.7B parameters) runs
once per request and would only add load time here; its output width (``text_dim``) matches the transformer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnigate.engines.video.tokenizer import BYTE_VOCAB_SIZE, EOS_ID, PAD_ID


@dataclass(frozen=True)
class VideoDefaults:
    """What a request gets for fields it leaves out."""

    width: int = 832
    height: int = 480
    num_frames: int = 81
    fps: int = 16
    steps: int = 50
    guidance_scale: float = 5.0
    chunk_frames: int = 3  # latent frames per chunk (chunk-causal models only)


# Wan 2.1's scheduler as its Diffusers-format checkpoints publish it (flow matching through UniPC, shift 3.0: 480p).
WAN_SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "flow_shift": 3.0,
    "solver_order": 2,
    "solver_type": "bh2",
    "final_sigmas_type": "zero",
    "lower_order_final": True,
}


@dataclass(frozen=True)
class VideoPreset:
    """Constructor arguments of each component, and the request defaults that suit the model's size."""

    name: str
    transformer: dict[str, Any]
    vae: dict[str, Any]
    text_encoder: dict[str, Any]
    max_sequence_length: int
    defaults: VideoDefaults
    scheduler: dict[str, Any] = field(default_factory=lambda: dict(WAN_SCHEDULER))
    # Chunk-causal (Self-Forcing-style): generated chunk by chunk with a KV cache and a few flow steps per chunk.
    causal: bool = False


def _umt5(d_model: int, *, d_kv: int, d_ff: int, num_layers: int, num_heads: int) -> dict[str, Any]:
    return {
        "vocab_size": BYTE_VOCAB_SIZE,
        "d_model": d_model,
        "d_kv": d_kv,
        "d_ff": d_ff,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "feed_forward_proj": "gated-gelu",
        "pad_token_id": PAD_ID,
        "eos_token_id": EOS_ID,
        "decoder_start_token_id": PAD_ID,
    }


TINY = VideoPreset(
    name="tiny",
    # ~26k transformer parameters and a 0.8M-parameter VAE: a 64x64, 9-frame clip takes about a second on a CPU.
    transformer={
        "patch_size": (1, 2, 2),
        "num_attention_heads": 2,
        "attention_head_dim": 12,
        "in_channels": 16,
        "out_channels": 16,
        "text_dim": 32,
        "freq_dim": 32,
        "ffn_dim": 64,
        "num_layers": 2,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6,
        "rope_max_seq_len": 1024,
    },
    vae={
        "base_dim": 16,
        "z_dim": 16,
        "dim_mult": [1, 2, 2, 2],
        "num_res_blocks": 1,
        "attn_scales": [],
        "temperal_downsample": [False, True, True],
    },
    text_encoder=_umt5(32, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
    max_sequence_length=64,
    defaults=VideoDefaults(width=64, height=64, num_frames=9, fps=8, steps=4),
)

WAN_1_3B = VideoPreset(
    name="wan-1.3b",
    # Wan2.1-T2V-1.3B: 30 layers, 12 heads of 128, FFN 8960, text width 4096; the default (127M) Wan 2.1 VAE.
    transformer={
        "patch_size": (1, 2, 2),
        "num_attention_heads": 12,
        "attention_head_dim": 128,
        "in_channels": 16,
        "out_channels": 16,
        "text_dim": 4096,
        "freq_dim": 256,
        "ffn_dim": 8960,
        "num_layers": 30,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6,
        "rope_max_seq_len": 1024,
    },
    vae={},
    text_encoder=_umt5(4096, d_kv=64, d_ff=1024, num_layers=2, num_heads=8),
    max_sequence_length=512,
    defaults=VideoDefaults(),
)

# The chunk-causal presets: the same shapes, run block-causally over chunks of latent frames with few steps and no
# classifier-free guidance (as Self-Forcing's distilled Wan2.1-T2V-1.3B generator runs).
TINY_CAUSAL = VideoPreset(
    name="tiny-causal",
    transformer=TINY.transformer,
    vae=TINY.vae,
    text_encoder=TINY.text_encoder,
    max_sequence_length=TINY.max_sequence_length,
    defaults=VideoDefaults(width=64, height=64, num_frames=9, fps=8, steps=4, guidance_scale=1.0),
    causal=True,
)

WAN_1_3B_CAUSAL = VideoPreset(
    name="wan-1.3b-causal",
    transformer=WAN_1_3B.transformer,
    vae=WAN_1_3B.vae,
    text_encoder=WAN_1_3B.text_encoder,
    max_sequence_length=WAN_1_3B.max_sequence_length,
    defaults=VideoDefaults(num_frames=81, fps=16, steps=4, guidance_scale=1.0),
    causal=True,
)

PRESETS: dict[str, VideoPreset] = {preset.name: preset for preset in (TINY, WAN_1_3B, TINY_CAUSAL, WAN_1_3B_CAUSAL)}
