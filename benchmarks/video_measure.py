"""Measuring one text-to-video generation: streaming VAE decode + encode vs decode-everything-then-encode.

Imports only torch, diffusers, transformers, numpy (and PyAV when encoding), so it runs on a bare GPU machine with
the repository on ``PYTHONPATH``. Both ways decode the same denoised latents in one run:

- streaming: the causal VAE decodes one latent frame at a time (per-generation feature caches) and each decoded
  frame group is converted to RGB and, with ``encode``, H.264-encoded into an fMP4 fragment at once;
- decode-everything: ``vae.decode`` on the whole clip, then RGB conversion, then encoding (the first frame can
  leave only after the whole clip is decoded).

Time to first frame = prompt encoding + denoising + the time until the first frame's bytes exist. Overall frames
per second = frames / (denoising + decode + encode).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from omnigate.engines.video.denoise import Denoiser, encode_prompt, initial_latents, to_rgb_frames
from omnigate.engines.video.model import VideoModel
from omnigate.engines.video.vae_stream import StreamingVaeDecoder, VaeTiling


@dataclass(frozen=True)
class Clip:
    """What to generate."""

    width: int
    height: int
    num_frames: int
    fps: int
    steps: int
    guidance_scale: float = 5.0
    seed: int = 0
    prompt: str = "A red fox running through fresh snow at dawn, cinematic lighting."


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _writer(clip: Clip) -> Any:
    from omnigate.codecs.video import FragmentedMp4Writer  # PyAV: only when encoding

    return FragmentedMp4Writer(clip.width, clip.height, clip.fps)


@torch.inference_mode()
def denoise(model: VideoModel, clip: Clip) -> tuple[torch.Tensor, dict[str, Any]]:
    """Prompt encoding and the denoising loop; returns the VAE-ready latents and their timings."""
    device = model.device
    guided = clip.guidance_scale > 1.0
    _reset_peak(device)
    start = time.perf_counter()
    prompt = encode_prompt(model, clip.prompt)
    negative = encode_prompt(model, "") if guided else None
    noise = initial_latents(model, width=clip.width, height=clip.height, num_frames=clip.num_frames, seed=clip.seed)
    denoiser = Denoiser(model, noise, prompt, negative, steps=clip.steps, guidance_scale=clip.guidance_scale)
    _sync(device)
    text_s = time.perf_counter() - start
    step_s = []
    while not denoiser.done:
        began = time.perf_counter()
        denoiser.step()
        _sync(device)
        step_s.append(time.perf_counter() - began)
    latents = denoiser.vae_latents()
    _sync(device)
    total_s = time.perf_counter() - start
    return latents, {
        "text_encode_s": text_s,
        "steps": len(step_s),
        "step_s_median": statistics.median(step_s),
        "step_s_first": step_s[0],
        "denoise_s": total_s,
        "peak_gib": _peak_gib(device),
    }


@torch.inference_mode()
def decode_streaming(
    model: VideoModel, latents: torch.Tensor, clip: Clip, *, encode: bool, tiling: VaeTiling | None = None
) -> tuple[np.ndarray, dict[str, Any]]:
    """One latent frame at a time: decode, convert, encode; the first frame's bytes exist after one latent frame."""
    device = model.device
    _reset_peak(device)
    start = time.perf_counter()
    decoder = StreamingVaeDecoder(model.vae, tiling)
    writer = _writer(clip) if encode else None
    out_bytes = len(writer.begin()) if writer is not None else 0
    decode_s: list[float] = []
    encode_s = 0.0
    first_frame_s = 0.0
    frames: list[np.ndarray] = []
    for index in range(latents.shape[2]):
        began = time.perf_counter()
        group = to_rgb_frames(decoder.decode(latents[:, :, index : index + 1]))  # .cpu() inside: synchronised
        decoded = time.perf_counter()
        decode_s.append(decoded - began)
        if writer is not None:
            out_bytes += len(writer.push(group))
            encode_s += time.perf_counter() - decoded
        if index == 0:
            first_frame_s = time.perf_counter() - start
        frames.append(group)
    if writer is not None:
        out_bytes += len(writer.finish())
    cache_gib = decoder.cache_bytes / 2**30
    decoder.close()
    total_s = time.perf_counter() - start
    return np.concatenate(frames), {
        "first_frame_s": first_frame_s,
        "total_s": total_s,
        "decode_s_per_latent_frame": decode_s,
        "decode_s_first_latent_frame": decode_s[0],
        "decode_s_later_latent_frame_median": statistics.median(decode_s[1:]) if len(decode_s) > 1 else None,
        "encode_s": encode_s if encode else None,
        "bytes": out_bytes if encode else None,
        "feature_cache_gib_at_end": cache_gib,
        "peak_gib": _peak_gib(device),
    }


