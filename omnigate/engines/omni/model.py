"""Loading the omni thinker: Qwen2.5-Omni's thinker (vision encoder, audio encoder, language model) from transformers.

``--omni-model preset:NAME`` builds a published shape with random weights (``tiny`` for CPU tests,
``qwen2.5-omni-3b`` for GPU measurements); a directory is a local checkpoint: a whole Qwen2.5-Omni checkpoint (its
thinker is kept, the talker and vocoder are not loaded) or a thinker-only one, with its tokenizer.

:class:`OmniModel` holds the modules and does the tensor work the engine schedules: one frame (an image, repeated
to the vision encoder's temporal patch) to its vision tokens, 16 kHz audio to audio tokens, token ids to embeddings,
a prefill of one answer's prompt into its slot of a :class:`~omnigate.engines.kv.slots.SlotKVCache`, and one batched
decode step over the last token of every answer. Positions are sequential for every token, and the three rotary
(mrope) sections get the same index, so vision tokens cached per frame stay valid wherever they are placed and the
multimodal rotary embedding is the ordinary 1-D one: a table of cos/sin per position, built once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer, WhisperFeatureExtractor
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniThinkerConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniForConditionalGeneration,
    Qwen2_5OmniThinkerForConditionalGeneration,
)

from omnigate.engines.kv.decoder_stack import DecoderStack
from omnigate.engines.kv.slots import SlotKVCache
from omnigate.engines.omni.decode_step import POSITION, SLOT, TEMPERATURE, UNIFORM, DecodeSteps, pad_step_rows
from omnigate.engines.omni.request import AUDIO_RATE
from omnigate.engines.omni.sampling import sample_rows
from omnigate.engines.omni.tokenizer import HfTokenizer, PrintableTokenizer, ThinkerTokenizer
from omnigate.engines.omni.vision_attention import use_segmented_attention
from omnigate.kernels.vision_patches import frame_patches

log = logging.getLogger(__name__)

PRESET_PREFIX = "preset:"
DEFAULT_SLOTS = 16
DEFAULT_MAX_CONTEXT = 4096
# CLIP's normalisation, which Qwen's vision encoders were trained with.
_MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(3, 1, 1)
_STD = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(3, 1, 1)


class OmniModelError(ValueError):
    """An ``--omni-model`` value that names no checkpoint directory or preset."""


@dataclass(frozen=True)
class OmniPreset:
    config: Callable[[], Qwen2_5OmniThinkerConfig]
    frame_size: int  # frames are resized to a square of this many pixels (a multiple of 28)


def _tiny_config() -> Qwen2_5OmniThinkerConfig:
    return Qwen2_5OmniThinkerConfig(
        audio_config={
            "d_model": 64, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 128,
            "output_dim": 64, "num_mel_bins": 128, "n_window": 100, "max_source_positions": 1500,
        },
        vision_config={
            "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "out_hidden_size": 64,
            "fullatt_block_indexes": [1], "window_size": 112,
        },
        text_config={
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 32768,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        },
    )  # fmt: skip


def _qwen25_omni_3b_config() -> Qwen2_5OmniThinkerConfig:
    """The published shape of Qwen2.5-Omni-3B's thinker (its config.json's ``thinker_config``)."""
    return Qwen2_5OmniThinkerConfig(
        audio_config={
            "d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20, "encoder_ffn_dim": 5120,
            "output_dim": 2048, "num_mel_bins": 128, "n_window": 100, "max_source_positions": 1500,
        },
        vision_config={
            "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 2048,
            "fullatt_block_indexes": [7, 15, 23, 31], "window_size": 112,
        },
        text_config={
            "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
            "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        },
    )  # fmt: skip


PRESETS: dict[str, OmniPreset] = {
    "tiny": OmniPreset(_tiny_config, frame_size=56),
    "qwen2.5-omni-3b": OmniPreset(_qwen25_omni_3b_config, frame_size=336),
}


class OmniModel:
    """A loaded thinker, its tokenizer and a key/value cache of ``slots`` answers of up to ``max_context`` tokens
    each (prompt and answer); every method runs on the engine's worker thread.

    The cache is preallocated: ``layers * 2 (keys, values) * kv_heads * head_dim * max_context`` elements per slot,
    for the 3B shape (36 layers, 2 key/value heads of 128) in bfloat16 36 KiB per token, 144 MiB per slot at the
    default 4096 tokens (2.4 GiB for 16 slots, 9.1 GiB for 64, each with the cache's scratch slot).
    """

    def __init__(
        self,
        thinker: Any,
        tokenizer: ThinkerTokenizer,
        *,
        name: str,
        frame_size: int,
        random_weights: bool,
        vocab_limit: int | None = None,
        slots: int = DEFAULT_SLOTS,
        max_context: int = DEFAULT_MAX_CONTEXT,
    ) -> None:
        if slots < 1 or max_context < 1:
            raise OmniModelError(f"slots ({slots}) and max_context ({max_context}) must be positive")
        self.thinker = thinker
        self.tokenizer = tokenizer
        self.name = name
        self.frame_size = frame_size
        self.random_weights = random_weights
        self.vocab_limit = vocab_limit
        vision = thinker.config.vision_config
        self.patch = int(vision.patch_size)
        self.merge = int(vision.spatial_merge_size)
        self.temporal_patch = int(vision.temporal_patch_size)
        # One batched attention call per window length instead of one per window (unless flash is requested).
        use_segmented_attention(thinker.model.visual.config)
        self.device = next(thinker.parameters()).device
        self.dtype = next(thinker.parameters()).dtype
        mel_bins = int(thinker.config.audio_config.num_mel_bins)
        self._features = WhisperFeatureExtractor(feature_size=mel_bins)  # type: ignore[no-untyped-call]
        self._embed = thinker.get_input_embeddings()
        text = thinker.model.language_model
        if "sliding_attention" in text.config.layer_types:
            raise OmniModelError("sliding-window attention layers are not supported")
        self.stack = DecoderStack(text.layers, text.norm, text.config)
        self.cache = SlotKVCache(
            layers=self.stack.layers,
            slots=slots,
            capacity=max_context,
            kv_heads=self.stack.kv_heads,
            head_dim=self.stack.head_dim,
            device=self.device,
            dtype=self.dtype,
        )
        self.slots = slots
        self.max_context = max_context
        # The thinker's own rotary module over positions (p, p, p) for every p: its cos/sin rows at each position.
        positions = torch.arange(max_context, device=self.device).view(1, 1, -1).expand(3, 1, -1)
        probe = torch.zeros(1, 1, device=self.device, dtype=self.dtype)
        with torch.no_grad():
            cos, sin = text.rotary_emb(probe, positions)
        self.rope_cos, self.rope_sin = cos[0].contiguous(), sin[0].contiguous()  # [max_context, head_dim]
        # The head's rows of the ids that can be sampled (a view): the rest would be computed to be cut off.
        self._head: torch.Tensor = thinker.lm_head.weight[:vocab_limit]
        # Decode steps with their sampling on padded rows: from CUDA graphs captured at warm-up on the GPU; on the
        # CPU the eager step (sample, then a forward over the answers that go on) stays the default and reference.
        self.decode_steps = DecodeSteps(
            self._sample_forward, slots=slots, vocab=int(self._head.shape[0]), device=self.device
        )
        self.padded_decode: bool = self.device.type == "cuda"

    @property
    def tokens_per_frame(self) -> int:
        side = self.frame_size // self.patch // self.merge
        return side * side

    def _patches(self, frame: np.ndarray) -> torch.Tensor:
        """One HxWx3 uint8 frame (already ``frame_size`` square) as the vision encoder's flattened patches."""
        return frame_patches(
            frame, patch=self.patch, merge=self.merge, temporal=self.temporal_patch, mean=_MEAN, std=_STD
        )

    @torch.inference_mode()
    def encode_frames(self, frames: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Vision tokens of each frame (``tokens_per_frame`` rows each), in one encoder call."""
        if not frames:
            return []
        grid = self.frame_size // self.patch
        pixels = torch.cat([self._patches(f) for f in frames]).to(self.device, self.dtype)
        grid_thw = torch.tensor([[1, grid, grid]] * len(frames), device=self.device)
        out = self.thinker.get_image_features(pixels, grid_thw)
        return [t.detach() for t in out.pooler_output]

    def synchronize(self) -> None:
        """Wait for the device's queued work (nothing to wait for on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run every stage once before the first question: the vision and audio encoders, a prefill and decode steps
        at the batch sizes of powers of two up to the slots (kernels compile and GEMM algorithms settle on first
        use, which would otherwise land on the first question's answer). Leaves every slot empty."""
        self.encode_frames([np.zeros((self.frame_size, self.frame_size, 3), np.uint8)])
        self.encode_audio(bytes(2 * AUDIO_RATE // 2))
        length = min(8, self.max_context - 1)  # a prompt, and room for one decoded token
        if length < 1:
            return
        prompt = self.embed([0] * length)
        batch = 1
        while True:
            slots = list(range(batch))
            for slot in slots:
                self.prefill(slot, prompt)
            self.decode(slots, torch.zeros(batch, dtype=torch.long, device=self.device))
            if batch >= self.slots:
                break
            batch = min(2 * batch, self.slots)
        self.prefill_many(list(range(min(3, self.slots))), [prompt] * min(3, self.slots))
        for slot in range(self.slots):
            self.cache.reset(slot)
        if self.padded_decode:
            self.decode_steps.capture(self.cache.scratch)
        self.synchronize()

    @torch.inference_mode()
    def encode_audio(self, pcm16: bytes) -> torch.Tensor:
        """Audio tokens (25 per second) of mono s16le 16 kHz audio, at most 30 s of it (the encoder's window)."""
        samples = np.frombuffer(pcm16, dtype="<i2").astype(np.float32) / 32768.0
        samples = samples[: 30 * AUDIO_RATE]
        feats = self._features(samples, sampling_rate=AUDIO_RATE, return_tensors="pt", return_attention_mask=True)
        out = self.thinker.get_audio_features(
            feats["input_features"].to(self.device, self.dtype),
            feature_attention_mask=feats["attention_mask"].to(self.device),
        )
        hidden: torch.Tensor = out.last_hidden_state
        return hidden.detach()

    @torch.inference_mode()
    def embed(self, ids: Sequence[int]) -> torch.Tensor:
        result: torch.Tensor = self._embed(torch.tensor([list(ids)], device=self.device))[0]
        return result

    def room(self, slot: int) -> int:
        """Tokens ``slot`` can still take."""
        return self.max_context - self.cache.length(slot)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = (self.stack.norm(x) @ self._head.t()).float()
        return out

    def _rows(self, x: torch.Tensor, slots: Sequence[int], counts: Sequence[int]) -> torch.Tensor:
        """Append ``x`` (``counts[i]`` rows for ``slots[i]``, in order) to the slots; the last layer's output of each
        slot's last row. Raises :class:`~omnigate.engines.kv.slots.ContextFull` before writing anything."""
        rows = self.cache.plan(slots, counts)
        cos = self.rope_cos.index_select(0, rows.positions)
        sin = self.rope_sin.index_select(0, rows.positions)
        out = self.stack.forward(x, self.cache.keys, self.cache.values, rows.slots, rows.positions, cos, sin)
        self.cache.commit(slots, counts)
        return out.index_select(0, rows.last)

    @torch.inference_mode()
    def prefill(self, slot: int, embeds: torch.Tensor) -> torch.Tensor:
        """Start ``slot`` over with a prompt (``embeds`` ``[L, hidden]``); the next-token logits ``[vocab]`` (float32,
        the first ``vocab_limit`` ids). Raises :class:`~omnigate.engines.kv.slots.ContextFull` when ``L`` exceeds
        ``max_context``."""
        return self.prefill_many([slot], [embeds])[0]

    @torch.inference_mode()
    def prefill_many(self, slots: Sequence[int], prompts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Start each of ``slots`` over with its prompt, all in ONE forward: the prompts' rows are concatenated,
        each at its own slot and positions from 0, and a row attends over its own slot's keys up to its position
        (causal within a prompt, nothing across prompts). The next-token logits ``[len(slots), vocab]``."""
        for slot in slots:
            self.cache.reset(slot)
        x = torch.cat([p.to(self.dtype) for p in prompts])
        return self._logits(self._rows(x, slots, [int(p.shape[0]) for p in prompts]))

    def _sample_forward(
        self, logits: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The padded step (:mod:`~omnigate.engines.omni.decode_step`): sample every row, run the thinker over the
        sampled ids at each row's slot and position; (ids ``[B]``, next logits ``[B, vocab]``). Device work only."""
        sampled = sample_rows(logits, floats[TEMPERATURE], floats[UNIFORM])
        positions = ints[POSITION]
        x = self._embed(sampled).to(self.dtype)
        cos = self.rope_cos.index_select(0, positions)
        sin = self.rope_sin.index_select(0, positions)
        out = self.stack.forward(x, self.cache.keys, self.cache.values, ints[SLOT], positions, cos, sin)
        return sampled, self._logits(out)

    @torch.inference_mode()
    def sample_decode(
        self,
        logits: Sequence[torch.Tensor],
        temperature: Sequence[float],
        uniforms: Sequence[float],
        slots: Sequence[int | None],
    ) -> tuple[list[int], torch.Tensor]:
        """One padded step: sample row ``i`` from ``logits[i]`` and append the sampled id to ``slots[i]`` (None: the
        row's answer cannot go on, it writes nowhere); the ids and the next logits ``[n, vocab]``. Lengths are not
        committed: :meth:`commit_decoded` counts the token of the answers that go on."""
        targets = [None if slot is None else (slot, self.cache.length(slot)) for slot in slots]
        rows = pad_step_rows(temperature, uniforms, targets, self.decode_steps.buckets, self.cache.scratch)
        sampled, following = self.decode_steps.run(logits, rows)
        ids: list[int] = sampled.tolist()
        return ids, following

    def commit_decoded(self, slots: Sequence[int]) -> None:
        """Count the token a :meth:`sample_decode` step appended to each of ``slots``."""
        self.cache.commit(slots, [1] * len(slots))

    @torch.inference_mode()
    def decode(self, slots: Sequence[int], tokens: torch.Tensor) -> torch.Tensor:
        """One step of every answer: append token ``tokens[i]`` (ids ``[B]`` on the device) to ``slots[i]``; the
        next-token logits ``[B, vocab]`` (float32), in one forward over the B rows."""
        x = self._embed(tokens.to(self.device)).to(self.dtype)
        return self._logits(self._rows(x, slots, [1] * len(slots)))


def _dtype(name: str) -> torch.dtype:
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise OmniModelError(f"dtype {name!r}: choose float32, bfloat16 or float16") from None


def build_preset(
    name: str,
    *,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "float32",
    slots: int = DEFAULT_SLOTS,
    max_context: int = DEFAULT_MAX_CONTEXT,
) -> OmniModel:
    """Preset ``name`` with weights drawn from ``seed`` on ``device`` and the printable tokenizer, with a cache of
    ``slots`` answers of ``max_context`` tokens."""
    try:
        preset = PRESETS[name]
    except KeyError:
        raise OmniModelError(f"unknown omni preset {name!r}; choose one of {', '.join(sorted(PRESETS))}") from None
    target = torch.device(device)
    with torch.random.fork_rng(devices=[target] if target.type == "cuda" else []), target:
        torch.manual_seed(seed)
        thinker: Any = Qwen2_5OmniThinkerForConditionalGeneration(preset.config())
    thinker = thinker.to(_dtype(dtype)).eval()
    tokenizer = PrintableTokenizer(int(thinker.config.text_config.vocab_size))
    log.warning("omni preset %r has random weights: its answers are random characters", name)
    return OmniModel(
        thinker,
        tokenizer,
        name=f"{PRESET_PREFIX}{name}",
        frame_size=preset.frame_size,
        random_weights=True,
        vocab_limit=len(tokenizer.eos_ids) + max(tokenizer.eos_ids),
        slots=slots,
        max_context=max_context,
    )


def load_checkpoint(
    path: Path,
    *,
    device: str = "cpu",
    dtype: str = "bfloat16",
    frame_size: int = 336,
    slots: int = DEFAULT_SLOTS,
    max_context: int = DEFAULT_MAX_CONTEXT,
) -> OmniModel:
    """A local Qwen2.5-Omni checkpoint (whole model or thinker only); only local files are read."""
    if not (path / "config.json").is_file():
        raise OmniModelError(f"{path} is not a checkpoint directory (no config.json)")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    torch_dtype = _dtype(dtype)
    thinker: Any
    if config.model_type == "qwen2_5_omni":
        whole: Any = Qwen2_5OmniForConditionalGeneration.from_pretrained(  # type: ignore[no-untyped-call]
            path, local_files_only=True, dtype=torch_dtype, enable_audio_output=False
        )
        thinker = whole.thinker
    elif config.model_type == "qwen2_5_omni_thinker":
        thinker = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
            path, local_files_only=True, dtype=torch_dtype
        )
    else:
        raise OmniModelError(f"{path}: model_type {config.model_type!r} is not a Qwen2.5-Omni checkpoint")
    thinker = thinker.to(device).eval()
    tokenizer: ThinkerTokenizer
    if (path / "tokenizer_config.json").is_file():
        tokenizer = HfTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
        limit = None
    else:  # a checkpoint saved without a tokenizer (a test's tiny model): printable ids
        tokenizer = PrintableTokenizer(int(thinker.config.text_config.vocab_size))
        limit = len(tokenizer.eos_ids) + max(tokenizer.eos_ids)
    return OmniModel(
        thinker,
        tokenizer,
        name=str(path),
        frame_size=frame_size,
        random_weights=False,
        vocab_limit=limit,
        slots=slots,
        max_context=max_context,
    )


def load_omni_model(
    spec: str,
    *,
    seed: int = 0,
    device: str = "cpu",
    dtype: str | None = None,
    frame_size: int | None = None,
    slots: int = DEFAULT_SLOTS,
    max_context: int = DEFAULT_MAX_CONTEXT,
) -> OmniModel:
    """Resolve ``--omni-model``: ``preset:NAME`` or a checkpoint directory (frames resized to ``frame_size``), with a
    cache of ``slots`` answers of ``max_context`` tokens each."""
    if frame_size is not None and (frame_size <= 0 or frame_size % 28):
        raise OmniModelError(f"frame_size {frame_size} must be a positive multiple of 28")
    if spec.startswith(PRESET_PREFIX):
        name = spec[len(PRESET_PREFIX) :]
        model = build_preset(
            name, seed=seed, device=device, dtype=dtype or "float32", slots=slots, max_context=max_context
        )
        if frame_size is not None:
            model.frame_size = frame_size
        return model
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise OmniModelError(f"omni model {spec!r} is neither preset:NAME nor a directory")
    return load_checkpoint(
        path,
        device=device,
        dtype=dtype or "bfloat16",
        frame_size=frame_size or 336,
        slots=slots,
        max_context=max_context,
    )
