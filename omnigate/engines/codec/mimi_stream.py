"""Exact incremental decoding of Mimi codes into PCM, batched across sessions.

``MimiModel.decode`` keeps only the transformer cache between calls, so decoding a stream piece by piece with it is
wrong at every chunk boundary. This decoder runs the same weights but carries, per session, everything the decoder
needs to continue where it stopped:

- every causal convolution keeps its last ``kernel - 1`` input samples (the left padding of the next call);
- every transposed convolution keeps the overlapping tail of its last output, added into the next output;
- the decoder transformer keeps the keys and values of its sliding window in a ring that attention reads in place,
  and each session its position.

So every frame is decoded exactly once, and decoding a stream in chunks of any size gives the same samples as one
``MimiModel.decode`` call over all of its codes. Session state lives in preallocated device slots, positions
included, so :meth:`MimiStreamDecoder.decode_frames` reads nothing from the host and can be captured in a CUDA graph;
a call decodes any set of slots that each bring the same number of new frames. One extra slot,
:attr:`MimiStreamDecoder.scratch`, absorbs rows of a fixed-size batch that carry no session.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers.models.mimi.modeling_mimi import (
    MimiConv1d,
    MimiConvTranspose1d,
    MimiResnetBlock,
    MimiTransformerLayer,
)

from omnigate.kernels.attention import masked_attention, slot_attention
from omnigate.kernels.conv import conv_transpose1d
from omnigate.kernels.rope import apply_rope


class UnsupportedCodec(ValueError):
    """The Mimi configuration has a layer this decoder cannot stream exactly."""


class _ConvState:
    """The input history of one causal convolution: the last ``context`` input samples of every slot."""

    def __init__(self, layer: Any, slots: int, device: torch.device, dtype: torch.dtype) -> None:
        if not layer.causal or layer.pad_mode != "constant" or layer.conv.stride[0] != 1:
            raise UnsupportedCodec("only causal, zero-padded, stride-1 decoder convolutions stream exactly")
        self.conv: nn.Conv1d = layer.conv
        self.context = int(layer.padding_total)
        self.history = torch.zeros(slots, self.conv.in_channels, self.context, device=device, dtype=dtype)

    def __call__(self, x: torch.Tensor, index: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        if self.context:
            history = self.history.index_select(0, index)
            if keep is not None:
                history = history * keep
            x = torch.cat((history, x), dim=-1)
            self.history.index_copy_(0, index, x[..., -self.context :])
        out: torch.Tensor = self.conv(x)
        return out

    def reset(self, slots: torch.Tensor) -> None:
        self.history.index_fill_(0, slots, 0.0)


class _TransposedConvState:
    """The overlap of one causal transposed convolution: the part of its output that the next input adds to."""

    def __init__(self, layer: Any, slots: int, device: torch.device, dtype: torch.dtype) -> None:
        conv: nn.ConvTranspose1d = layer.conv
        if not layer.causal or layer.padding_left != 0:
            raise UnsupportedCodec("only causal transposed convolutions trimmed on the right stream exactly")
        self.conv = conv
        self.stride = conv.stride[0]
        self.overlap = conv.kernel_size[0] - self.stride
        self.tail = torch.zeros(slots, conv.out_channels, self.overlap, device=device, dtype=dtype)

    def __call__(self, x: torch.Tensor, index: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        # Without bias: the bias belongs once to each output sample, not to each overlapping contribution.
        y = conv_transpose1d(x, self.conv.weight, self.stride, self.conv.groups)
        tail = self.tail.index_select(0, index)
        y[..., : self.overlap] += tail if keep is None else tail * keep
        ready = x.shape[-1] * self.stride
        self.tail.index_copy_(0, index, y[..., ready:])
        out = y[..., :ready]
        if self.conv.bias is not None:
            out = out + self.conv.bias[:, None]
        return out

    def reset(self, slots: torch.Tensor) -> None:
        self.tail.index_fill_(0, slots, 0.0)


class SlotKvLayers:
    """One Mimi transformer layer over per-slot key/value windows, shared by the streaming encoder and decoder.

    Subclasses set ``heads``, ``kv_heads``, ``head_dim``, ``past`` and the per-layer ``keys``/``values`` tensors.
    """

    heads: int
    kv_heads: int
    head_dim: int
    past: int
    keys: torch.Tensor  # (layers, slots, past, kv_heads, head_dim)
    values: torch.Tensor

    def _layer(
        self,
        i: int,
        layer: Any,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: torch.Tensor,
        index: torch.Tensor,
    ) -> torch.Tensor:
        batch, steps, _ = x.shape
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = apply_rope(attn.q_proj(h).view(batch, steps, self.heads, self.head_dim), cos, sin)
        k = apply_rope(attn.k_proj(h).view(batch, steps, self.kv_heads, self.head_dim), cos, sin)
        v = attn.v_proj(h).view(batch, steps, self.kv_heads, self.head_dim)
        keys = torch.cat((self.keys[i].index_select(0, index), k), dim=1)
        values = torch.cat((self.values[i].index_select(0, index), v), dim=1)
        if self.past:
            self.keys[i].index_copy_(0, index, keys[:, -self.past :])
            self.values[i].index_copy_(0, index, values[:, -self.past :])
        out = masked_attention(q, keys, values, allowed, float(attn.scaling))
        x = x + layer.self_attn_layer_scale(attn.o_proj(out))
        mlp_out: torch.Tensor = layer.mlp_layer_scale(layer.mlp(layer.post_attention_layernorm(x)))
        return x + mlp_out


class _RingWindowTransformer:
    """The decoder transformer over a per-slot ring of its sliding window's keys and values, read in place.

    Each slot holds the rotated keys (and the values) of its last ``ring`` positions, position ``a`` at ring index
    ``a % ring`` and again at ``a % ring + ring``: every window of up to ``ring`` consecutive positions is then one
    contiguous run of the doubled ring, so attention reads it where it lies (one strided view of the whole buffer,
    a row start per query) instead of gathering, concatenating and writing back the window every step. A step
    writes only its new keys. The ring holds the window plus the steps of one call (``max_steps``), so a call's new
    keys never overwrite one its own queries still see; longer calls run in pieces of ``max_steps``.
    """

    def __init__(self, transformer: Any, slots: int, device: torch.device, dtype: torch.dtype, max_steps: int) -> None:
        config = transformer.config
        self.layers: Sequence[Any] = list(transformer.layers)
        self.rotary: nn.Module = transformer.rotary_emb
        self.window = int(config.sliding_window)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(config.head_dim)
        self.max_steps = max_steps
        self.ring = self.window - 1 + max_steps
        self.slots = slots
        shape = (len(self.layers), slots, 2 * self.ring, self.kv_heads, self.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.positions = torch.zeros(slots, device=device, dtype=torch.int64)
        # Row r of a window view starts at entry r of the flattened (slot, doubled ring) axis and spans the window.
        rows = slots * 2 * self.ring - self.window + 1
        self._key_windows = [self._windows(t, rows) for t in self.keys]
        self._value_windows = [self._windows(t, rows) for t in self.values]

    def _windows(self, buffer: torch.Tensor, rows: int) -> torch.Tensor:
        entry = self.kv_heads * self.head_dim
        return buffer.as_strided(
            (rows, self.window, self.kv_heads, self.head_dim),
            (entry, entry, self.head_dim, 1),
            buffer.storage_offset(),
        )

    def reset(self, slots: torch.Tensor) -> None:
        self.positions.index_fill_(0, slots, 0)

    def __call__(self, x: torch.Tensor, index: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        start = self.positions.index_select(0, index)
        if keep is not None:
            start = start * keep.reshape(-1).to(start.dtype)
        pieces = []
        for offset in range(0, x.shape[1], self.max_steps):
            pieces.append(self._run(x[:, offset : offset + self.max_steps], index, start + offset))
        self.positions.index_copy_(0, index, start + x.shape[1])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def _run(self, x: torch.Tensor, index: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        batch, steps, _ = x.shape
        positions = start[:, None] + torch.arange(steps, device=x.device)[None, :]  # [B, S] absolute
        cos, sin = self.rotary(x, positions)
        ring_at = positions % self.ring
        slot_rows = index[:, None].expand(batch, steps)
        # Query at absolute position q sees [max(0, q - window + 1), q]: one contiguous run of the doubled ring.
        first = (positions - self.window + 1).clamp(min=0)
        lengths = (positions - first + 1).reshape(-1)
        row_starts = (index[:, None] * (2 * self.ring) + first % self.ring).reshape(-1)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = apply_rope(attn.q_proj(h).view(batch, steps, self.heads, self.head_dim), cos, sin)
            k = apply_rope(attn.k_proj(h).view(batch, steps, self.kv_heads, self.head_dim), cos, sin)
            v = attn.v_proj(h).view(batch, steps, self.kv_heads, self.head_dim)
            for copy in (ring_at, ring_at + self.ring):
                self.keys[i][slot_rows, copy] = k
                self.values[i][slot_rows, copy] = v
            out = slot_attention(
                q.reshape(batch * steps, self.heads, self.head_dim).contiguous(),
                self._key_windows[i],
                self._value_windows[i],
                row_starts,
                lengths,
                float(attn.scaling),
            ).view(batch, steps, self.heads * self.head_dim)
            x = x + layer.self_attn_layer_scale(attn.o_proj(out))
            mlp_out: torch.Tensor = layer.mlp_layer_scale(layer.mlp(layer.post_attention_layernorm(x)))
            x = x + mlp_out
        return x


class _QuantizerTables:
    """Mimi's residual quantizers as lookup tables: the sum over codebooks of each code's vector is one gather and
    one sum per quantizer group instead of one lookup and one add per codebook."""

    def __init__(self, quantizer: Any) -> None:
        self.groups: list[tuple[int, int, torch.Tensor, torch.Tensor, nn.Module | None]] = []
        start = 0
        for rvq in (quantizer.semantic_residual_vector_quantizer, quantizer.acoustic_residual_vector_quantizer):
            embeds = [layer.codebook.embed for layer in rvq.layers]
            size = embeds[0].shape[0]
            offsets = torch.arange(len(embeds), device=embeds[0].device, dtype=torch.int64) * size
            self.groups.append((start, len(embeds), torch.cat(embeds), offsets, rvq.output_proj))
            start += len(embeds)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes`` ``[B, N, T]`` to the quantized latent ``[B, hidden, T]`` (the first ``N`` codebooks)."""
        total: torch.Tensor | None = None
        count = codes.shape[1]
        for start, size, table, offsets, proj in self.groups:
            used = min(size, count - start)
            if used <= 0:
                break
            ids = codes[:, start : start + used] + offsets[:used, None]
            vectors = nn.functional.embedding(ids, table).sum(dim=1).transpose(1, 2)
            part = vectors if proj is None else proj(vectors)
            total = part if total is None else total + part
        if total is None:
            raise ValueError("no codebooks to decode")
        return total


