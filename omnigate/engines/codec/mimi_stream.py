"""Exact incremental decoding of Mimi codes into PCM, batched across sessions.

``MimiModel.decode`` keeps only the transformer cache between calls, so decoding a stream piece by piece with it is
wrong at every chunk boundary. This decoder runs the same weights but carries, per session, everything the decoder
needs to continue where it stopped:

- every causal convolution keeps its last ``kernel - 1`` input samples (the left padding of the next call);
- every transposed convolution keeps the overlapping tail of its last output, added into the next output;
- the decoder transformer keeps the keys and values of its sliding window, and each session its position.

So every frame is decoded exactly once, and decoding a stream in chunks of any size gives the same samples as one
``MimiModel.decode`` call over all of its codes. Session state lives in preallocated slots; a call decodes any set
of slots that each bring the same number of new frames.
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

from omnigate.kernels.attention import masked_attention
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

    def __call__(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if self.context:
            x = torch.cat((self.history.index_select(0, index), x), dim=-1)
            self.history.index_copy_(0, index, x[..., -self.context :])
        out: torch.Tensor = self.conv(x)
        return out

    def reset(self, slot: int) -> None:
        self.history[slot].zero_()


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

    def __call__(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        # Without bias: the bias belongs once to each output sample, not to each overlapping contribution.
        y = conv_transpose1d(x, self.conv.weight, self.stride, self.conv.groups)
        y[..., : self.overlap] += self.tail.index_select(0, index)
        ready = x.shape[-1] * self.stride
        self.tail.index_copy_(0, index, y[..., ready:])
        out = y[..., :ready]
        if self.conv.bias is not None:
            out = out + self.conv.bias[:, None]
        return out

    def reset(self, slot: int) -> None:
        self.tail[slot].zero_()


class _WindowedTransformer:
    """The decoder transformer with a per-slot key/value window of ``sliding_window - 1`` past steps."""

    def __init__(self, transformer: Any, slots: int, device: torch.device, dtype: torch.dtype) -> None:
        config = transformer.config
        self.layers: Sequence[Any] = list(transformer.layers)
        self.rotary: nn.Module = transformer.rotary_emb
        self.window = int(config.sliding_window)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(config.head_dim)
        self.past = self.window - 1
        shape = (len(self.layers), slots, self.past, self.kv_heads, self.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.positions = [0] * slots
        self.filled = [0] * slots

    def reset(self, slot: int) -> None:
        self.positions[slot] = 0
        self.filled[slot] = 0

    def _allowed(self, slots: Sequence[int], steps: int, device: torch.device) -> torch.Tensor:
        # Past key j (absolute position pos - past + j) is visible to step t when it is within the window
        # (j >= t) and holds real history (j >= past - filled); new key u when u <= t < u + window.
        t = torch.arange(steps, device=device)
        j = torch.arange(self.past, device=device)
        filled = torch.tensor([self.filled[s] for s in slots], device=device)
        past_ok = (j[None, None, :] >= t[None, :, None]) & (j[None, None, :] >= (self.past - filled)[:, None, None])
        new_ok = (t[None, :] <= t[:, None]) & (t[:, None] < t[None, :] + self.window)
        return torch.cat((past_ok, new_ok.expand(len(slots), steps, steps)), dim=-1)

    def __call__(self, x: torch.Tensor, slots: Sequence[int], index: torch.Tensor) -> torch.Tensor:
        steps = x.shape[1]
        start = torch.tensor([self.positions[s] for s in slots], device=x.device)
        positions = start[:, None] + torch.arange(steps, device=x.device)[None, :]
        cos, sin = self.rotary(x, positions)
        allowed = self._allowed(slots, steps, x.device)
        for i, layer in enumerate(self.layers):
            x = self._layer(i, layer, x, cos, sin, allowed, index)
        for s in slots:
            self.positions[s] += steps
            self.filled[s] = min(self.filled[s] + steps, self.past)
        return x

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


class MimiStreamDecoder:
    """Streams Mimi codes to waveform for up to ``max_slots`` sessions, exactly equal to a full decode."""

    def __init__(self, mimi: Any, max_slots: int) -> None:
        decoder = mimi.decoder
        if decoder is None:
            raise UnsupportedCodec("the Mimi model has no decoder")
        param = next(decoder.parameters())
        self.device: torch.device = param.device
        self.dtype: torch.dtype = param.dtype
        self.max_slots = max_slots
        self.sample_rate = int(mimi.config.sampling_rate)
        self.num_codebooks = int(mimi.config.num_quantizers)
        self.codebook_size = int(mimi.config.codebook_size)
        self._quantizer: Any = mimi.quantizer
        self._upsample = (
            None
            if decoder.upsample is None
            else _TransposedConvState(decoder.upsample, max_slots, self.device, self.dtype)
        )
        self._transformer = _WindowedTransformer(decoder.decoder_transformer, max_slots, self.device, self.dtype)
        self._seanet: Sequence[Any] = list(decoder.decoder_seanet.layers)
        self._convs: dict[nn.Module, _ConvState] = {}
        self._transposed: dict[nn.Module, _TransposedConvState] = {}
        for module in decoder.decoder_seanet.modules():
            if isinstance(module, MimiConv1d):
                self._convs[module] = _ConvState(module, max_slots, self.device, self.dtype)
            elif isinstance(module, MimiConvTranspose1d):
                self._transposed[module] = _TransposedConvState(module, max_slots, self.device, self.dtype)
        if any(not isinstance(layer, MimiTransformerLayer) for layer in self._transformer.layers):
            raise UnsupportedCodec("unexpected decoder transformer layer")
        upsample_factor = 1 if self._upsample is None else self._upsample.stride
        self.samples_per_frame = upsample_factor * int(torch.tensor(mimi.config.upsampling_ratios).prod())

    def reset(self, slot: int) -> None:
        """Forget the session in ``slot``: the next frame decoded there starts a new stream."""
        if self._upsample is not None:
            self._upsample.reset(slot)
        self._transformer.reset(slot)
        for conv in self._convs.values():
            conv.reset(slot)
        for transposed in self._transposed.values():
            transposed.reset(slot)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, slots: Sequence[int]) -> torch.Tensor:
        """Decode the next frames of each slot: ``codes`` is ``[B, num_codebooks, T]``; returns ``[B, T * samples]``.

        Each slot may appear once per call. The result continues, sample for sample, what earlier calls for the same
        slot returned.
        """
        if codes.shape[0] != len(slots) or len(set(slots)) != len(slots):
            raise ValueError("decode needs one distinct slot per row of codes")
        index = torch.tensor(slots, device=self.device)
        x: torch.Tensor = self._quantizer.decode(codes.to(self.device)).to(self.dtype)
        if self._upsample is not None:
            x = self._upsample(x, index)
        x = self._transformer(x.transpose(1, 2), slots, index).transpose(1, 2)
        for layer in self._seanet:
            x = self._run(layer, x, index)
        return x[:, 0]

    def _run(self, layer: Any, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if isinstance(layer, MimiConv1d):
            return self._convs[layer](x, index)
        if isinstance(layer, MimiConvTranspose1d):
            return self._transposed[layer](x, index)
        if isinstance(layer, MimiResnetBlock):
            h = x
            for inner in layer.block:
                h = self._run(inner, h, index)
            residual = self._run(layer.shortcut, x, index)
            return residual + h
        out: torch.Tensor = layer(x)
        return out
