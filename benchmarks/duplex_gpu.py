"""Duplex engine (Moshi shape, random weights) on a GPU: lockstep tick time against batch size, and the largest number
of concurrent sessions a real-time tick clock serves with zero missed ticks.

Default: the ``moshi-7b`` preset (7B temporal transformer, 3000-step attention window read in full every tick, a
6-layer depth transformer over 8 codebooks, default Mimi in float32) in bfloat16. Every tick encodes each session's
80 ms of input with the streaming Mimi encoder, steps the temporal transformer, samples a text token and 8 audio
codes, and decodes the previous frame with the streaming Mimi decoder; the output lands on the host. Needs only
torch, transformers and numpy. Run from the repository root:

    PYTHONPATH=. python benchmarks/duplex_gpu.py --out duplex_gpu.json
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

from benchmarks.duplex_ticks import (
    gil_contention,
    graphs_match_eager,
    largest_within,
    paced,
    profile_stages,
    time_batch,
)
from omnigate.engines.duplex.frames import FrameModel, FrameSettings
from omnigate.engines.duplex.model import build_preset

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON report to write")
    parser.add_argument("--preset", default="moshi-7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--batches", default="1,2,4,8,16,24,32,48,64", help="session counts to time")
    parser.add_argument("--steps", type=int, default=60, help="timed back-to-back steps per batch size")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--paced-seconds", type=float, default=20.0, help="seconds of each real-time clock run")
    parser.add_argument(
        "--paced-batches",
        default="",
        help="session counts to run on the real-time clock (default: the largest "
        "batch whose timed steps all fit a frame, and the next larger one)",
    )
    parser.add_argument("--context-frames", type=int, default=None, help="attention window (default: the model's)")
    parser.add_argument("--profile-batches", default="1,32", help="batch sizes to split by stage with the profiler")
    parser.add_argument("--no-graphs", action="store_true", help="launch every op eagerly (no CUDA graphs)")
    parser.add_argument(
        "--no-codec-graphs", action="store_true", help="capture only the model; launch the Mimi encode/decode eagerly"
    )
    parser.add_argument(
        "--contend-threads",
        type=int,
        default=0,
        help="also run each paced batch with this many threads holding the GIL in bursts (a loaded server's loop)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    batches = sorted({int(b) for b in args.batches.split(",")})
    device = torch.device(args.device)
    t0 = time.perf_counter()
    model = build_preset(args.preset, seed=0, device=args.device, dtype=DTYPES[args.dtype])
    check_batch = min(4, max(batches))
    frames = FrameModel(
        model,
        FrameSettings(
            slots=max(batches),
            context_frames=args.context_frames,
            cuda_graphs=not args.no_graphs,
            codec_graphs=not args.no_codec_graphs,
            buckets=tuple(sorted({*batches, check_batch})),  # each timed batch runs as itself, unpadded
        ),
    )
    build_s = time.perf_counter() - t0
    config = model.moshi.config
    frame_ms = frames.samples_per_frame * 1000.0 / frames.sample_rate
    params = sum(p.numel() for p in model.moshi.parameters())
    print(f"{args.preset}: {params / 1e9:.2f}B parameters, built in {build_s:.1f} s", flush=True)
    graphs_ok = None
    if frames.use_graphs:
        graphs_ok = graphs_match_eager(frames, check_batch, steps=6)
        print(f"CUDA graphs reproduce eager tokens and audio: {graphs_ok}", flush=True)
        frames.use_graphs = True
    timings = []
    for batch in batches:
        timing = time_batch(frames, batch, steps=args.steps, warmup=args.warmup, frame_ms=frame_ms)
        timings.append(timing)
        print(
            f"batch {batch:3d}: step p50 {timing.step_ms_p50:6.1f} ms  p99 {timing.step_ms_p99:6.1f} ms  "
            f"max {timing.step_ms_max:6.1f} ms  ({timing.frames_per_s:7.1f} session-frames/s)",
            flush=True,
        )
    profiles = {}
    for batch in sorted({int(b) for b in args.profile_batches.split(",") if b} & set(batches)):
        profiles[str(batch)] = profile_stages(frames, batch, steps=10)
        split = ", ".join(
            f"{k.split('/')[1]} {v['host_ms']:.1f}/{v['device_ms']:.1f}" for k, v in profiles[str(batch)].items()
        )
        print(f"batch {batch:3d} stages, host/device ms per tick: {split}", flush=True)
    capacity = largest_within(timings)
    paced_batches = {int(b) for b in args.paced_batches.split(",") if b} or {capacity, _next(batches, capacity)}
    runs = []
    contended = []
    for batch in sorted(b for b in paced_batches if b):
        run = paced(frames, batch, seconds=args.paced_seconds, frame_ms=frame_ms)
        runs.append(run)
        print(
            f"paced {batch:3d} sessions for {args.paced_seconds:g} s: {run.missed_ticks} missed, {run.late_ticks} late"
        )
        if args.contend_threads:
            with gil_contention(args.contend_threads):
                run = paced(frames, batch, seconds=args.paced_seconds, frame_ms=frame_ms)
            contended.append(run)
            print(
                f"paced {batch:3d} sessions with {args.contend_threads} GIL-contending threads: {run.missed_ticks} "
                f"missed, {run.late_ticks} late, step p99 {run.step_ms_p99:.1f} ms",
                flush=True,
            )
    zero_missed = max((r.batch for r in runs if r.missed_ticks == 0), default=0)
    zero_late = max((r.batch for r in runs if r.late_ticks == 0), default=0)
    report: dict[str, Any] = {
        "benchmark": "duplex_gpu",
        "preset": args.preset,
        "random_weights": model.random_weights,
        "dtype": args.dtype,
        "parameters": params,
        "temporal": {
            "hidden": config.hidden_size,
            "layers": config.num_hidden_layers,
            "heads": config.num_attention_heads,
            "window_frames": args.context_frames or config.sliding_window,
        },
        "codebooks": config.num_codebooks,
        "frame_ms": frame_ms,
        "build_s": round(build_s, 1),
        "tick_time_by_batch": [t.to_json() for t in timings],
        "cuda_graphs": frames.use_graphs,
        "graphs_match_eager": graphs_ok,
        "stage_ms_by_batch": profiles,
        "largest_batch_within_a_frame": capacity,
        "paced_runs": [r.to_json() for r in runs],
        "codec_graphs": frames.use_graphs and frames.codec_graphs,
        "contend_threads": args.contend_threads,
        "paced_runs_contended": [r.to_json() for r in contended],
        "concurrent_sessions_zero_missed_ticks": zero_missed,
        "concurrent_sessions_zero_late_ticks": zero_late,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 1) if device.type == "cuda" else None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _next(batches: list[int], batch: int) -> int:
    larger = [b for b in batches if b > batch]
    return larger[0] if larger else 0


if __name__ == "__main__":
    main()
