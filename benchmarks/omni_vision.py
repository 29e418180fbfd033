"""The omni vision encoder's cost per new frame: transformers' loop of one attention call per window against the
batched window attention (:mod:`omnigate.engines.omni.vision_attention`).

Builds the preset's vision encoder alone (random weights, no language model: the 3B shape's encoder is ~670M
parameters, 2.7 GB in float32), then for each attention ``--frames`` frames of ``--frame-size`` px in one call:
milliseconds per frame (best of ``--repeats`` timed calls after a warm-up), attention kernel calls per frame (calls of
``scaled_dot_product_attention``), and the largest difference of the two outputs.

CPU, tiny preset, and the 3B shape's encoder on a few frames (tens of seconds)::

    python -m benchmarks.omni_vision --preset tiny --frames 8 --frame-size 168 --out /tmp/omni_vision_tiny.json
    python -m benchmarks.omni_vision --preset qwen2.5-omni-3b --frames 2 --repeats 1 --out /tmp/omni_vision_3b.json

GPU, the 3B shape (32 frames: the bound of live video chat)::

    python -m benchmarks.omni_vision --preset qwen2.5-omni-3b --device cuda --dtype bfloat16 --frames 32 \\
        --out $OUT/omni_vision.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniVisionEncoder

from omnigate.engines.omni.model import PRESETS, _dtype
from omnigate.engines.omni.vision_attention import SEGMENTED_SDPA, use_segmented_attention

STOCK = "sdpa"


class _CountAttention(TorchFunctionMode):
    """Counts ``scaled_dot_product_attention`` calls under it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is F.scaled_dot_product_attention:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(encoder: Any, pixels: torch.Tensor, grid_thw: torch.Tensor, repeats: int) -> tuple[float, int, Any]:
    """Best seconds of one encoder call, its attention calls, its output."""
    with torch.inference_mode():
        out = encoder(pixels, grid_thw=grid_thw).pooler_output  # warm-up
        with _CountAttention() as counter:
            encoder(pixels, grid_thw=grid_thw)
        best = float("inf")
        for _ in range(repeats):
            _sync(pixels.device)
            started = time.perf_counter()
            encoder(pixels, grid_thw=grid_thw)
            _sync(pixels.device)
            best = min(best, time.perf_counter() - started)
    return best, counter.calls, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--frames", type=int, default=4)
    parser.add_argument("--frame-size", type=int, default=None, help="px, a multiple of 28 (the preset's by default)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    size = args.frame_size or preset.frame_size
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    with device:
        encoder: Any = Qwen2_5OmniVisionEncoder._from_config(preset.config().vision_config)
    encoder = encoder.to(_dtype(args.dtype)).eval()
    config = encoder.config
    grid = size // config.patch_size
    patch_values = config.in_channels * config.temporal_patch_size * config.patch_size**2
    gen = torch.Generator().manual_seed(args.seed)
    pixels = torch.randn(args.frames * grid * grid, patch_values, generator=gen).to(device, encoder.dtype)
    grid_thw = torch.tensor([[1, grid, grid]] * args.frames, device=device)
    report: dict[str, Any] = {
        "preset": args.preset,
        "frame_size": size,
        "frames": args.frames,
        "device": str(device),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
    }
    if hasattr(os, "getloadavg"):
        report["load_before"] = os.getloadavg()
    outputs = {}
    for name in (STOCK, SEGMENTED_SDPA):
        config._attn_implementation = STOCK
        if name == SEGMENTED_SDPA:
            use_segmented_attention(config)
        seconds, calls, outputs[name] = measure(encoder, pixels, grid_thw, args.repeats)
        report[name] = {
            "ms_per_frame": round(seconds * 1000 / args.frames, 3),
            "attention_calls_per_frame": calls / args.frames,
        }
        print(json.dumps({name: report[name]}), flush=True)
    report["max_abs_difference"] = (outputs[STOCK].float() - outputs[SEGMENTED_SDPA].float()).abs().max().item()
    if hasattr(os, "getloadavg"):
        report["load_after"] = os.getloadavg()
    print(json.dumps(report), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
