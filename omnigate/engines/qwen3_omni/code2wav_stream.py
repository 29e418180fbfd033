"""Exact streaming Code2Wav for Qwen3-Omni, batched across sessions.

``Qwen3OmniMoeCode2Wav`` is a sliding-window transformer followed by upsampling and "causal" convolutions. Every
part only looks back, with one exception: each transposed convolution (kernel ``2 * stride`` in the decoder blocks)
trims ``kernel - stride`` samples from both ends, so the last output block of an input sample is only complete once
the next input sample arrives, and a full ``forward`` over ``T`` frames returns ``T * samples_per_frame -
delay_samples`` samples (``delay_samples`` is 555 for the released 8-5-4-3 decoder, 23 ms at 24 kHz). The output of a
full decode over the first ``T`` frames is still an exact prefix of the decode over more frames.

This decoder carries, per row (session), everything the next frames need and recomputes nothing:

- the transformer keeps the rotated keys and values of its last ``sliding_window - 1`` positions per layer, and the
  row's position (rotary embeddings use absolute positions, as the full forward does);
- every causal convolution keeps its last ``(kernel - 1) * dilation`` input samples;
- every transposed convolution keeps the overlapping tail of its last output, added into the next output.

A push of ``T`` frames returns ``T * samples_per_frame`` samples per row. The stream a row returns is the full decode
delayed by ``delay_samples``: its first push starts with ``delay_samples`` zeros, and after ``N`` frames the row has
returned ``[0] * delay_samples + forward(codes[:N])``, the whole of what a full decode gives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeSnakeBeta

from omnigate.engines.base import EngineError
from omnigate.engines.codec.mimi_stream import SlotKvLayers
from omnigate.engines.duplex.graphs import CapturedCall, batch_buckets
from omnigate.kernels.conv import conv_transpose1d

DEFAULT_MAX_FRAMES = 300
DEFAULT_MAX_GRAPHS = 16


class UnsupportedCode2Wav(ValueError):
    """The Code2Wav model has a layer this decoder cannot stream exactly."""


class NoFreeRow(EngineError):
    """Every row of the decoder holds a session."""

    def __init__(self, max_rows: int) -> None:
        super().__init__("engine_busy", f"all {max_rows} Code2Wav rows are in use")


class InvalidPush(EngineError):
    """A push the decoder refuses: unknown or repeated rows, codes of the wrong shape or range, too many frames."""

    def __init__(self, message: str, param: str = "codes") -> None:
        super().__init__("invalid_value", message, param)


class _Preroll:
    """Which samples of a call are before the start of a fresh row's stream, per stage.

    A row's first call carries, at each stage after a transposed convolution, ``preroll`` leading samples that a full
    decode trims away. A convolution must read them as its zero left padding, so its input is masked there.
    """

    def __init__(self, fresh: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.fresh = fresh
        self.dtype = dtype
        self._masks: dict[tuple[int, int], torch.Tensor] = {}

    def mask(self, x: torch.Tensor, preroll: int) -> torch.Tensor:
        if self.fresh is None or preroll == 0:
            return x
        key = (x.shape[-1], preroll)
        keep = self._masks.get(key)
        if keep is None:
            before = torch.arange(x.shape[-1], device=x.device)[None, :] < preroll
            keep = (~(before & self.fresh[:, None])).to(self.dtype)[:, None, :]
            self._masks[key] = keep
        return x * keep


class _CausalConv:
    """A ``Qwen3OmniMoeCausalConvNet`` with its input history per row: the last ``(kernel - 1) * dilation`` samples."""

    def __init__(self, layer: Any, preroll: int, rows: int, device: torch.device, dtype: torch.dtype) -> None:
        conv: nn.Conv1d = layer.conv
        if conv.stride[0] != 1 or conv.padding[0] != 0 or layer.padding != layer.kernel_size - 1:
            raise UnsupportedCode2Wav("only stride-1 causal convolutions stream exactly")
        self.conv = conv
        self.preroll = preroll
        self.context = int(layer.padding)
        self.history = torch.zeros(rows, conv.in_channels, self.context, device=device, dtype=dtype)

    def __call__(self, x: torch.Tensor, index: torch.Tensor, preroll: _Preroll) -> torch.Tensor:
        if self.context:
            x = torch.cat((self.history.index_select(0, index), preroll.mask(x, self.preroll)), dim=-1)
            self.history.index_copy_(0, index, x[..., -self.context :])
        out: torch.Tensor = self.conv(x)
        return out

    def states(self) -> list[torch.Tensor]:
        return [self.history]


class _TransposedConv:
    """A ``Qwen3OmniMoeCausalTransConvNet`` with the overlapping tail of its last output per row.

    Input sample ``i`` adds into output samples ``[i * stride, i * stride + kernel)``; the first ``i * stride`` of
    them are final once inputs up to ``i - 1`` have arrived, so a call emits ``T * stride`` samples and keeps the
    ``kernel - stride`` samples the next input adds to. The full forward trims ``kernel - stride`` samples at the start
    (the stream's pre-roll, ``left_pad``) and as many at the end (exactly the tail not yet emitted).
    """

    def __init__(self, layer: Any, rows: int, device: torch.device, dtype: torch.dtype) -> None:
        conv: nn.ConvTranspose1d = layer.conv
        self.stride = int(conv.stride[0])
        kernel = int(conv.kernel_size[0])
        self.overlap = kernel - self.stride
        if (
            conv.padding[0] != 0
            or conv.output_padding[0] != 0
            or conv.dilation[0] != 1
            or not 0 <= self.overlap <= self.stride
            or layer.left_pad != self.overlap
            or layer.right_pad != self.overlap
        ):
            raise UnsupportedCode2Wav("only transposed convolutions trimmed by kernel - stride <= stride on both ends")
        self.conv = conv
        self.left_pad = self.overlap
        self.tail = torch.zeros(rows, conv.out_channels, self.overlap, device=device, dtype=dtype)

    def __call__(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        # Without bias: the bias belongs once to each output sample, not to each overlapping contribution.
        y = conv_transpose1d(x, self.conv.weight, self.stride, self.conv.groups)
        ready = x.shape[-1] * self.stride
        if self.overlap:
            y[..., : self.overlap] += self.tail.index_select(0, index)
            self.tail.index_copy_(0, index, y[..., ready:])
        out = y[..., :ready]
        if self.conv.bias is not None:
            out = out + self.conv.bias[:, None]
        return out

    def states(self) -> list[torch.Tensor]:
        return [self.tail]


class _Snake:
    """``Qwen3OmniMoeSnakeBeta`` (``x + sin(x * e^alpha)^2 / (e^beta + 1e-9)``) with its per-channel factors computed
    once: four kernels a call instead of ten, for the 29 activations a push runs."""

    def __init__(self, layer: Any) -> None:
        self.alpha = torch.exp(layer.alpha.detach())[:, None]
        self.inv_beta = (1.0 / (torch.exp(layer.beta.detach()) + layer.no_div_by_zero))[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(x, self.inv_beta, torch.sin(x * self.alpha).square())


class _WindowTransformer(SlotKvLayers):
    """The pre-transformer over each row's last ``sliding_window - 1`` keys and values (all layers slide)."""

    def __init__(self, transformer: Any, rows: int, device: torch.device, dtype: torch.dtype) -> None:
        config = transformer.config
        if any(kind != "sliding_attention" for kind in config.layer_types):
            raise UnsupportedCode2Wav("only sliding-window attention layers stream with a bounded cache")
        self.layers: Sequence[Any] = list(transformer.layers)
        for layer in self.layers:
            if not isinstance(layer.self_attn.q_norm, nn.Identity) or not isinstance(
                layer.self_attn.k_norm, nn.Identity
            ):
                raise UnsupportedCode2Wav("query/key normalization in the pre-transformer is not supported")
        self.rotary: nn.Module = transformer.rotary_emb
        self.norm: nn.Module = transformer.norm
        self.window = int(config.sliding_window)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.past = self.window - 1
        shape = (len(self.layers), rows, self.past, self.kv_heads, self.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.positions = torch.zeros(rows, device=device, dtype=torch.int64)

    def __call__(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        steps = x.shape[1]
        start = self.positions.index_select(0, index)
        positions = start[:, None] + torch.arange(steps, device=x.device)[None, :]  # [B, T] absolute
        cos, sin = self.rotary(x, positions)
        # Cached key j of a row is at absolute position start - past + j; slots before position 0 are empty.
        past_positions = start[:, None] + torch.arange(-self.past, 0, device=x.device)[None, :]
        keys_at = torch.cat((past_positions, positions), dim=1)[:, None, :]  # [B, 1, past + T]
        query_at = positions[:, :, None]
        allowed = (keys_at >= 0) & (keys_at <= query_at) & (keys_at > query_at - self.window)
        for i, layer in enumerate(self.layers):
            x = self._layer(i, layer, x, cos, sin, allowed, index)
        self.positions.index_copy_(0, index, start + steps)
        out: torch.Tensor = self.norm(x)
        return out

    def states(self) -> list[torch.Tensor]:
        return [self.keys.transpose(0, 1), self.values.transpose(0, 1), self.positions]


class Code2WavStream:
    """Streams Qwen3-Omni codec frames to 24 kHz audio for up to ``max_rows`` sessions, equal to a full decode.

    The model is moved to ``device`` and ``dtype`` and its modules run as they are (the Snake activations' factors
    are read once, here: load weights before building the stream); the decoder only adds per-row state.
    ``max_frames`` bounds the frames of one push.

    With ``graphs`` (the default on CUDA), each (rows, frames) shape of push is captured once as a CUDA graph and
    replayed: a push then costs its kernels' device time instead of launching several hundred small kernels from
    Python. At most ``max_graphs`` shapes are kept (least recently used dropped); an extra scratch row absorbs the
    capture's warm-up. With ``pad_rows`` (the default with graphs) a push's rows are padded with that scratch row
    up to the next batch bucket (powers of two, and ``max_rows``), so however many sessions push, a few shapes serve.
    """

    def __init__(
        self,
        model: Any,
        max_rows: int,
        device: torch.device | str,
        dtype: torch.dtype,
        *,
        max_frames: int = DEFAULT_MAX_FRAMES,
        graphs: bool | None = None,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
        pad_rows: bool | None = None,
    ) -> None:
        if max_rows < 1 or max_frames < 1 or max_graphs < 1:
            raise ValueError("max_rows, max_frames and max_graphs must be positive")
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_rows = max_rows
        self.max_frames = max_frames
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple[int, int], CapturedCall] = OrderedDict()
        self._buckets = batch_buckets(max_rows) if (self.graphs if pad_rows is None else pad_rows) else ()
        # One row past the sessions' rows: the scratch row that graph captures warm up on.
        self._scratch = max_rows
        slots = max_rows + 1
        model.to(device=self.device, dtype=dtype)
        config = model.config
        self.num_quantizers = int(config.num_quantizers)
        self.codebook_size = int(config.codebook_size)
        self._model = model
        self._transformer = _WindowTransformer(model.pre_transformer, slots, self.device, dtype)
        self._convs: dict[nn.Module, _CausalConv] = {}
        self._transposed: dict[nn.Module, _TransposedConv] = {}
        self._snakes = {
            layer: _Snake(layer) for layer in model.decoder.modules() if isinstance(layer, Qwen3OmniMoeSnakeBeta)
        }
        # Walk the layers as forward runs them, tracking each stage's pre-roll and samples per frame.
        preroll, rate = 0, 1
        for transposed, block in model.upsample:
            preroll, rate = self._add_transposed(transposed, preroll, rate)
            self._add_conv(block.dwconv, preroll)
        self._add_conv(model.decoder[0], preroll)
        for block in model.decoder[1:-2]:
            _snake, transposed, *units = block.block
            preroll, rate = self._add_transposed(transposed, preroll, rate)
            for unit in units:
                self._add_conv(unit.conv1, preroll)
                self._add_conv(unit.conv2, preroll)
        self._add_conv(model.decoder[-1], preroll)
        self.samples_per_frame: int = rate
        self.delay_samples: int = preroll
        if rate != int(model.total_upsample):
            raise UnsupportedCode2Wav(f"the layers upsample {rate}x, the model says {int(model.total_upsample)}x")
        self._free = list(range(max_rows - 1, -1, -1))
        self._open: set[int] = set()
        self._fresh = [True] * max_rows

    def _add_conv(self, layer: Any, preroll: int) -> None:
        self._convs[layer] = _CausalConv(layer, preroll, self.max_rows + 1, self.device, self.dtype)

    def _add_transposed(self, layer: Any, preroll: int, rate: int) -> tuple[int, int]:
        state = _TransposedConv(layer, self.max_rows + 1, self.device, self.dtype)
        self._transposed[layer] = state
        preroll, rate = preroll * state.stride + state.left_pad, rate * state.stride
        if preroll >= rate:
            # A one-frame first push must cover the whole pre-roll of every stage.
            raise UnsupportedCode2Wav("the decoder's start-up trim is longer than one frame")
        return preroll, rate

    @property
    def bytes_per_row(self) -> int:
        """Device bytes of one session's decoder state."""
        return sum(state[0].numel() * state.element_size() for state in self._states())

    def _states(self) -> list[torch.Tensor]:
        states = self._transformer.states()
        for conv in self._convs.values():
            states += conv.states()
        for transposed in self._transposed.values():
            states += transposed.states()
        return states

    def open(self) -> int:
        """A free row whose next push starts a new stream. Raises :class:`NoFreeRow` when all are in use."""
        if not self._free:
            raise NoFreeRow(self.max_rows)
        row = self._free.pop()
        self._open.add(row)
        return row

    def close(self, row: int) -> None:
        """Free ``row`` and forget its stream. Closing a row that is not open does nothing."""
        if row not in self._open:
            return
        self.restart(row)
        self._open.discard(row)
        self._free.append(row)

    def restart(self, row: int) -> None:
        """Keep ``row`` but forget its stream: the next push starts a new one (a new utterance)."""
        if row not in self._open:
            raise InvalidPush(f"row {row} is not open", "rows")
        self._zero_row(row)
        self._fresh[row] = True

    def _zero_row(self, row: int) -> None:
        for state in self._states():
            state[row].zero_()

    @torch.no_grad()
    def push(self, rows: Sequence[int], codes: torch.Tensor) -> torch.Tensor:
        """Decode the next ``T`` frames of each row: ``codes`` is ``[len(rows), num_quantizers, T]``; returns
        ``[len(rows), T * samples_per_frame]`` float32 audio in [-1, 1], continuing what earlier pushes returned.

        The codes' range is checked where they lie: pass them on the host to keep the check from waiting on the
        device."""
        self._check(rows, codes)
        fresh = [self._fresh[row] for row in rows]
        count = len(rows)
        padded = next((size for size in self._buckets if size >= count), count)
        if padded > count:
            # The scratch row fills the bucket: its state takes the (repeated) writes and is never read.
            rows = [*rows, *([self._scratch] * (padded - count))]
            fresh += [True] * (padded - count)
            filler = codes.new_zeros(padded - count, codes.shape[1], codes.shape[2])
            codes = torch.cat((codes, filler))
        if self.graphs:
            wav = self._replay(rows, codes, fresh)
        else:
            index = torch.tensor(list(rows), device=self.device)
            fresh_rows = torch.tensor(fresh, device=self.device) if any(fresh) else None
            wav = self._decode(codes.to(self.device), index, fresh_rows)
        for row in rows[:count]:
            self._fresh[row] = False
        return wav[:count]

    def _decode(self, codes: torch.Tensor, index: torch.Tensor, fresh: torch.Tensor | None) -> torch.Tensor:
        """The push itself, on device tensors only (no host reads: a CUDA graph captures it)."""
        preroll = _Preroll(fresh, self.dtype)
        model = self._model
        x = model.code_embedding(codes + model.code_offset).mean(1).to(self.dtype)
        x = self._transformer(x, index).transpose(1, 2)
        for transposed, block in model.upsample:
            x = self._transposed[transposed](x, index)
            x = self._convnext(block, x, index, preroll)
        x = self._convs[model.decoder[0]](x, index, preroll)
        for block in model.decoder[1:-2]:
            snake, transposed, *units = block.block
            x = self._transposed[transposed](self._snakes[snake](x), index)
            for unit in units:
                h = self._convs[unit.conv1](self._snakes[unit.act1](x), index, preroll)
                x = x + self._convs[unit.conv2](self._snakes[unit.act2](h), index, preroll)
        x = self._convs[model.decoder[-1]](self._snakes[model.decoder[-2]](x), index, preroll)
        return preroll.mask(x, self.delay_samples)[:, 0].clamp(min=-1, max=1).float()

    @torch.no_grad()
    def prepare(self, frames: int = 1) -> None:
        """Capture now the graphs of pushes of ``frames`` frames for every row bucket, so that no session's push
        waits for a capture (a few pushes' time each) when the number of speaking sessions first reaches a bucket.
        Does nothing without graphs or without ``pad_rows``."""
        if not 1 <= frames <= self.max_frames:
            raise InvalidPush(f"a push carries 1 to {self.max_frames} frames, got {frames}", "frames")
        if self.graphs:
            for size in self._buckets:
                self._graph(size, frames)

    def _replay(self, rows: Sequence[int], codes: torch.Tensor, fresh: list[bool]) -> torch.Tensor:
        graph = self._graph(len(rows), int(codes.shape[-1]))
        # Copied into the graph's buffers from wherever they lie (the codes usually from the host).
        inputs = (codes, torch.tensor(list(rows)), torch.tensor(fresh))
        return graph.run(inputs)[0].clone()

    def _graph(self, batch: int, frames: int) -> CapturedCall:
        key = (batch, frames)
        graph = self._graphs.get(key)
        if graph is None:
            while len(self._graphs) >= self.max_graphs:
                self._graphs.popitem(last=False)
            # Captured on the scratch row (the warm-up runs write its state, cleared after), with every fresh-row
            # mask in the graph, applied or not by the ``fresh`` input.
            harmless = (
                torch.zeros(key[0], self.num_quantizers, key[1], dtype=torch.int64, device=self.device),
                torch.full((key[0],), self._scratch, dtype=torch.int64, device=self.device),
                torch.ones(key[0], dtype=torch.bool, device=self.device),
            )
            graph = self._graphs[key] = CapturedCall(lambda *inputs: (self._decode(*inputs),), harmless)
            self._zero_row(self._scratch)
        self._graphs.move_to_end(key)
        return graph

    def _convnext(self, block: Any, x: torch.Tensor, index: torch.Tensor, preroll: _Preroll) -> torch.Tensor:
        h = self._convs[block.dwconv](x, index, preroll).permute(0, 2, 1)
        h = block.pwconv2(block.act(block.pwconv1(block.norm(h))))
        out: torch.Tensor = x + (block.gamma * h).permute(0, 2, 1)
        return out

    def _check(self, rows: Sequence[int], codes: torch.Tensor) -> None:
        if not rows:
            raise InvalidPush("a push needs at least one row", "rows")
        if len(set(rows)) != len(rows):
            raise InvalidPush("a row appears twice in one push", "rows")
        closed = [row for row in rows if row not in self._open]
        if closed:
            raise InvalidPush(f"rows {closed} are not open", "rows")
        if codes.dim() != 3 or codes.shape[0] != len(rows) or codes.shape[1] != self.num_quantizers:
            raise InvalidPush(f"codes must be [{len(rows)}, {self.num_quantizers}, frames], got {list(codes.shape)}")
        if not 1 <= codes.shape[2] <= self.max_frames:
            raise InvalidPush(f"a push carries 1 to {self.max_frames} frames, got {codes.shape[2]}")
        if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
            raise InvalidPush(f"codes must be integers, got {codes.dtype}")
        if bool(((codes < 0) | (codes >= self.codebook_size)).any()):
            raise InvalidPush(f"codes must lie in [0, {self.codebook_size})")
