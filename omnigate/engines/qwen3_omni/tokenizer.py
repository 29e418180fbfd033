"""Text to ids for Qwen3-Omni's chat markup (``<|im_start|>role\\n ... <|im_end|>\\n``).

A checkpoint with a tokenizer uses it (:class:`HfChatTokenizer`); presets and a checkpoint saved without one use
:class:`PrintableChatTokenizer`: one id per printable ASCII character and the model config's own special ids for the
markup, so prompts built here are the ones transformers' ``generate`` reads (the role markers are the config's
``user_token_id``/``assistant_token_id``/``system_token_id``).
"""

from __future__ import annotations

import abc
from typing import Any

from omnigate.engines.omni.tokenizer import PRINTABLE


class ChatTokenizer(abc.ABC):
    """What the engine needs of a tokenizer: text to ids and back, and the ids of the chat markup."""

    im_start: int
    im_end: int

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abc.abstractmethod
    def decode(self, ids: list[int]) -> str: ...

    @abc.abstractmethod
    def role(self, role: str) -> list[int]:
        """The ids of a role's name after ``<|im_start|>`` (with the newline)."""

    def turn(self, role: str, content: list[int]) -> list[int]:
        """One finished turn."""
        return [self.im_start, *self.role(role), *content, self.im_end, *self.encode("\n")]

    def open_assistant(self) -> list[int]:
        """Opens the assistant's answer."""
        return [self.im_start, *self.role("assistant")]


class PrintableChatTokenizer(ChatTokenizer):
    """Printable characters are ids ``0..94``; the markup ids come from the model's config."""

    def __init__(self, config: Any) -> None:
        self._ids = {c: i for i, c in enumerate(PRINTABLE)}
        self.im_start = int(config.im_start_token_id)
        self.im_end = int(config.im_end_token_id)
        self._roles = {
            "user": int(config.user_token_id),
            "assistant": int(config.assistant_token_id),
            "system": int(config.system_token_id),
        }

    def encode(self, text: str) -> list[int]:
        space = self._ids[" "]
        return [self._ids.get(c, space) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(PRINTABLE[i] for i in ids if 0 <= i < len(PRINTABLE))

    def role(self, role: str) -> list[int]:
        return [self._roles[role], *self.encode("\n")]


class HfChatTokenizer(ChatTokenizer):
    """A checkpoint's tokenizer."""

    def __init__(self, tokenizer: Any, config: Any) -> None:
        self._tok = tokenizer
        self.im_start = int(config.im_start_token_id)
        self.im_end = int(config.im_end_token_id)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def role(self, role: str) -> list[int]:
        return self.encode(f"{role}\n")
