"""Camera frames in Qwen3-Omni's thinker: pixels to the vision encoder's patches, and the prompt's rotary positions.

A frame is one image (grid ``1 x h x w`` patches, the picture repeated over the encoder's temporal patch). Its vision
tokens (:class:`FrameTokens`) are the merged embeddings that replace the frame's image placeholders and the
"deepstack" features that the first decoder layers add at those rows; they do not depend on where the frame sits in
a prompt, so a session's cache of them stays valid from one question to the next.

Positions follow transformers' ``get_rope_index``: text and audio tokens take sequential positions; an image's
tokens take ``(s, s + row, s + column)`` of its merged grid from the next free position ``s``, and the token after
it continues from the largest position used plus one. A prompt's positions end ``delta`` (zero or less) away from
its length; decoding goes on at the cache position plus that ``delta``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from omnigate.kernels.vision_patches import frame_patches as vision_patches

# Qwen3-Omni's image processor normalises every channel with mean 0.5 and deviation 0.5.
PIXEL_MEAN = 0.5
PIXEL_STD = 0.5


@dataclass(frozen=True)
class FrameTokens:
    """One frame's vision tokens: ``tokens`` ``[1 + deepstack layers, n, hidden]`` (the merged embeddings first) of a
    merged grid of ``grid`` (rows, columns), ``n = rows * columns``."""

    tokens: torch.Tensor
    grid: tuple[int, int]

    @property
    def count(self) -> int:
        return self.grid[0] * self.grid[1]


def frame_patches(frame: np.ndarray, *, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """One ``H x W x 3`` uint8 frame (sides multiples of ``patch * merge``) as the encoder's flattened patches, with
    Qwen3-Omni's normalisation."""
    return vision_patches(frame, patch=patch, merge=merge, temporal=temporal, mean=PIXEL_MEAN, std=PIXEL_STD)


def rope_positions(ids: Sequence[int], image_token: int, grids: Sequence[tuple[int, int]]) -> tuple[list[int], ...]:
    """The three rotary position rows (temporal, height, width) of a prompt whose runs of ``image_token`` are the
    frames of merged ``grids``, in order. Raises ValueError when the runs and the grids disagree."""
    rows: tuple[list[int], list[int], list[int]] = ([], [], [])
    position = 0
    frames = iter(grids)
    i = 0
    while i < len(ids):
        if ids[i] != image_token:
            for row in rows:
                row.append(position)
            position += 1
            i += 1
            continue
        grid = next(frames, None)
        if grid is None:
            raise ValueError("the prompt has more image placeholders than frames")
        height, width = grid
        count = height * width
        if list(ids[i : i + count]) != [image_token] * count:
            raise ValueError(f"a frame of {count} tokens has a different number of placeholders")
        for k in range(count):
            rows[0].append(position)
            rows[1].append(position + k // width)
            rows[2].append(position + k % width)
        position += max(height, width)
        i += count
    if next(frames, None) is not None:
        raise ValueError("the prompt has fewer image placeholders than frames")
    return rows
