"""Shape presets of Qwen3-Omni with random weights: ``tiny`` for CPU tests, ``qwen3-omni-30b-a3b`` with the
published Qwen3-Omni-30B-A3B shapes (its config.json) for GPU measurements.

The tiny preset's special ids sit right after the printable characters of its tokenizer
(:class:`~omnigate.engines.qwen3_omni.tokenizer.PrintableChatTokenizer`): ``<|im_end|>`` is id 95, the first id
after the 95 printable ones, so a random answer is printable text that ends now and then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig

# Tiny preset ids (a 128-id text vocabulary; codec codes below 64, codec specials from 1064).
TINY_IDS: dict[str, Any] = {
    "im_end_token_id": 95, "im_start_token_id": 96, "user_token_id": 97, "assistant_token_id": 98,
    "system_token_id": 99, "tts_pad_token_id": 100, "tts_bos_token_id": 101, "tts_eos_token_id": 102,
}  # fmt: skip


def _tiny() -> Qwen3OmniMoeConfig:
    text = {
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    }
    return Qwen3OmniMoeConfig(
        thinker_config={
            "audio_config": {
                "d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
                "output_dim": 64, "num_mel_bins": 128, "n_window": 50, "n_window_infer": 800,
                "downsample_hidden_size": 16, "max_source_positions": 1500,
            },
            "vision_config": {
                "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64,
                "deepstack_visual_indexes": [0],
            },
            "text_config": text,
            "audio_token_id": 105, "image_token_id": 106, "video_token_id": 107, "audio_start_token_id": 103,
            "vision_start_token_id": 108, "user_token_id": 97,
        },
        talker_config={
            "text_config": {
                "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1088, "num_experts": 8,
                "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
                "max_position_embeddings": 4096,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            },
            "code_predictor_config": {
                "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 64, "num_code_groups": 4,
            },
            "num_code_groups": 4, "thinker_hidden_size": 64, "spatial_merge_size": 2, "accept_hidden_layer": 1,
            "codec_pad_id": 1080, "codec_bos_id": 1081, "codec_eos_token_id": 1082, "codec_nothink_id": 1083,
            "codec_think_bos_id": 1084, "codec_think_eos_id": 1085,
            "speaker_id": {"chelsie": 1070, "ethan": 1071, "aiden": 1072},
            "audio_token_id": 105, "image_token_id": 106, "video_token_id": 107, "audio_start_token_id": 103,
            "vision_start_token_id": 108,
        },
        code2wav_config={  # the released upsampling (1920 samples a frame: 24 kHz at 12.5 frames a second)
            "codebook_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2, "intermediate_size": 64, "num_quantizers": 4, "decoder_dim": 32,
            "sliding_window": 8,
        },
        **TINY_IDS,
    )  # fmt: skip


def _qwen3_omni_30b_a3b() -> Qwen3OmniMoeConfig:
    """The released Qwen3-Omni-30B-A3B-Instruct config.json's shapes and ids."""
    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [24, 20, 20]}
    return Qwen3OmniMoeConfig(
        thinker_config={
            "audio_config": {
                "d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20, "encoder_ffn_dim": 5120,
                "output_dim": 2048, "num_mel_bins": 128, "n_window": 50, "n_window_infer": 800,
                "conv_chunksize": 500, "downsample_hidden_size": 480, "max_source_positions": 1500,
            },
            "vision_config": {
                "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 2048,
                "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
                "deepstack_visual_indexes": [8, 16, 24],
            },
            "text_config": {
                "hidden_size": 2048, "intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
                "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 152064, "num_experts": 128,
                "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
                "max_position_embeddings": 65536, "rms_norm_eps": 1e-6, "rope_parameters": rope,
            },
            "audio_token_id": 151675, "image_token_id": 151655, "video_token_id": 151656,
            "audio_start_token_id": 151669, "vision_start_token_id": 151652, "user_token_id": 872,
            "position_id_per_seconds": 13,
        },
        talker_config={
            "text_config": {
                "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 20, "num_attention_heads": 16,
                "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 3072, "num_experts": 128,
                "num_experts_per_tok": 6, "moe_intermediate_size": 384, "shared_expert_intermediate_size": 768,
                "max_position_embeddings": 65536, "rope_parameters": rope,
            },
            "code_predictor_config": {
                "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 5, "num_attention_heads": 16,
                "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 2048, "num_code_groups": 16,
            },
            "num_code_groups": 16, "thinker_hidden_size": 2048, "spatial_merge_size": 2, "accept_hidden_layer": 24,
            "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_nothink_id": 2155,
            "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
            "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
            "audio_token_id": 151675, "audio_start_token_id": 151669, "image_token_id": 151655,
            "video_token_id": 151656, "vision_start_token_id": 151652, "position_id_per_seconds": 13,
        },
        code2wav_config={"codebook_size": 2048, "num_quantizers": 16, "sliding_window": 72},
    )  # fmt: skip


PRESETS: dict[str, Callable[[], Qwen3OmniMoeConfig]] = {"tiny": _tiny, "qwen3-omni-30b-a3b": _qwen3_omni_30b_a3b}


def preset_config(name: str) -> Any:
    """The config of preset ``name``; KeyError when there is none."""
    return PRESETS[name]()
