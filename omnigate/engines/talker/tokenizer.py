"""Text tokens of a CSM segment, and the byte-level tokenizer that shape presets use instead of a real one.

CSM's prompt puts each segment's text as ``<bos>[speaker]text<eos>`` before that segment's audio frames (the
layout of the Sesame reference generator and of the transformers chat template).
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from omnigate.engines.byte_tokens import byte_symbols

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
AUDIO_TOKEN = "<|AUDIO|>"
AUDIO_EOS_TOKEN = "<|audio_eos|>"
BYTE_VOCAB_SIZE = 260  # 256 byte tokens, then bos, eos, audio, audio_eos


def byte_level_tokenizer() -> Any:
    """A tokenizer whose token id is the UTF-8 byte value (0-255), followed by CSM's four special tokens."""
    vocab = {symbol: byte for byte, symbol in enumerate(byte_symbols())}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    fast: Any = PreTrainedTokenizerFast
    return fast(
        tokenizer_object=core,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=[AUDIO_TOKEN, AUDIO_EOS_TOKEN],
    )


class SegmentTokenizer:
    """Turns a speaker and a text unit into the token ids of one CSM segment."""

    def __init__(self, tokenizer: Any, source: str | None = None) -> None:
        """``source``: where a gateway process finds the same tokenizer (:class:`UnitTokens`), if anywhere."""
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        if bos is None or eos is None:
            raise ValueError("the talker tokenizer needs bos and eos tokens")
        self._tokenizer = tokenizer
        # A fast tokenizer's Rust core, called directly: the engine encodes every unit on its step thread, and the
        # transformers wrapper around it costs several times the encoding itself.
        self._core = getattr(tokenizer, "backend_tokenizer", None)
        self.bos_id = int(bos)
        self.eos_id = int(eos)
        self.source = source

    def encode(self, speaker: str, text: str) -> list[int]:
        """``<bos>[speaker]text<eos>`` as ids."""
        prompt = f"[{speaker}]{text}"
        if self._core is not None:
            body = self._core.encode(prompt, add_special_tokens=False).ids
        else:
            body = self._tokenizer.encode(prompt, add_special_tokens=False)
        return [self.bos_id, *(int(i) for i in body), self.eos_id]
