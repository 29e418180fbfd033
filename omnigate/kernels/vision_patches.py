"""Camera frames as a Qwen-VL style vision encoder's input: normalised pixels cut into flattened patches."""

from __future__ import annotations

import numpy as np
import torch


def frame_patches(
    frame: np.ndarray, *, patch: int, merge: int, temporal: int, mean: float | torch.Tensor, std: float | torch.Tensor
) -> torch.Tensor:
    """One ``H x W x 3`` uint8 frame (sides multiples of ``patch * merge``), normalised with ``mean`` and ``std``
    (per channel: ``[3, 1, 1]``, or one value), as the encoder's flattened patches
    ``[grid_h * grid_w, 3 * temporal * patch * patch]``, in the order transformers' image processors write them (the
    picture repeated over the temporal patch, the merge windows' patches next to each other)."""
    height, width = frame.shape[:2]
    if height % (patch * merge) or width % (patch * merge):
        raise ValueError(f"a {width}x{height} frame is not a multiple of {patch * merge} pixels on each side")
    image = torch.from_numpy(frame.copy()).to(torch.float32).permute(2, 0, 1) / 255.0
    image = (image - mean) / std
    gh, gw = height // patch, width // patch
    x = image[None].repeat(temporal, 1, 1, 1)
    x = x.reshape(1, temporal, 3, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gh * gw, 3 * temporal * patch * patch)
