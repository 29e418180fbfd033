"""Wan2.1-T2V-1.3B shape (random weights) on a GPU: streaming VAE decode vs decode-everything, side by side.

Default: 832x480, 81 frames, 50 steps, classifier-free guidance 5.0, transformer and text encoder in bfloat16, the
VAE in float32 (as Wan runs it). Reports time to first video frame, overall frames per second, VAE decode time per
latent frame and peak GPU memory per phase. Needs torch, diffusers and transformers; encoding needs PyAV and msgspec
(the ``omnigate.codecs`` package imports them), so pass ``--no-encode`` where they are missing. Run from the
repository root:

    PYTHONPATH=. python benchmarks/video_gpu.py --out video_gpu.json

The preset's text encoder is a 2-layer UMT5 of Wan's width (4096), not UMT5-XXL: it runs once per request, so the
denoising and decoding numbers are Wan2.1-1.3B's; ``text_encode_s`` is not.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.video_measure import Clip, measure, warm_up
from omnigate.engines.video.model import build_preset
from omnigate.engines.video.vae_stream import VaeTiling


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON report to write")
    parser.add_argument("--preset", default="wan-1.3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--vae-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--fps", type=int, default=16)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--guidance", type=float, default=5.0)
    parser.add_argument("--vae-tile", type=int, default=None, help="spatial VAE tile in pixels (default: none)")
    parser.add_argument("--no-encode", action="store_true", help="skip H.264 encoding (no PyAV needed)")
    parser.add_argument("--no-warmup", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    began = time.perf_counter()
    model = build_preset(args.preset, device=args.device, dtype=args.dtype, vae_dtype=args.vae_dtype)
    build_s = time.perf_counter() - began
    weights_gib = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    clip = Clip(args.width, args.height, args.frames, args.fps, args.steps, args.guidance)
    tiling = VaeTiling(args.vae_tile, args.vae_tile * 3 // 4) if args.vae_tile else None
    encode = not args.no_encode
    if not args.no_warmup:
        warm_up(model, clip)
    report: dict[str, Any] = {
        "machine": {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
        },
        "model": {
            "preset": args.preset,
            "dtype": args.dtype,
            "vae_dtype": args.vae_dtype,
            "parameters": model.parameter_count(),
            "transformer_parameters": sum(p.numel() for p in model.transformer.parameters()),
            "vae_parameters": sum(p.numel() for p in model.vae.parameters()),
            "build_s": build_s,
            "weights_gib": weights_gib,
        },
        "vae_tile": args.vae_tile,
        "encode": encode,
        **measure(model, clip, encode=encode, tiling=tiling),
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    ttff, fps = report["time_to_first_frame_s"], report["overall_fps"]
    print(
        f"{args.preset} {args.width}x{args.height} {args.frames} frames, {args.steps} steps: "
        f"denoise {report['denoise']['denoise_s']:.2f} s; time to first frame streaming {ttff['streaming']:.2f} s "
        f"vs decode-everything {ttff['decode_everything']:.2f} s; overall fps {fps['streaming']:.2f} vs "
        f"{fps['decode_everything']:.2f}; VAE {report['streaming']['decode_s_later_latent_frame_median']} s per "
        f"latent frame; peak GiB denoise {report['denoise']['peak_gib']}, streaming decode "
        f"{report['streaming']['peak_gib']}, full decode {report['decode_everything']['peak_gib']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
