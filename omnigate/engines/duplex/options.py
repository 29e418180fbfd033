"""Options of the duplex engine (``omnigate serve --engine duplex --engine-option KEY=VALUE``)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import torch

DType = Literal["float32", "float64", "bfloat16", "float16"]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class DuplexOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Engine-wide settings; strings from the command line are converted to these types."""

    max_sessions: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 8  # slots: live duplex sessions at once
    device: str = "cpu"
    dtype: DType = "float32"  # the language model; the Mimi codec runs in float32 below that precision
    context_frames: Annotated[int, msgspec.Meta(ge=1)] | None = None  # attention window; None: the model's own
    text_temperature: Annotated[float, msgspec.Meta(ge=0.0, le=10.0)] = 0.7  # 0: greedy
    text_top_k: Annotated[int, msgspec.Meta(ge=0)] = 25
    audio_temperature: Annotated[float, msgspec.Meta(ge=0.0, le=10.0)] = 0.8
    audio_top_k: Annotated[int, msgspec.Meta(ge=0)] = 250
    seed: Annotated[int, msgspec.Meta(ge=0)] = 0  # weights of presets and the sampling seeds of sessions
    listen_token_id: Annotated[int, msgspec.Meta(ge=0)] = 3  # the text id a Moshi model emits while it listens
    retry_after_s: Annotated[float, msgspec.Meta(gt=0.0)] = 5.0  # hint given to a session refused for capacity
    codec_graphs: bool = True  # on CUDA, capture the Mimi encode/decode per batch bucket too (false: launch them)
