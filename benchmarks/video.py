"""Video generation on the CPU with the ``tiny`` preset: streaming vs decode-everything, and through the engine.

For the record only (random weights, a few-million-parameter model): absolute times come from the GPU run
(``benchmarks/video_gpu.py``). Measures, side by side on the same latents, time to first video frame, overall frames
per second and VAE decode time per latent frame; then the same generation served by :class:`VideoEngine` with the
fMP4 muxer as consumer (what ``WS /v1/realtime/video`` does, without the socket). Medians of ``--repeats`` runs after
a warm-up. Run from the repository root:

    .venv/bin/python -m benchmarks.video
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.video_measure import Clip, measure, warm_up
from omnigate.codecs.video import FragmentedMp4Writer
from omnigate.engines.video.engine import VideoEngine
from omnigate.engines.video.model import VideoModel, build_preset
from omnigate.engines.video.outputs import VideoDone, decoded_before_first_consumed
from omnigate.engines.video.request import VideoOptions

OUTPUT = Path("docs/benchmarks/video_cpu.json")


def served(model: VideoModel, clip: Clip, window: int) -> dict[str, Any]:
    """One generation through the engine's worker thread, each frame group muxed to fMP4 as it arrives."""
    engine = VideoEngine(model, VideoOptions(max_frames_in_flight=window))
    engine.start()
    try:
        began = time.perf_counter()
        job = engine.submit(
            engine.resolve(
                clip.prompt,
                width=clip.width,
                height=clip.height,
                num_frames=clip.num_frames,
                fps=clip.fps,
                steps=clip.steps,
                seed=clip.seed,
                guidance_scale=clip.guidance_scale,
            )
        )
        writer = FragmentedMp4Writer(clip.width, clip.height, clip.fps)
        writer.begin()
        first_fragment_s: float | None = None
        while not isinstance(output := job.wait_output(timeout=600), VideoDone):
            writer.push(output.frames)
            if first_fragment_s is None:
                first_fragment_s = time.perf_counter() - began
            job.consumed(output.count)
        writer.finish()
        total_s = time.perf_counter() - began
    finally:
        engine.stop()
    assert output.status == "completed" and first_fragment_s is not None
    return {
        "time_to_first_frame_s": first_fragment_s,
        "total_s": total_s,
        "overall_fps": output.frames / total_s,
        "decoded_before_first_send": decoded_before_first_consumed(output.timeline),
        "bytes": writer.bytes_out,
    }


def median_report(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-key medians of numeric leaves (lists and strings come from the first run)."""
    first = runs[0]
    merged: dict[str, Any] = {}
    for key, value in first.items():
        if isinstance(value, dict):
            merged[key] = median_report([run[key] for run in runs])
        elif isinstance(value, bool) or not isinstance(value, int | float):
            merged[key] = value
        else:
            merged[key] = statistics.median(run[key] for run in runs)
    return merged


def repeat(times: int, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    return median_report([run() for _ in range(times)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUTPUT)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--height", type=int, default=128)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--fps", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--window", type=int, default=16, help="engine frames in flight")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_preset("tiny")
    clip = Clip(args.width, args.height, args.frames, args.fps, args.steps)
    warm_up(model, clip)
    direct = repeat(args.repeats, lambda: measure(model, clip, encode=True))
    engine = repeat(args.repeats, lambda: served(model, clip, args.window))
    report = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "load_average_at_end": os.getloadavg(),
        },
        "model": {"preset": "tiny", "parameters": model.parameter_count()},
        "repeats": args.repeats,
        **direct,
        "engine": engine,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    ttff, fps = report["time_to_first_frame_s"], report["overall_fps"]
    print(
        f"tiny {args.width}x{args.height} {args.frames} frames, {args.steps} steps: time to first frame "
        f"streaming {ttff['streaming']:.3f} s vs decode-everything {ttff['decode_everything']:.3f} s; overall fps "
        f"{fps['streaming']:.1f} vs {fps['decode_everything']:.1f}; engine {engine['time_to_first_frame_s']:.3f} s, "
        f"{engine['overall_fps']:.1f} fps"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
