"""Loading Qwen3-Omni and the tensor work its engine schedules: the thinker's text decoder, the talker and its code
predictor, each on its own slot cache (:class:`~omnigate.engines.kv.slots.SlotKVCache`), batched across sessions.

``--model preset:NAME`` builds a preset shape (:mod:`~omnigate.engines.qwen3_omni.presets`) with random weights;
a directory is a local ``Qwen3OmniMoeForConditionalGeneration`` checkpoint (only local files are read).

Positions are sequential for every token and the three rotary (mrope) sections get the same index, so the
multimodal rotary embedding is the ordinary 1-D one for text and audio: a cos/sin table per stack, built once with
the model's own rotary module. A thinker decode step samples every answer's next token and runs the thinker over the
sampled ids in one padded step (:class:`~omnigate.engines.omni.decode_step.DecodeSteps`: a CUDA graph per batch
bucket on CUDA). A talker frame (:meth:`Qwen3OmniModel.talker_frame`) samples each session's first codebook from the
talker's logits, runs the code predictor for the other codebooks (a prefill of two rows, then one row per codebook,
every session at once) and the talker over the frame's summed embeddings plus the next text embedding: one padded
call, captured per bucket on CUDA too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeForConditionalGeneration

from omnigate.engines.duplex.graphs import CapturedCall, batch_buckets
from omnigate.engines.kv.slots import SlotKVCache
from omnigate.engines.omni.decode_step import POSITION, SLOT, TEMPERATURE, UNIFORM, DecodeSteps, pad_step_rows
from omnigate.engines.omni.sampling import sample_rows
from omnigate.engines.qwen3_omni.code2wav_stream import Code2WavStream
from omnigate.engines.qwen3_omni.moe_stack import MoeDecoderStack
from omnigate.engines.qwen3_omni.presets import PRESETS, preset_config
from omnigate.engines.qwen3_omni.tokenizer import ChatTokenizer, HfChatTokenizer, PrintableChatTokenizer
from omnigate.engines.qwen3_omni.vision import FrameTokens, frame_patches, rope_positions

log = logging.getLogger(__name__)

PRESET_PREFIX = "preset:"
DEFAULT_SLOTS = 8
DEFAULT_MAX_CONTEXT = 4096
# The talker's sampling as transformers' generate defaults it (top-p 1.0 is no cut).
TALKER_TOP_K = 50
TALKER_REPETITION_PENALTY = 1.05
# Rows of a talker frame's float inputs: the talker's temperature, then one uniform per codebook.
FRAME_TEMPERATURE = 0


class Qwen3OmniModelError(ValueError):
    """A ``--model`` value that names no checkpoint directory or preset, or options it cannot take."""


@dataclass(frozen=True)
class PromptInputs:
    """A prompt's thinker input rows ``[L, hidden]``, and when it holds frames: its rotary positions ``[3, L]``,
    the ``delta`` decoding continues with, the rows of its image tokens ``[V]`` and their deepstack features
    ``[k, V, hidden]``."""

    rows: torch.Tensor
    positions: torch.Tensor | None = None
    delta: int = 0
    image_rows: torch.Tensor | None = None
    deepstack: torch.Tensor | None = None


@dataclass(frozen=True)
class FrameRows:
    """One talker frame's rows on the host, padded to ``bucket``."""

    bucket: int
    floats: list[list[float]]  # [1 + groups][bucket]: temperature, then a uniform per codebook
    ints: list[list[int]]  # [2][bucket]: slot, talker position


