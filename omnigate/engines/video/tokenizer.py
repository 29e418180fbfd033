"""A byte-level tokenizer with UMT5's special tokens, for shape presets that have no trained tokenizer.

Ids 0, 1 and 2 are ``<pad>``, ``</s>`` and ``<unk>`` as in UMT5; byte ``b`` of the UTF-8 text is id ``3 + b``.
Every encoding ends with ``</s>``, as T5 tokenizers add it.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from omnigate.engines.byte_tokens import byte_symbols

PAD_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "</s>", "<unk>"
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
BYTE_OFFSET = 3
BYTE_VOCAB_SIZE = BYTE_OFFSET + 256


def byte_level_tokenizer() -> Any:
    """A transformers fast tokenizer (it saves and loads like any other) over UTF-8 bytes."""
    vocab = {PAD_TOKEN: PAD_ID, EOS_TOKEN: EOS_ID, UNK_TOKEN: UNK_ID}
    vocab.update({symbol: BYTE_OFFSET + byte for byte, symbol in enumerate(byte_symbols())})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(single=f"$A {EOS_TOKEN}", special_tokens=[(EOS_TOKEN, EOS_ID)])
    fast: Any = PreTrainedTokenizerFast
    return fast(tokenizer_object=core, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, unk_token=UNK_TOKEN)