@torch.inference_mode()
def decode_everything(
    model: VideoModel, latents: torch.Tensor, clip: Clip, *, encode: bool
) -> tuple[np.ndarray, dict[str, Any]]:
    """``vae.decode`` on the whole clip, then conversion, then encoding: the naive way."""
    device = model.device
    _reset_peak(device)
    start = time.perf_counter()
    frames = to_rgb_frames(model.vae.decode(latents).sample)
    decoded = time.perf_counter()
    first_frame_s = decoded - start
    out_bytes = 0
    if encode:
        writer = _writer(clip)
        out_bytes = len(writer.push(frames[:1]))
        first_frame_s = time.perf_counter() - start
        out_bytes += len(writer.push(frames[1:])) + len(writer.finish())
    total_s = time.perf_counter() - start
    return frames, {
        "first_frame_s": first_frame_s,
        "total_s": total_s,
        "decode_s": decoded - start,
        "encode_s": total_s - (decoded - start) if encode else None,
        "bytes": out_bytes if encode else None,
        "peak_gib": _peak_gib(device),
    }


def warm_up(model: VideoModel, clip: Clip) -> None:
    """Run every kernel once at the clip's shapes (one step, two latent frames), so timings exclude first-call
    costs (cuDNN algorithm search, allocator growth, CPU primitive creation)."""
    frames = min(clip.num_frames, 1 + model.temporal_scale)
    short = Clip(clip.width, clip.height, frames, clip.fps, steps=1, guidance_scale=clip.guidance_scale)
    latents, _ = denoise(model, short)
    decode_streaming(model, latents, short, encode=False)
    decode_everything(model, latents, short, encode=False)


def measure(model: VideoModel, clip: Clip, *, encode: bool, tiling: VaeTiling | None = None) -> dict[str, Any]:
    """One generation, then both decode paths on its latents; a flat report with the side-by-side numbers."""
    latents, denoised = denoise(model, clip)
    streamed, streaming = decode_streaming(model, latents, clip, encode=encode, tiling=tiling)
    whole, everything = decode_everything(model, latents, clip, encode=encode)
    frames = int(streamed.shape[0])
    base = denoised["denoise_s"]
    report: dict[str, Any] = {
        "clip": asdict(clip),
        "latent_frames": int(latents.shape[2]),
        "frames": frames,
        "denoise": denoised,
        "streaming": streaming,
        "decode_everything": everything,
        "time_to_first_frame_s": {
            "streaming": base + streaming["first_frame_s"],
            "decode_everything": base + everything["first_frame_s"],
        },
        "after_denoising_first_frame_s": {
            "streaming": streaming["first_frame_s"],
            "decode_everything": everything["first_frame_s"],
        },
        "overall_fps": {
            "streaming": frames / (base + streaming["total_s"]),
            "decode_everything": frames / (base + everything["total_s"]),
        },
        "decode_fps": {
            "streaming": frames / streaming["total_s"],
            "decode_everything": frames / everything["total_s"],
        },
    }
    # Without tiling the two decodes must agree exactly (with tiling, streaming equals diffusers' tiled decode).
    if tiling is None:
        report["streaming_equals_full_decode"] = bool(np.array_equal(streamed, whole))
    return report