def _rope_table(
    rotary: Any, length: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[length, head_dim]`` of ``rotary`` at positions ``0..length-1`` (the same index in every section)."""
    positions = torch.arange(length, device=device).view(1, 1, -1).expand(3, 1, -1)
    probe = torch.zeros(1, 1, device=device, dtype=dtype)
    with torch.no_grad():
        cos, sin = rotary(probe, positions)
    width = cos.shape[-1]
    return cos.reshape(-1, length, width)[0].contiguous(), sin.reshape(-1, length, width)[0].contiguous()


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``logits`` with every id below each row's ``k``-th largest set to ``-inf``."""
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


class Qwen3OmniModel:
    """A loaded Qwen3-Omni with key/value caches of ``slots`` sessions: the thinker's of ``max_context`` tokens (a
    turn's prompt and answer), the talker's of ``max_context`` rows (its prompt and one row per audio frame), the
    code predictor's of one frame; the streaming Code2Wav's state of ``slots`` sessions. Every method runs on the
    engine's worker thread."""

    def __init__(
        self,
        whole: Any,
        tokenizer: ChatTokenizer,
        *,
        name: str,
        random_weights: bool,
        vocab_limit: int | None = None,
        slots: int = DEFAULT_SLOTS,
        max_context: int = DEFAULT_MAX_CONTEXT,
    ) -> None:
        if slots < 1 or max_context < 16:
            raise Qwen3OmniModelError(f"slots ({slots}) must be positive and max_context ({max_context}) >= 16")
        if not getattr(whole, "has_talker", False):
            raise Qwen3OmniModelError(f"{name}: the checkpoint has no talker (enable_audio_output is off)")
        self.whole = whole
        self.config = whole.config
        self.tokenizer = tokenizer
        self.name = name
        self.random_weights = random_weights
        self.slots = slots
        self.max_context = max_context
        thinker, talker = whole.thinker, whole.talker
        self.device = next(thinker.parameters()).device
        self.dtype = next(thinker.parameters()).dtype
        text = thinker.model.language_model
        self.thinker_stack = MoeDecoderStack(text.layers, text.norm, text.config)
        self.talker_stack = MoeDecoderStack(talker.model.layers, talker.model.norm, talker.config.text_config)
        predictor = talker.code_predictor
        self.predictor_stack = MoeDecoderStack(predictor.model.layers, predictor.model.norm, predictor.config)
        self.groups = int(talker.config.num_code_groups)
        self.accept_layer = int(talker.config.accept_hidden_layer)
        self.thinker_cache = self._cache(self.thinker_stack, max_context)
        self.talker_cache = self._cache(self.talker_stack, max_context)
        self.predictor_cache = self._cache(self.predictor_stack, self.groups + 1)
        self.thinker_rope = _rope_table(text.rotary_emb, max_context, self.device, self.dtype)
        self._thinker_rotary = text.rotary_emb
        self._talker_rotary = talker.model.rotary_emb
        # Each slot's rotary offset while decoding (a prompt with frames ends ``delta`` before its length), the
        # thinker's and the talker's; read by the captured steps at the rows' slots, so device buffers written at
        # each prefill.
        self._rope_delta = torch.zeros(slots + 1, dtype=torch.long, device=self.device)
        self._talker_delta = torch.zeros(slots + 1, dtype=torch.long, device=self.device)
        vision = self.config.thinker_config.vision_config
        self.patch = int(vision.patch_size)
        self.merge = int(vision.spatial_merge_size)
        self.temporal_patch = int(vision.temporal_patch_size)
        # The audio encoder cuts log-mel frames into chunks of twice this many, and pads the chunks of one call to
        # the longest (see :meth:`encode_audios`).
        self.audio_window = int(self.config.thinker_config.audio_config.n_window)
        self.talker_rope = _rope_table(talker.model.rotary_emb, max_context, self.device, self.dtype)
        self.predictor_rope = _rope_table(predictor.model.rotary_emb, self.groups + 1, self.device, self.dtype)
        self.thinker_embed = thinker.get_input_embeddings()
        self._thinker_head: torch.Tensor = thinker.lm_head.weight[:vocab_limit]
        self.vocab_limit = vocab_limit
        self.talker_embed: torch.Tensor = talker.model.codec_embedding.weight  # [codec vocab, talker hidden]
        self._codec_head: torch.Tensor = talker.codec_head.weight
        self._predictor_embeds = [e.weight for e in predictor.model.codec_embedding]  # groups - 1 of [2048, hidden]
        self._predictor_heads = [h.weight for h in predictor.lm_head]
        self.text_projection = talker.text_projection
        self.hidden_projection = talker.hidden_projection
        tc = talker.config
        self.codec_eos = int(tc.codec_eos_token_id)
        self.codec_specials = (
            int(tc.codec_nothink_id), int(tc.codec_think_bos_id), int(tc.codec_think_eos_id),
            int(tc.codec_pad_id), int(tc.codec_bos_id),
        )  # fmt: skip
        self.speakers = {str(k): int(v) for k, v in (tc.speaker_id or {}).items()}
        codec_vocab = int(self._codec_head.shape[0])
        # transformers' generate suppresses the codec's special ids (its last 1024) except the end of speech.
        suppressed = torch.zeros(codec_vocab, dtype=torch.bool, device=self.device)
        suppressed[max(0, codec_vocab - 1024) :] = True
        suppressed[self.codec_eos] = False
        self._suppressed = suppressed
        self._seen = torch.zeros(slots + 1, codec_vocab, dtype=torch.bool, device=self.device)
        self._true = torch.ones((), dtype=torch.bool, device=self.device)
        self.talker_top_k = TALKER_TOP_K
        self.repetition_penalty = TALKER_REPETITION_PENALTY
        with torch.inference_mode():
            specials = torch.tensor(
                [self.config.tts_bos_token_id, self.config.tts_eos_token_id, self.config.tts_pad_token_id],
                device=self.device,
            )
            bos, eos, pad = self.text_projection(self.thinker_embed(specials)).unbind(0)
        self.tts_bos: torch.Tensor = bos
        self.tts_eos: torch.Tensor = eos
        self.tts_pad: torch.Tensor = pad
        self.thinker_steps = DecodeSteps(
            self._thinker_sample_forward, slots=slots, vocab=int(self._thinker_head.shape[0]), device=self.device
        )
        self.frame_buckets = batch_buckets(slots)
        self._frame_graphs: dict[int, CapturedCall] = {}
        # Codec frames to 24 kHz audio, one row per session, exact against a full decode.
        self.code2wav = Code2WavStream(whole.code2wav, slots, self.device, self.dtype)
        self.sample_rate = 24_000

    def _cache(self, stack: MoeDecoderStack, capacity: int) -> SlotKVCache:
        return SlotKVCache(
            layers=stack.layers,
            slots=self.slots,
            capacity=capacity,
            kv_heads=stack.kv_heads,
            head_dim=stack.head_dim,
            device=self.device,
            dtype=self.dtype,
        )

    # ---------------------------------------------------------------- thinker

    @torch.inference_mode()
    def embed_prompt(
        self, ids: Sequence[int], audio: torch.Tensor | None = None, frames: Sequence[FrameTokens] = ()
    ) -> torch.Tensor:
        """The thinker's input rows ``[L, hidden]`` of a prompt: token embeddings, with ``audio`` (``[n, hidden]``)
        in order at the ``n`` audio placeholder ids and the ``frames``' merged embeddings at the image ones."""
        return self.prompt_inputs(ids, audio, frames).rows

    @torch.inference_mode()
    def prompt_inputs(
        self, ids: Sequence[int], audio: torch.Tensor | None = None, frames: Sequence[FrameTokens] = ()
    ) -> PromptInputs:
        """What the thinker's prefill reads of a prompt (:class:`PromptInputs`); its image placeholder runs are the
        ``frames`` in order."""
        config = self.config.thinker_config
        tokens = torch.tensor(list(ids), device=self.device)
        rows: torch.Tensor = self.thinker_embed(tokens).to(self.dtype)
        if audio is not None and audio.shape[0]:
            where = tokens == int(config.audio_token_id)
            if int(where.sum()) != audio.shape[0]:
                raise Qwen3OmniModelError("the prompt's audio placeholders do not match the audio tokens given")
            rows = rows.clone()
            rows[where] = audio.to(rows.dtype)
        if not frames:
            return PromptInputs(rows)
        image_token = int(config.image_token_id)
        try:
            positions = rope_positions(ids, image_token, [f.grid for f in frames])
        except ValueError as exc:
            raise Qwen3OmniModelError(str(exc)) from None
        vision = torch.cat([f.tokens.to(self.device, self.dtype) for f in frames], dim=1)  # [1 + k, V, hidden]
        image_rows = torch.nonzero(tokens == image_token).view(-1)
        rows = rows.index_copy(0, image_rows, vision[0])
        delta = max(max(row) for row in positions) + 1 - len(ids)
        return PromptInputs(
            rows=rows,
            positions=torch.tensor(positions, device=self.device),
            delta=delta,
            image_rows=image_rows,
            deepstack=vision[1:],
        )

    @torch.inference_mode()
    def encode_frames(self, frames: Sequence[np.ndarray]) -> list[FrameTokens]:
        """The vision tokens of each ``H x W x 3`` uint8 frame (sides multiples of ``patch * merge`` pixels), in one
        encoder call."""
        if not frames:
            return []
        patches = [frame_patches(f, patch=self.patch, merge=self.merge, temporal=self.temporal_patch) for f in frames]
        grids = [(f.shape[0] // self.patch, f.shape[1] // self.patch) for f in frames]
        grid_thw = torch.tensor([[1, h, w] for h, w in grids], device=self.device)
        out = self.whole.thinker.get_image_features(torch.cat(patches).to(self.device, self.dtype), grid_thw)
        deepstack = out.deepstack_features  # per deepstack layer, a tuple of per-frame [n, hidden]
        encoded: list[FrameTokens] = []
        for i, (h, w) in enumerate(grids):
            stacked = torch.stack([out.pooler_output[i], *(layer[i] for layer in deepstack)])
            encoded.append(FrameTokens(stacked.detach(), (h // self.merge, w // self.merge)))
        return encoded

    def encode_audio(self, features: torch.Tensor) -> torch.Tensor:
        """Audio tokens ``[n, hidden]`` of log-mel ``features`` ``[mel, frames]`` (the audio encoder's input)."""
        return self.encode_audios([features])[0]

    @torch.inference_mode()
    def encode_audios(self, features: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Audio tokens of each of ``features`` (log-mel ``[mel, frames]`` each), each equal to :meth:`encode_audio`
        of it alone. The encoder pads a call's chunks to the longest: items of at least one whole chunk go in one
        call (their longest chunk is a whole one, alone or not), a shorter item with those of its own length."""
        chunk = 2 * self.audio_window
        groups: dict[int, list[int]] = {}
        for i, item in enumerate(features):
            groups.setdefault(min(int(item.shape[-1]), chunk), []).append(i)
        encoded: list[torch.Tensor] = [torch.empty(0)] * len(features)
        tower = self.whole.thinker.model.audio_tower
        for members in groups.values():
            lengths = [int(features[i].shape[-1]) for i in members]
            joined = torch.cat([features[i] for i in members], dim=-1).to(self.device, self.dtype)
            out = tower(joined, feature_lens=torch.tensor(lengths, device=self.device), return_dict=True)
            counts = [audio_token_count(n, self.audio_window) for n in lengths]
            for i, tokens in zip(members, out.last_hidden_state.split(counts), strict=True):
                encoded[i] = tokens.detach()
        return encoded

    def _thinker_logits(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = (self.thinker_stack.norm(x) @ self._thinker_head.t()).float()
        return out

    @torch.inference_mode()
    def thinker_prefill(
        self, slots: Sequence[int], prompts: Sequence[torch.Tensor | PromptInputs], *, keep: bool = False
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Start each of ``slots`` over with its prompt (rows, or :class:`PromptInputs` when it holds frames), all
        in ONE forward (each row attends over its own slot only). The next-token logits ``[n, vocab]``, and with
        ``keep`` each prompt's thinker hidden states at the talker's ``accept_hidden_layer`` (what the talker reads
        at audio and image positions). Raises :class:`~omnigate.engines.kv.slots.ContextFull` before writing
        anything."""
        for slot in slots:
            self.thinker_cache.reset(slot)
        inputs = [p if isinstance(p, PromptInputs) else PromptInputs(p) for p in prompts]
        counts = [int(p.rows.shape[0]) for p in inputs]
        rows = self.thinker_cache.plan(slots, counts)
        cos, sin = self._rope_rows(
            self._thinker_rotary, self.thinker_rope, [p.positions for p in inputs], counts, rows.positions
        )
        x = torch.cat([p.rows.to(self.dtype) for p in inputs])
        deepstack = self._deepstack(inputs, counts)
        layers = self.thinker_stack.layers
        keep_layer = min(self.accept_layer, layers) if keep else None
        out, kept = self.thinker_stack.forward(
            x, self.thinker_cache.keys, self.thinker_cache.values, rows.slots, rows.positions, cos, sin,
            keep_layer=keep_layer, deepstack=deepstack,
        )  # fmt: skip
        self.thinker_cache.commit(slots, counts)
        self._rope_delta[torch.tensor(list(slots), device=self.device)] = torch.tensor(
            [p.delta for p in inputs], device=self.device
        )
        hidden = None
        if kept is not None:
            if keep_layer == layers:  # transformers' last hidden state is the normed one
                kept = self.thinker_stack.norm(kept)
            hidden = list(torch.split(kept, counts))
        return self._thinker_logits(out.index_select(0, rows.last)), hidden

    def _rope_rows(
        self,
        rotary: Any,
        table: tuple[torch.Tensor, torch.Tensor],
        prompts: Sequence[torch.Tensor | None],
        counts: Sequence[int],
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of prompts' rows: from ``table`` at the cache ``positions``, or for a prompt with frames (its
        three position rows ``[3, L]`` in ``prompts``) from the ``rotary`` module."""
        if all(p is None for p in prompts):
            cos, sin = (t.index_select(0, positions) for t in table)
            return cos, sin
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        start = 0
        for rows, count in zip(prompts, counts, strict=True):
            if rows is None:
                at = positions[start : start + count]
                parts.append((table[0].index_select(0, at), table[1].index_select(0, at)))
            else:
                probe = torch.zeros(1, 1, device=self.device, dtype=self.dtype)
                cos, sin = rotary(probe, rows[:, None, :])
                parts.append((cos.reshape(count, -1), sin.reshape(count, -1)))
            start += count
        return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])

    @staticmethod
    def _deepstack(inputs: Sequence[PromptInputs], counts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The batch's image rows and their deepstack features (every prompt's, offset to its place in the batch)."""
        rows: list[torch.Tensor] = []
        features: list[torch.Tensor] = []
        start = 0
        for p, count in zip(inputs, counts, strict=True):
            if p.image_rows is not None and p.deepstack is not None and p.deepstack.shape[0]:
                rows.append(p.image_rows + start)
                features.append(p.deepstack)
            start += count
        if not rows:
            return None
        return torch.cat(rows), torch.cat(features, dim=1)

    def _thinker_sample_forward(
        self, logits: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sampled = sample_rows(logits, floats[TEMPERATURE], floats[UNIFORM])
        positions = ints[POSITION]
        x = self.thinker_embed(sampled).to(self.dtype)
        rope = positions + self._rope_delta.index_select(0, ints[SLOT])
        cos, sin = (t.index_select(0, rope) for t in self.thinker_rope)
        out, _ = self.thinker_stack.forward(
            x, self.thinker_cache.keys, self.thinker_cache.values, ints[SLOT], positions, cos, sin
        )
        return sampled, self._thinker_logits(out)

    @torch.inference_mode()
    def thinker_step(
        self,
        logits: Sequence[torch.Tensor],
        temperature: Sequence[float],
        uniforms: Sequence[float],
        slots: Sequence[int | None],
    ) -> tuple[list[int], torch.Tensor]:
        """One padded decode step of every answer: sample row ``i`` from ``logits[i]`` and append the id to
        ``slots[i]`` (None: the answer cannot go on, it writes nowhere). The ids and the next logits ``[n, vocab]``;
        :meth:`SlotKVCache.commit` counts the token of the answers that go on."""
        targets = [None if s is None else (s, self.thinker_cache.length(s)) for s in slots]
        rows = pad_step_rows(temperature, uniforms, targets, self.thinker_steps.buckets, self.thinker_cache.scratch)
        sampled, following = self.thinker_steps.run(logits, rows)
        ids: list[int] = sampled.tolist()
        return ids, following

    # ---------------------------------------------------------------- talker

    @torch.inference_mode()
    def talker_user_rows(self, ids: Sequence[int], embeds: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        """The talker's rows for a prompt's user turns (as transformers' ``generate`` builds them): every token of
        a turn whose role is ``user``, the text projection of its thinker embedding, or at audio/image/video
        positions the hidden projection of the thinker's ``accept_hidden_layer`` state."""
        tc = self.config.thinker_config
        multimodal = {int(tc.audio_token_id), int(tc.image_token_id), int(tc.video_token_id)}
        chosen = self._user_positions(ids)
        index = torch.tensor(chosen, device=self.device, dtype=torch.long)
        mm = torch.tensor([ids[i] in multimodal for i in chosen], device=self.device, dtype=torch.bool)
        rows = self.text_projection(embeds.index_select(0, index).to(self.dtype))
        if bool(mm.any()):
            if hidden is None:
                raise Qwen3OmniModelError("a prompt with audio needs the thinker's hidden states")
            rows = rows.clone()
            rows[mm] = self.hidden_projection(hidden.index_select(0, index)[mm].to(self.dtype)).to(rows.dtype)
        out: torch.Tensor = rows
        return out

    def _user_positions(self, ids: Sequence[int]) -> list[int]:
        """The indices of the prompt's tokens in turns whose role is ``user`` (the talker's user rows)."""
        im_start, user = int(self.config.im_start_token_id), int(self.config.user_token_id)
        chosen: list[int] = []
        role = -1
        for i, token in enumerate(ids):
            if token == im_start:
                role = ids[i + 1] if i + 1 < len(ids) else -1
            if role == user:
                chosen.append(i)
        return chosen

    def talker_positions(
        self, ids: Sequence[int], frames: Sequence[FrameTokens], rows: int
    ) -> tuple[torch.Tensor, int]:
        """The rotary positions ``[3, rows]`` of the talker's prompt (``rows`` rows: the user rows of prompt ``ids``,
        then the assistant part) when the prompt holds ``frames``, and the ``delta`` its frames continue from (the
        talker's positions are computed as the thinker's, over its own ids)."""
        talker_ids = [ids[i] for i in self._user_positions(ids)]
        talker_ids += [-1] * (rows - len(talker_ids))  # the assistant part: text positions
        positions = rope_positions(talker_ids, int(self.config.thinker_config.image_token_id), [f.grid for f in frames])
        return torch.tensor(positions, device=self.device), max(max(row) for row in positions) + 1 - rows

    @torch.inference_mode()
    def talker_prompt(self, user_rows: torch.Tensor, assistant_ids: Sequence[int], speaker: str) -> torch.Tensor:
        """The talker's prefill rows: the user rows, then the assistant part: its first three ids (``<|im_start|>``,
        the role, the newline) and the answer's first token (``assistant_ids[3]``), text-projected, with four
        ``tts_pad`` and a ``tts_bos`` between them, each added to the codec's special ids (no-think markers, the
        speaker, pad, bos)."""
        if speaker.lower() not in self.speakers:
            raise Qwen3OmniModelError(f"unknown speaker {speaker!r}; choose one of {', '.join(sorted(self.speakers))}")
        text = self.text_projection(self.thinker_embed(torch.tensor(list(assistant_ids[:4]), device=self.device)))
        text_rows = torch.cat([text[:3], self.tts_pad.expand(4, -1), self.tts_bos[None], text[3:4]])
        nothink, think_bos, think_eos, pad, bos = self.codec_specials
        codec_ids = torch.tensor(
            [nothink, think_bos, think_eos, self.speakers[speaker.lower()], pad, bos], device=self.device
        )
        codec = torch.cat([torch.zeros(3, text.shape[1], device=self.device, dtype=self.dtype),
                           self.talker_embed[codec_ids].to(self.dtype)])  # fmt: skip
        return torch.cat([user_rows.to(self.dtype), (text_rows + codec).to(self.dtype)])

    @torch.inference_mode()
    def trailing_text(self, token: int | None, *, end: bool) -> torch.Tensor:
        """The text row a talker frame adds: the text projection of the answer's next ``token``, ``tts_eos`` right
        after the last one (``end``), ``tts_pad`` afterwards (``token`` None)."""
        if token is not None:
            row: torch.Tensor = self.text_projection(self.thinker_embed(torch.tensor([token], device=self.device)))[0]
            return row
        chosen: torch.Tensor = self.tts_eos if end else self.tts_pad
        return chosen

    def _talker_out(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codec logits float32, normed hidden) of talker outputs."""
        normed = self.talker_stack.norm(x)
        return (normed @ self._codec_head.t()).float(), normed

    @torch.inference_mode()
    def talker_prefill(
        self,
        slots: Sequence[int],
        prompts: Sequence[torch.Tensor],
        positions: Sequence[tuple[torch.Tensor, int] | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Start each of ``slots``' talker over with its prompt rows, in one forward: the first codebook's logits
        ``[n, codec vocab]`` and the talker's last hidden state ``[n, hidden]`` of each. ``positions``: a prompt's
        rotary positions and delta when it holds frames (:meth:`talker_positions`), None when they are sequential."""
        for slot in slots:
            self.talker_cache.reset(slot)
            self._seen[slot] = False
        counts = [int(p.shape[0]) for p in prompts]
        rows = self.talker_cache.plan(slots, counts)
        given = list(positions) if positions is not None else [None] * len(prompts)
        cos, sin = self._rope_rows(
            self._talker_rotary, self.talker_rope, [None if p is None else p[0] for p in given], counts, rows.positions
        )
        x = torch.cat([p.to(self.dtype) for p in prompts])
        out, _ = self.talker_stack.forward(
            x, self.talker_cache.keys, self.talker_cache.values, rows.slots, rows.positions, cos, sin
        )
        self.talker_cache.commit(slots, counts)
        self._talker_delta[torch.tensor(list(slots), device=self.device)] = torch.tensor(
            [0 if p is None else p[1] for p in given], device=self.device
        )
        return self._talker_out(out.index_select(0, rows.last))

    def _sample_codes(self, logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        return sample_rows(top_k_mask(logits, self.talker_top_k), temperature, uniforms)

    def _frame(
        self,
        logits: torch.Tensor,
        hidden: torch.Tensor,
        trailing: torch.Tensor,
        floats: torch.Tensor,
        ints: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The padded frame step (device work only): (codes ``[B, groups]``, next codec logits, next hidden)."""
        slots, positions = ints[0], ints[1]
        temperature = floats[FRAME_TEMPERATURE]
        # The first codebook: repetition penalty over the session's earlier first codes, specials suppressed.
        seen = self._seen.index_select(0, slots)
        penalised = torch.where(logits > 0, logits / self.repetition_penalty, logits * self.repetition_penalty)
        logits = torch.where(seen, penalised, logits).masked_fill(self._suppressed, float("-inf"))
        first = self._sample_codes(logits, temperature, floats[1])
        self._seen.index_put_((slots, first), self._true)  # a device scalar: a graph cannot copy from the host
        # The code predictor: [hidden, embed(first)] as a two-row prefill of each row's predictor slot, then one row
        # per further codebook.
        rows = hidden.shape[0]
        keys, values = self.predictor_cache.keys, self.predictor_cache.values
        pair_slots = slots.repeat_interleave(2)
        pair_positions = torch.arange(2, device=self.device).repeat(rows)
        cos, sin = (t.index_select(0, pair_positions) for t in self.predictor_rope)
        x = torch.stack([hidden, self.talker_embed[first].to(self.dtype)], dim=1).reshape(2 * rows, -1)
        out, _ = self.predictor_stack.forward(x, keys, values, pair_slots, pair_positions, cos, sin)
        last = self.predictor_stack.norm(out.view(rows, 2, -1)[:, 1])
        codes = [first]
        summed = self.talker_embed[first].to(self.dtype)
        for group in range(1, self.groups):
            code = self._sample_codes(
                (last @ self._predictor_heads[group - 1].t()).float(), temperature, floats[1 + group]
            )
            codes.append(code)
            embedded = self._predictor_embeds[group - 1][code].to(self.dtype)
            summed = summed + embedded
            if group == self.groups - 1:
                break
            position = torch.full_like(slots, group + 1)
            cos, sin = (t.index_select(0, position) for t in self.predictor_rope)
            out, _ = self.predictor_stack.forward(embedded, keys, values, slots, position, cos, sin)
            last = self.predictor_stack.norm(out)
        # The talker over the frame: the sum of every codebook's embedding plus the text row.
        rope = positions + self._talker_delta.index_select(0, slots)
        cos, sin = (t.index_select(0, rope) for t in self.talker_rope)
        out, _ = self.talker_stack.forward(
            summed + trailing.to(self.dtype),
            self.talker_cache.keys,
            self.talker_cache.values,
            slots,
            positions,
            cos,
            sin,
        )
        following, normed = self._talker_out(out)
        return torch.stack(codes, dim=1), following, normed

    def pad_frame_rows(
        self, temperature: Sequence[float], uniforms: Sequence[Sequence[float]], slots: Sequence[int | None]
    ) -> FrameRows:
        """A frame's rows: row ``i`` samples with ``temperature[i]`` and ``uniforms[i]`` (one per codebook) and
        appends its frame to ``slots[i]``' talker (None, and the padding up to the bucket: the scratch slot)."""
        count = len(slots)
        bucket = next((b for b in self.frame_buckets if b >= count), None)
        if bucket is None or count == 0:
            raise ValueError(f"a frame of {count} rows does not fit the buckets {self.frame_buckets}")
        pad = bucket - count
        scratch = self.talker_cache.scratch
        ids = [scratch if s is None else s for s in slots] + [scratch] * pad
        positions = [0 if s is None else self.talker_cache.length(s) for s in slots] + [0] * pad
        floats = [list(temperature) + [0.0] * pad]
        for group in range(self.groups):
            floats.append([u[group] for u in uniforms] + [0.0] * pad)
        return FrameRows(bucket=bucket, floats=floats, ints=[ids, positions])

    @torch.inference_mode()
    def talker_frame(
        self,
        logits: Sequence[torch.Tensor],
        hidden: Sequence[torch.Tensor],
        trailing: Sequence[torch.Tensor],
        rows: FrameRows,
    ) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
        """One frame of ``n = len(logits)`` sessions: each one's codes (``groups`` ids; the first is the codec's
        end of speech when it stops), and the talker's next logits and hidden ``[n, ...]``. The talker's length is
        not committed here (the caller commits the sessions whose frame was not the end)."""
        count = len(logits)
        floats = torch.tensor(rows.floats, dtype=torch.float64, device=self.device)
        ints = torch.tensor(rows.ints, dtype=torch.int64, device=self.device)
        bucket = rows.bucket
        captured = self._frame_graphs.get(bucket)
        if captured is None:
            padded_logits = torch.zeros(bucket, logits[0].shape[-1], device=self.device)
            padded_hidden = torch.zeros(bucket, hidden[0].shape[-1], device=self.device, dtype=self.dtype)
            padded_trailing = torch.zeros_like(padded_hidden)
        else:
            padded_logits, padded_hidden, padded_trailing = captured.inputs[:3]
        torch.stack(list(logits), out=padded_logits[:count])
        torch.stack([h.to(self.dtype) for h in hidden], out=padded_hidden[:count])
        torch.stack([t.to(self.dtype) for t in trailing], out=padded_trailing[:count])
        if captured is None:
            codes, following, normed = self._frame(padded_logits, padded_hidden, padded_trailing, floats, ints)
        else:
            codes, following, normed = captured.run((padded_logits, padded_hidden, padded_trailing, floats, ints))
        ids: list[list[int]] = codes[:count].tolist()
        return ids, following[:count], normed[:count]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture the thinker's decode step, the talker's frame and the Code2Wav push per batch bucket (CUDA only);
        every capture writes at the scratch slots only."""
        if self.device.type != "cuda":
            return
        self.thinker_steps.capture(self.thinker_cache.scratch)
        codec_vocab = int(self._codec_head.shape[0])
        hidden = int(self.talker_embed.shape[1])
        for bucket in self.frame_buckets:
            inputs = (
                torch.zeros(bucket, codec_vocab, device=self.device),
                torch.zeros(bucket, hidden, device=self.device, dtype=self.dtype),
                torch.zeros(bucket, hidden, device=self.device, dtype=self.dtype),
                torch.zeros(1 + self.groups, bucket, device=self.device, dtype=torch.float64),
                torch.tensor([[self.talker_cache.scratch] * bucket, [0] * bucket], device=self.device),
            )
            self._frame_graphs[bucket] = CapturedCall(self._frame, inputs)
        self.code2wav.prepare()  # one frame a push, every row bucket
        torch.cuda.synchronize(self.device)


def _dtype(name: str) -> torch.dtype:
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise Qwen3OmniModelError(f"dtype {name!r}: choose float32, bfloat16 or float16") from None


@torch.no_grad()
def _init_experts(whole: Any, std: float) -> None:
    """Draw every expert weight: transformers' initialisation skips the talker's experts (``torch.empty``), so a
    preset would otherwise run on whatever the memory held (NaN now and then)."""
    for name, param in whole.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            param.normal_(0.0, std)


def build_preset(
    name: str,
    *,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "float32",
    slots: int = DEFAULT_SLOTS,
    max_context: int = DEFAULT_MAX_CONTEXT,
    vocab_limit: bool = True,
) -> Qwen3OmniModel:
    """Preset ``name`` with weights drawn from ``seed``, built directly on ``device`` in ``dtype``; the answer's
    ids limited to the printable ones and ``<|im_end|>`` unless ``vocab_limit`` is off."""
    try:
        config = preset_config(name)
    except KeyError:
        raise Qwen3OmniModelError(f"unknown preset {name!r}; choose one of {', '.join(sorted(PRESETS))}") from None
    target = torch.device(device)
    previous = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[target] if target.type == "cuda" else []), target:
        torch.manual_seed(seed)
        torch.set_default_dtype(_dtype(dtype))
        try:
            whole: Any = Qwen3OmniMoeForConditionalGeneration(config)
            _init_experts(whole, float(config.talker_config.initializer_range))
        finally:
            torch.set_default_dtype(previous)
    whole = whole.eval()
    tokenizer = PrintableChatTokenizer(config)
    log.warning("preset %r has random weights: its answers are random characters and its voice is noise", name)
    return Qwen3OmniModel(
        whole,
        tokenizer,
        name=f"{PRESET_PREFIX}{name}",
        random_weights=True,
        vocab_limit=tokenizer.im_end + 1 if vocab_limit else None,
        slots=slots,
        max_context=max_context,
    )


def load_checkpoint(
    path: Path,
    *,
    device: str = "cpu",
    dtype: str = "bfloat16",
    slots: int = DEFAULT_SLOTS,
    max_context: int = DEFAULT_MAX_CONTEXT,
) -> Qwen3OmniModel:
    """A local ``Qwen3OmniMoeForConditionalGeneration`` checkpoint; only local files are read."""
    if not (path / "config.json").is_file():
        raise Qwen3OmniModelError(f"{path} is not a checkpoint directory (no config.json)")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if config.model_type != "qwen3_omni_moe":
        raise Qwen3OmniModelError(f"{path}: model_type {config.model_type!r} is not a Qwen3-Omni checkpoint")
    whole: Any = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, local_files_only=True, dtype=_dtype(dtype))
    whole = whole.to(device).eval()
    tokenizer: ChatTokenizer
    limit: int | None = None
    if (path / "tokenizer_config.json").is_file():
        tokenizer = HfChatTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True), config)
    else:  # a checkpoint saved without a tokenizer (a test's tiny model): printable ids
        tokenizer = PrintableChatTokenizer(config)
        limit = tokenizer.im_end + 1
    return Qwen3OmniModel(
        whole, tokenizer, name=str(path), random_weights=False, vocab_limit=limit, slots=slots, max_context=max_context
    )


def load_model(
    spec: str,
    *,
    seed: int = 0,
    device: str = "cpu",
    dtype: str | None = None,
    slots: int = DEFAULT_SLOTS,
    max_context: int = DEFAULT_MAX_CONTEXT,
) -> Qwen3OmniModel:
    """Resolve ``--model``: ``preset:NAME`` or a checkpoint directory."""
    if spec.startswith(PRESET_PREFIX):
        return build_preset(
            spec[len(PRESET_PREFIX) :], seed=seed, device=device, dtype=dtype or "float32", slots=slots,
            max_context=max_context,
        )  # fmt: skip
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise Qwen3OmniModelError(f"model {spec!r} is neither preset:NAME nor a directory")
    return load_checkpoint(path, device=device, dtype=dtype or "bfloat16", slots=slots, max_context=max_context)


def audio_token_count(frames: int, window: int) -> int:
    """Audio tokens of ``frames`` log-mel frames: three stride-2 convolutions over each chunk of ``2 * window``
    frames (13 tokens a whole chunk of 100), as transformers' ``_get_feat_extract_output_lengths`` counts them."""
    chunk = 2 * window
    tail = (frames % chunk - 1) // 2 + 1
    return ((tail - 1) // 2 + 1 - 1) // 2 + 1 + (frames // chunk) * 13
