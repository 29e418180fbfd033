"""Text to token ids and back for the thinker, with incremental decoding of a streamed answer.

Shape presets have random weights and no vocabulary of their own: they use :class:`PrintableTokenizer`, whose ids
are the printable ASCII characters (so a random answer is readable text with sentence ends now and then). A
checkpoint directory brings its own tokenizer, wrapped by :class:`HfTokenizer`.
"""

from __future__ import annotations

import abc
import string
from typing import Any

PRINTABLE = string.ascii_letters + string.digits + string.punctuation + " "


class ThinkerTokenizer(abc.ABC):
    """What the thinker needs of a tokenizer."""

    eos_ids: frozenset[int]

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abc.abstractmethod
    def decode(self, ids: list[int]) -> str: ...

    def count(self, text: str) -> int:
        """Tokens ``text`` takes (the history budget's unit)."""
        return len(self.encode(text))

    @abc.abstractmethod
    def chat_prefix(self, system: str) -> str:
        """Text before the conversation: the system turn."""

    @abc.abstractmethod
    def turn(self, role: str, text: str) -> str:
        """One finished turn of the history."""

    @abc.abstractmethod
    def user_open(self) -> str:
        """Opens the user turn whose media and question follow."""

    @abc.abstractmethod
    def user_close(self, question: str) -> str:
        """Ends the user turn with its question and opens the assistant's answer."""


class PrintableTokenizer(ThinkerTokenizer):
    """One id per printable ASCII character; id ``len(PRINTABLE)`` ends the answer. Role markers are plain text."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < len(PRINTABLE) + 1:
            raise ValueError(f"a printable vocabulary needs {len(PRINTABLE) + 1} ids, the model has {vocab_size}")
        self._ids = {c: i for i, c in enumerate(PRINTABLE)}
        self.eos_ids = frozenset({len(PRINTABLE)})

    def encode(self, text: str) -> list[int]:
        space = self._ids[" "]
        return [self._ids.get(c, space) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(PRINTABLE[i] for i in ids if 0 <= i < len(PRINTABLE))

    def chat_prefix(self, system: str) -> str:
        return f"system: {system}\n"

    def turn(self, role: str, text: str) -> str:
        return f"{role}: {text}\n"

    def user_open(self) -> str:
        return "user: "

    def user_close(self, question: str) -> str:
        return f" {question}\nassistant: "


class HfTokenizer(ThinkerTokenizer):
    """A checkpoint's tokenizer with the Qwen chat markup (``<|im_start|>role ... <|im_end|>``)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        eos = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_ids = frozenset(int(i) for i in eos if isinstance(i, int) and i >= 0)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def chat_prefix(self, system: str) -> str:
        return f"<|im_start|>system\n{system}<|im_end|>\n"

    def turn(self, role: str, text: str) -> str:
        return f"<|im_start|>{role}\n{text}<|im_end|>\n"

    def user_open(self) -> str:
        return "<|im_start|>user\n"

    def user_close(self, question: str) -> str:
        return f"{question}<|im_end|>\n<|im_start|>assistant\n"


class IncrementalDecoder:
    """Turns a growing list of ids into text deltas, holding back a tail that may still be half a character."""

    def __init__(self, tokenizer: ThinkerTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._emitted = ""

    def push(self, token: int) -> str:
        self._ids.append(token)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next token
            return ""
        delta = text[len(self._emitted) :] if text.startswith(self._emitted) else ""
        self._emitted = text
        return delta

    @property
    def text(self) -> str:
        return self._emitted
