"""The video-chat session's prompt text (Qwen chat markup) as Qwen3-Omni's ids: each turn's role and end markers are
the model's own special ids, whatever the tokenizer; text outside a turn stays text."""

from __future__ import annotations

from omnigate.engines.qwen3_omni.presets import preset_config
from omnigate.engines.qwen3_omni.tokenizer import PrintableChatTokenizer
from omnigate.engines.qwen3_omni.video_chat import Qwen3PromptFormat


def test_history_text_becomes_the_chat_turns_ids() -> None:
    tok = PrintableChatTokenizer(preset_config("tiny"))
    prompt = Qwen3PromptFormat(tok)
    context = prompt.chat_prefix("be brief") + prompt.turn("user", "hi\nthere") + prompt.turn("assistant", "yes.")
    expected = (
        tok.turn("system", tok.encode("be brief"))
        + tok.turn("user", tok.encode("hi\nthere"))
        + tok.turn("assistant", tok.encode("yes."))
    )
    assert prompt.ids(context) == expected
    assert prompt.count(context) == len(expected)
    assert prompt.ids("plain <|im_start|>x") == tok.encode("plain <|im_start|>x")
