"""The published-shape preset carries the released Qwen3-Omni-30B-A3B-Instruct config.json's ids: prompts built with
the released tokenizer's special tokens and the talker's codec and speaker ids must mean the same thing here."""

from __future__ import annotations

from omnigate.engines.qwen3_omni.presets import preset_config


def test_the_published_preset_has_the_released_special_ids() -> None:
    config = preset_config("qwen3-omni-30b-a3b")
    thinker, talker = config.thinker_config, config.talker_config
    # <|audio_start|> 151669, <|audio_end|> 151670 (the serving path writes start + 1), <|audio_pad|> 151675
    assert (thinker.audio_start_token_id, thinker.audio_token_id) == (151669, 151675)
    assert (talker.audio_start_token_id, talker.audio_token_id) == (151669, 151675)
    assert (thinker.image_token_id, thinker.video_token_id) == (151655, 151656)
    assert thinker.position_id_per_seconds == talker.position_id_per_seconds == 13
    assert (config.tts_pad_token_id, config.tts_bos_token_id, config.tts_eos_token_id) == (151671, 151672, 151673)
    codec = (talker.codec_pad_id, talker.codec_bos_id, talker.codec_eos_token_id)
    assert codec == (2148, 2149, 2150)
    assert (talker.codec_nothink_id, talker.codec_think_bos_id, talker.codec_think_eos_id) == (2155, 2156, 2157)
    assert talker.speaker_id == {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
    assert talker.text_config.vocab_size == 3072 and talker.accept_hidden_layer == 24
