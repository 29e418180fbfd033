"""Exact incremental encoding of PCM into Mimi codes, batched across sessions held in slots.

Each call takes one whole frame (``samples_per_frame`` samples, 80 ms at 24 kHz) per slot and returns that frame's
codes. Every convolution of the encoder keeps, per slot, the input samples its next call needs as left context
(zeros at the start, or the first sample repeated for replicate-padded ones); the encoder transformer keeps the keys
and values of its sliding window per slot. Encoding a stream frame by frame therefore gives the same codes as one
``MimiModel.encode`` call over the whole stream, and sessions of different ages share one batched call.

Session state lives in device slots, positions and first-frame flags included, so :meth:`MimiStreamEncoder.encode_rows`
reads nothing from the host and can be captured in a CUDA graph. One extra slot, :attr:`MimiStreamEncoder.scratch`,
absorbs rows of a fixed-size batch that carry no session's frame (its state is garbage by design).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers.models.mimi.modeling_mimi import MimiConv1d, MimiResnetBlock

from omnigate.engines.codec.mimi_stream import SlotKvLayers


class UnsupportedEncoder(ValueError):
    """The Mimi configuration has a layer this encoder cannot stream exactly."""


class _StridedConvState:
    """The left context of one causal (possibly strided) convolution for every slot."""

    def __init__(self, layer: Any, slots: int, device: torch.device, dtype: torch.dtype) -> None:
        if not layer.causal:
            raise UnsupportedEncoder("only causal encoder convolutions stream exactly")
        if layer.pad_mode not in ("constant", "replicate"):
            raise UnsupportedEncoder(f"unsupported padding mode {layer.pad_mode!r}")
        self.conv: nn.Conv1d = layer.conv
        self.stride = int(self.conv.stride[0])
        self.context = int(layer.padding_total)
        self.replicate = layer.pad_mode == "replicate"
        self.history = torch.zeros(slots, self.conv.in_channels, self.context, device=device, dtype=dtype)

    def __call__(self, x: torch.Tensor, index: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % self.stride:
            raise ValueError(f"a streamed chunk must hold whole strides of {self.stride} samples")
        if self.context:
            history = self.history.index_select(0, index)
            if self.replicate:
                # A stream's first call pads with its own first sample, as a full encode does.
                first = x[..., :1].expand(-1, -1, self.context)
                history = torch.where(fresh[:, None, None], first, history)
            x = torch.cat((history, x), dim=-1)
            self.history.index_copy_(0, index, x[..., -self.context :])
        out: torch.Tensor = self.conv(x)
        return out


class _WindowedEncoderTransformer(SlotKvLayers):
    """The encoder transformer, with each slot's keys and values of the last ``sliding_window - 1`` steps."""

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
        self.positions = torch.zeros(slots, device=device, dtype=torch.int64)

    def reset(self, slot: int) -> None:
        self.positions[slot] = 0

    def __call__(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        steps = x.shape[1]
        start = self.positions.index_select(0, index)
        positions = start[:, None] + torch.arange(steps, device=x.device)[None, :]
        cos, sin = self.rotary(x, positions)
        allowed = self._allowed(start, steps, x.device)
        for i, layer in enumerate(self.layers):
            x = self._layer(i, layer, x, cos, sin, allowed, index)
        self.positions.index_copy_(0, index, start + steps)
        return x

    def _allowed(self, start: torch.Tensor, steps: int, device: torch.device) -> torch.Tensor:
        # Past key j holds absolute position start - past + j: visible when it exists (>= 0) and is inside the
        # window of step t (position > start + t - window). New key u is visible when u <= t < u + window.
        t = torch.arange(steps, device=device)
        j = torch.arange(self.past, device=device)
        absolute = start[:, None] - self.past + j[None, :]
        oldest = start[:, None, None] + t[None, :, None] - self.window
        past_ok = (absolute[:, None, :] >= 0) & (absolute[:, None, :] > oldest)
        new_ok = (t[None, :] <= t[:, None]) & (t[:, None] < t[None, :] + self.window)
        return torch.cat((past_ok, new_ok.expand(start.shape[0], steps, steps)), dim=-1)


class MimiStreamEncoder:
    """Streams 24 kHz PCM to Mimi codes for up to ``max_slots`` sessions, exactly equal to a full encode."""

    def __init__(self, mimi: Any, max_slots: int, num_codebooks: int) -> None:
        encoder = mimi.encoder
        if encoder is None:
            raise UnsupportedEncoder("the Mimi model has no encoder")
        param = next(encoder.parameters())
        self.device: torch.device = param.device
        self.dtype: torch.dtype = param.dtype
        self.max_slots = max_slots
        self.scratch = max_slots
        slots = max_slots + 1
        self.num_codebooks = num_codebooks
        self.sample_rate = int(mimi.config.sampling_rate)
        self.samples_per_frame = round(self.sample_rate / float(mimi.config.frame_rate))
        self._quantizer: Any = mimi.quantizer
        self._seanet: Sequence[Any] = list(encoder.encoder_seanet.layers)
        self._convs: dict[nn.Module, _StridedConvState] = {}
        for module in encoder.encoder_seanet.modules():
            if isinstance(module, MimiConv1d):
                self._convs[module] = _StridedConvState(module, slots, self.device, self.dtype)
        downsample = encoder.downsample
        self._downsample = None if downsample is None else _StridedConvState(downsample, slots, self.device, self.dtype)
        self._transformer = _WindowedEncoderTransformer(encoder.encoder_transformer, slots, self.device, self.dtype)
        self._fresh = torch.ones(slots, dtype=torch.bool, device=self.device)

    def reset(self, slot: int) -> None:
        """Forget the session in ``slot``: its next frame starts a new stream."""
        for conv in self._convs.values():
            conv.history[slot].zero_()
        if self._downsample is not None:
            self._downsample.history[slot].zero_()
        self._transformer.reset(slot)
        self._fresh[slot] = True

    @torch.no_grad()
    def encode(self, pcm: torch.Tensor, slots: Sequence[int]) -> torch.Tensor:
        """Encode the next frame of each slot: ``pcm`` is ``[B, samples_per_frame]`` floats in [-1, 1]; returns
        ``[B, num_codebooks]`` codes."""
        if pcm.shape != (len(slots), self.samples_per_frame) or len(set(slots)) != len(slots):
            raise ValueError(f"encode needs one distinct slot per row of {self.samples_per_frame} samples")
        return self.encode_rows(pcm.to(self.device), torch.tensor(list(slots), device=self.device))

    @torch.no_grad()
    def encode_rows(self, pcm: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """:meth:`encode` with the slots as a device tensor and no checks or host reads (CUDA-graph safe). Rows may
        repeat :attr:`scratch`."""
        fresh = self._fresh.index_select(0, index)
        x = pcm.to(self.dtype)[:, None, :]
        for layer in self._seanet:
            x = self._run(layer, x, index, fresh)
        x = self._transformer(x.transpose(1, 2), index).transpose(1, 2)
        if self._downsample is not None:
            x = self._downsample(x, index, fresh)
        self._fresh.index_fill_(0, index, False)
        codes: torch.Tensor = self._quantizer.encode(x, self.num_codebooks)  # [K, B, 1]
        return codes[:, :, -1].transpose(0, 1)

    def _run(self, layer: Any, x: torch.Tensor, index: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        if isinstance(layer, MimiConv1d):
            return self._convs[layer](x, index, fresh)
        if isinstance(layer, MimiResnetBlock):
            h = x
            for inner in layer.block:
                h = self._run(inner, h, index, fresh)
            residual = x if isinstance(layer.shortcut, nn.Identity) else self._run(layer.shortcut, x, index, fresh)
            return residual + h
        out: torch.Tensor = layer(x)
        return out
