"""What a video generation hands its consumer: decoded frame groups, then exactly one :class:`VideoDone`."""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np
import numpy.typing as npt

VideoStatus = Literal["completed", "cancelled", "error"]
TimelineKind = Literal["admitted", "encoded", "step", "decoded", "consumed", "done"]


class TimelineEvent(msgspec.Struct, frozen=True, array_like=True):
    """One thing that happened to a generation, in the order it happened (``at``: ``time.perf_counter()``).

    ``index`` is the step for ``step``, the latent frame for ``decoded``, the frame count for ``consumed``.
    """

    kind: TimelineKind
    index: int
    at: float


class FrameGroup(msgspec.Struct, frozen=True):
    """The video frames one latent frame decodes to: one for the first latent frame, then ``temporal_scale``."""

    latent_index: int
    first_frame: int
    frames: npt.NDArray[np.uint8]  # (n, height, width, 3) RGB
    # Chunk-causal generation hands out one group per chunk of latent frames: its index and the prompt it followed.
    chunk_index: int | None = None
    prompt_id: int | None = None

    @property
    def count(self) -> int:
        return int(self.frames.shape[0])


class VideoDone(msgspec.Struct, frozen=True):
    """The generation ended; always its last output, also on cancel and error (after its slot is free)."""

    status: VideoStatus
    frames: int
    latent_frames: int
    timeline: tuple[TimelineEvent, ...]
    code: str | None = None
    error: str | None = None


class PromptUpdated(msgspec.Struct, frozen=True):
    """A live stream's new prompt takes effect (handed out before that chunk's frames): ``chunk_index`` is the first
    chunk generated with it, from its denoising step ``step`` on (0: the whole chunk; later steps of a chunk
    already under way when the prompt came)."""

    prompt_id: int
    chunk_index: int
    step: int = 0


VideoOutput = FrameGroup | PromptUpdated | VideoDone


def decoded_before_first_consumed(timeline: tuple[TimelineEvent, ...]) -> int:
    """Latent frames decoded before the consumer reported its first frames sent (all of them if it never did)."""
    decoded = 0
    for event in timeline:
        if event.kind == "consumed":
            break
        if event.kind == "decoded":
            decoded += 1
    return decoded


def first_time(timeline: tuple[TimelineEvent, ...], kind: TimelineKind) -> float | None:
    """When the first event of ``kind`` happened, or None."""
    return next((event.at for event in timeline if event.kind == kind), None)
