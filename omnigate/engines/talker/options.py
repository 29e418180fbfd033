"""Options of the talker engine (``omnigate serve --engine talker --engine-option KEY=VALUE``)."""

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


class TalkerOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Engine-wide settings; strings from the command line are converted to these types."""

    max_sessions: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 8  # KV and codec slots
    max_batch: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 8  # streams per step
    device: str = "cpu"
    threads: Annotated[int, msgspec.Meta(ge=1)] | None = None  # torch CPU threads for the process; None: torch's
    dtype: DType = "float32"  # backbone and depth decoder
    # The Mimi decoder's layers (its codebooks stay at least float32); None: the same as dtype.
    codec_dtype: DType | None = None
    cuda_graphs: bool = True  # on CUDA, capture each step size as a CUDA graph
    # Launch each device step before filing the previous one's outputs (the host work overlaps the device's).
    # None: on for CUDA devices.
    overlap_steps: bool | None = None
    # With overlap_steps, file the frames of the step on the device (frame counts, caps) before waiting for it,
    # while it runs; an end-of-audio frame's filing is undone after the wait. False: filed after the wait.
    file_ahead: bool = True
    # With file_ahead, also plan the next step before the wait for the rows the frames on the device cannot change
    # (those keeping their segment); the rest are planned after it, as before. False: the whole plan after the wait.
    plan_ahead: bool = True
    # New text tokens one step prefills over all its starting units (a unit longer than this starts alone in its
    # step); more waits for the next step.
    prefill_tokens_per_step: Annotated[int, msgspec.Meta(ge=1, le=8192)] = 1024
    # With CUDA graphs, the prefill graphs are captured for every token count up to this, whatever a stream's
    # context window (a step's tokens span many streams); a larger prefill replays them piece by piece. None: the
    # per-step budget, so every step's prefill replays one graph. 0: prefills run eagerly. Their memory grows
    # linearly with it (see omnigate.engines.talker.prefill_graphs; the load log says what the capture took).
    prefill_graph_tokens: Annotated[int, msgspec.Meta(ge=0, le=8192)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=10.0)] = 0.9  # 0: greedy
    top_k: Annotated[int, msgspec.Meta(ge=0)] = 50  # 0: no top-k
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0  # 1: no top-p
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0  # 1: none
    repetition_window: Annotated[int, msgspec.Meta(ge=0, le=64)] = 16  # frames of each codebook the penalty sees
    seed: Annotated[int, msgspec.Meta(ge=0)] = 0  # weights of presets and default stream seeds
    chunk_first_frames: Annotated[int, msgspec.Meta(ge=1, le=256)] = 1
    chunk_max_frames: Annotated[int, msgspec.Meta(ge=1, le=256)] = 8
    max_context: Annotated[int, msgspec.Meta(ge=16)] | None = None  # tokens per stream; None: model's maximum
    silence_dbfs: float = -40.0
    silence_s: Annotated[float, msgspec.Meta(gt=0.0)] = 2.0
    eos_bias: float = 0.0  # added to the end-of-audio logit of every codebook; > 0 shortens audio
    # Cap each text unit's audio at this many ms per character (0: no cap). Random weights never choose to stop,
    # so None means 60 (about speaking pace) for presets and no cap for checkpoints.
    segment_ms_per_char: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    speakers: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2  # voices "0".."speakers-1" (CSM speaker ids)
    max_context_audio_s: Annotated[float, msgspec.Meta(ge=0.0)] = 30.0  # reference audio per utterance
