"""Token ids of text units, made where the text arrives (a gateway process) by an engine's :class:`UnitTokens`.

An engine that tokenizes its text units on its stepping thread spends that thread's time on every unit of every
stream; a gateway process that serves the streams can make the same ids as the text arrives and send them with the
text. This module builds the encoder from the engine's description and nothing else (no model, no transformers):
the ``bytes`` tokenizer is the UTF-8 bytes themselves, a ``tokenizer.json`` file is read with ``tokenizers``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from omnigate.engines.base import UnitTokens

log = logging.getLogger(__name__)

MAX_UNIT_CHARS = 65_536
"""Longer units are left to the engine (it bounds them itself): the ids never cost more than the text."""


class UnitEncoder:
    """``encode(speaker, text)``: a unit's ids as the engine would make them."""

    def __init__(self, spec: UnitTokens, body: Callable[[str], list[int]]) -> None:
        self.spec = spec
        self._body = body

    def encode(self, speaker: str, text: str) -> list[int] | None:
        """The ids of ``text`` spoken by ``speaker``, or None where the engine should tokenize it."""
        if len(text) > MAX_UNIT_CHARS:
            return None
        return [self.spec.bos_id, *self._body(f"[{speaker}]{text}"), self.spec.eos_id]


def load_unit_encoder(spec: UnitTokens | None) -> UnitEncoder | None:
    """The encoder ``spec`` describes, or None (no spec, or a tokenizer file this process cannot read: the text
    then crosses alone and the engine tokenizes it). Reads a file: call it off the event loop."""
    if spec is None:
        return None
    if spec.tokenizer == "bytes":
        return UnitEncoder(spec, _utf8_ids)
    try:
        from tokenizers import Tokenizer

        core = Tokenizer.from_file(spec.tokenizer)
    except Exception as exc:
        log.warning("the engine's tokenizer %s is not readable here (%s): the engine tokenizes", spec.tokenizer, exc)
        return None

    def body(prompt: str) -> list[int]:
        ids: list[int] = core.encode(prompt, add_special_tokens=False).ids
        return ids

    return UnitEncoder(spec, body)


def valid_unit_ids(spec: UnitTokens, tokens: list[int]) -> bool:
    """Whether ``tokens`` can be a unit's ids under ``spec``: framed by its bos and eos, every id in the vocabulary."""
    return (
        len(tokens) >= 2
        and tokens[0] == spec.bos_id
        and tokens[-1] == spec.eos_id
        and min(tokens) >= 0
        and max(tokens) < spec.vocab_size
    )


def _utf8_ids(prompt: str) -> list[int]:
    return list(prompt.encode())