def decoder_parts(mimi: Any) -> tuple[Any, Any, Any]:
    """(upsample, decoder transformer, SEANet decoder) in either transformers layout: grouped under ``mimi.decoder``
    (newer releases) or as attributes of the model itself (older ones, where ``mimi.decoder`` is the SEANet)."""
    decoder = getattr(mimi, "decoder", None)
    if decoder is None:
        raise UnsupportedCodec("the Mimi model has no decoder")
    if hasattr(decoder, "decoder_seanet"):
        return decoder.upsample, decoder.decoder_transformer, decoder.decoder_seanet
    return getattr(mimi, "upsample", None), mimi.decoder_transformer, decoder


def cast_for_decoding(mimi: Any, dtype: torch.dtype) -> None:
    """Convert ``mimi`` so that its decoder layers (upsample, transformer, SEANet) run in ``dtype``: with a dtype
    below float32, the codebooks, the quantizer's projections and the encoder stay float32 (the sum of a frame's
    codebook vectors is taken in float32, and reference audio is encoded as before)."""
    mimi.to(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype)
    for part in decoder_parts(mimi):
        if part is not None:
            part.to(dtype)


class MimiStreamDecoder:
    """Streams Mimi codes to waveform for up to ``max_slots`` sessions, exactly equal to a full decode.

    ``max_steps`` is how many transformer steps (two per frame for Mimi) one call runs at once; longer calls are
    decoded in pieces of that many, the same samples either way. It sizes the key/value ring of every slot.
    """

    def __init__(self, mimi: Any, max_slots: int, *, max_steps: int = 16) -> None:
        upsample, transformer, seanet = decoder_parts(mimi)
        param = next(seanet.parameters())
        self.device: torch.device = param.device
        self.dtype: torch.dtype = param.dtype
        self.max_slots = max_slots
        self.scratch = max_slots
        slots = max_slots + 1
        self.sample_rate = int(mimi.config.sampling_rate)
        self.num_codebooks = int(mimi.config.num_quantizers)
        self.codebook_size = int(mimi.config.codebook_size)
        self._quantizer = _QuantizerTables(mimi.quantizer)
        self._upsample = None if upsample is None else _TransposedConvState(upsample, slots, self.device, self.dtype)
        self._transformer = _RingWindowTransformer(transformer, slots, self.device, self.dtype, max_steps)
        self._seanet: Sequence[Any] = list(seanet.layers)
        self._convs: dict[nn.Module, _ConvState] = {}
        self._transposed: dict[nn.Module, _TransposedConvState] = {}
        for module in seanet.modules():
            if isinstance(module, MimiConv1d):
                self._convs[module] = _ConvState(module, slots, self.device, self.dtype)
            elif isinstance(module, MimiConvTranspose1d):
                self._transposed[module] = _TransposedConvState(module, slots, self.device, self.dtype)
        if any(not isinstance(layer, MimiTransformerLayer) for layer in self._transformer.layers):
            raise UnsupportedCodec("unexpected decoder transformer layer")
        upsample_factor = 1 if self._upsample is None else self._upsample.stride
        self.samples_per_frame = upsample_factor * int(torch.tensor(mimi.config.upsampling_ratios).prod())

    @property
    def bytes_per_slot(self) -> int:
        """Device bytes of one session's decoder state."""
        tensors = [self._transformer.keys[:, 0], self._transformer.values[:, 0]]
        tensors += [conv.history[0] for conv in self._convs.values()]
        tensors += [t.tail[0] for t in self._transposed.values()]
        if self._upsample is not None:
            tensors.append(self._upsample.tail[0])
        return sum(t.numel() * t.element_size() for t in tensors) + 16

    def reset(self, *slots: int) -> None:
        """Forget the sessions in ``slots``: the next frame decoded in each starts a new stream. One call for many
        slots costs what one slot does (a few dozen small kernels), so callers gather the slots of a step."""
        if not slots:
            return
        index = torch.tensor(slots, device=self.device)
        if self._upsample is not None:
            self._upsample.reset(index)
        self._transformer.reset(index)
        for conv in self._convs.values():
            conv.reset(index)
        for transposed in self._transposed.values():
            transposed.reset(index)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, slots: Sequence[int]) -> torch.Tensor:
        """Decode the next frames of each slot: ``codes`` is ``[B, num_codebooks, T]``; returns ``[B, T * samples]``.

        Each slot may appear once per call. The result continues, sample for sample, what earlier calls for the same
        slot returned.
        """
        if codes.shape[0] != len(slots) or len(set(slots)) != len(slots):
            raise ValueError("decode needs one distinct slot per row of codes")
        return self.decode_frames(codes.to(self.device), torch.tensor(slots, device=self.device))

    @torch.no_grad()
    def decode_frames(
        self, codes: torch.Tensor, index: torch.Tensor, fresh: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:meth:`decode` with the slots as a device tensor and no checks or host reads (CUDA-graph safe). Rows may
        repeat :attr:`scratch`, whose state is garbage by design. Rows where ``fresh`` (``[B]``) is true start a new
        stream, as after :meth:`reset`: inside a captured step this costs a multiply per state instead of a host
        call per slot."""
        keep = None if fresh is None else (fresh == 0).to(self.dtype)[:, None, None]
        x = self._quantizer.decode(codes).to(self.dtype)
        if self._upsample is not None:
            x = self._upsample(x, index, keep)
        x = self._transformer(x.transpose(1, 2), index, keep).transpose(1, 2)
        for layer in self._seanet:
            x = self._run(layer, x, index, keep)
        return x[:, 0]

    def _run(self, layer: Any, x: torch.Tensor, index: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        if isinstance(layer, MimiConv1d):
            return self._convs[layer](x, index, keep)
        if isinstance(layer, MimiConvTranspose1d):
            return self._transposed[layer](x, index, keep)
        if isinstance(layer, MimiResnetBlock):
            h = x
            for inner in layer.block:
                h = self._run(inner, h, index, keep)
            residual = self._run(layer.shortcut, x, index, keep)
            return residual + h
        out: torch.Tensor = layer(x)
        return out
