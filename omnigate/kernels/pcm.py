"""Float audio to s16 PCM on the device, packed with each row's RMS and a flag so one copy brings a step home.

Row layout of the packed ``int16`` buffer: ``samples`` PCM values, then the float32 RMS of the clamped audio as two
int16 halves (low half first), then the flag.
"""

from __future__ import annotations

import numpy as np
import torch

from omnigate.kernels.backend import triton_kernels, use_triton

PACK_EXTRA = 3  # int16 columns after the samples: RMS (2) and the flag (1)


def pack_pcm_reference(audio: torch.Tensor, flags: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``audio`` (``[R, samples]``, full scale 1.0), clamped and rounded to s16, its RMS and ``flags``
    (``[R]``) into ``out`` (``[R, samples + PACK_EXTRA]`` int16)."""
    samples = audio.shape[1]
    clamped = audio.float().clamp(-1.0, 1.0)
    out[:, :samples] = (clamped * 32767.0).round().to(torch.int16)
    rms = clamped.pow(2).mean(dim=-1).sqrt()
    out[:, samples : samples + 2] = rms.contiguous().view(torch.int16).view(-1, 2)
    out[:, samples + 2] = flags.to(torch.int16)


def pack_pcm(audio: torch.Tensor, flags: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`pack_pcm_reference` in one Triton kernel on CUDA."""
    if use_triton(audio) and audio.stride(-1) == 1:
        triton_kernels().pack_pcm(audio, flags, out)
        return
    pack_pcm_reference(audio, flags, out)


def unpack_rms(
    packed: np.ndarray[tuple[int, int], np.dtype[np.int16]], samples: int
) -> np.ndarray[tuple[int], np.dtype[np.float32]]:
    """The per-row RMS values of a packed host buffer (little-endian halves)."""
    halves = np.ascontiguousarray(packed[:, samples : samples + 2]).astype("<i2")
    return halves.view("<f4").reshape(-1).astype(np.float32)
