"""Talker engine on the CPU: step cost at batch 1 vs 8, time to first audio, streaming vs full Mimi decode.

Prints a JSON report and writes it to ``docs/benchmarks/talker_cpu.json``. Random-weight presets measure serving
speed only (cost does not depend on weight values). Run from the repository root:

    .venv/bin/python benchmarks/talker_cpu.py --preset tiny --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import MimiConfig, MimiModel

from omnigate.engines.base import AudioChunk, SynthesisParams
from omnigate.engines.codec.mimi_stream import MimiStreamDecoder
from omnigate.engines.talker.engine import TalkerEngine
from omnigate.engines.talker.model import build_preset, randomize_codebooks
from omnigate.engines.talker.options import TalkerOptions
from omnigate.engines.talker.stream import TalkerStream

OUTPUT = Path("docs/benchmarks/talker_cpu.json")
TEXT = "The quick brown fox jumps over the lazy dog."
LONG_MS = 600_000


def _open(engine: TalkerEngine, seed: int) -> TalkerStream:
    stream = engine.open(SynthesisParams(voice="0", max_audio_ms=LONG_MS), seed=seed)
    stream.pending_text.append(TEXT)
    stream.input_done = True
    return stream


def measure_batch(engine: TalkerEngine, streams: int, steps: int, *, staggered: bool) -> dict[str, float]:
    """Step ``streams`` streams together; with ``staggered`` they join one per step, so chunks fall on different
    steps (as with real arrivals), otherwise they start together and decode their chunks in the same steps."""
    live: list[TalkerStream] = []
    seed = 0
    while len(live) < streams:
        live.append(_open(engine, seed))
        seed += 1
        if staggered or len(live) == streams:
            engine.step(live, [1e12] * len(live))
    for _ in range(8):  # past the chunk ramp: steady state
        engine.step(live, [1e12] * len(live))
    draws_before = sum(s.draws for s in live)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step(live, [1e12] * len(live))
        times.append(time.perf_counter() - start)
    frames = sum(s.draws for s in live) - draws_before
    for stream in live:
        engine.close(stream)
    total = sum(times)
    return {
        "streams": streams,
        "step_ms_mean": 1000 * total / steps,
        "step_ms_median": 1000 * statistics.median(times),
        "frames_per_s": frames / total,
        "audio_s_per_s": frames * engine.frame_ms / 1000 / total,
    }


def measure_ttfa(engine: TalkerEngine, runs: int) -> dict[str, float]:
    """Wall time from a stream's first step call to its first audio chunk (prefill, one frame, one decode)."""
    times = []
    for seed in range(runs):
        stream = _open(engine, 10_000 + seed)
        start = time.perf_counter()
        while not any(isinstance(o, AudioChunk) for o in engine.step([stream], [1e12])[0]):
            pass
        times.append(time.perf_counter() - start)
        engine.close(stream)
    return {"ttfa_ms_median": 1000 * statistics.median(times), "ttfa_ms_max": 1000 * max(times)}


def measure_codec(mimi: Any, frames: int, rounds: int) -> dict[str, float]:
    """Cost per frame: one full ``MimiModel.decode`` of ``frames`` frames vs streaming them in chunks (alone, and
    8 sessions per call).

    The variants run in turn for ``rounds`` rounds and each keeps its best time, so load from other processes on a
    shared host disturbs them alike.
    """
    codebooks = int(mimi.config.num_quantizers)
    sessions = 8
    batch = torch.randint(0, int(mimi.config.codebook_size), (sessions, codebooks, frames), generator=torch.Generator())
    codes = batch[:1]
    decoder = MimiStreamDecoder(mimi, max_slots=sessions)

    def full() -> None:
        with torch.no_grad():
            mimi.decode(codes)

    def streamed(sizes: list[int]) -> Callable[[], None]:
        def run() -> None:
            decoder.reset(0)
            start = 0
            for size in sizes:
                decoder.decode(codes[..., start : start + size], [0])
                start += size

        return run

    def streamed_batch() -> None:
        slots = list(range(sessions))
        for slot in slots:
            decoder.reset(slot)
        for start in range(0, frames, 8):
            decoder.decode(batch[..., start : start + 8], slots)

    def chunking(first: list[int], size: int) -> list[int]:
        sizes = list(first)
        while sum(sizes) < frames:
            sizes.append(min(size, frames - sum(sizes)))
        return sizes

    variants: dict[str, Callable[[], None]] = {
        "full_decode": full,
        "stream_ramp_1_2_4_8": streamed(chunking([1, 2, 4], 8)),
        "stream_chunk_8": streamed(chunking([], 8)),
        "stream_chunk_1": streamed(chunking([], 1)),
        "stream_chunk_8_batch_8": streamed_batch,
    }
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(rounds + 1):  # the first round warms up
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    result = {"frames": float(frames)}
    best["stream_chunk_8_batch_8"] /= sessions  # per session: each call decodes a chunk of every session
    for name, seconds in best.items():
        result[f"{name}_ms_per_frame"] = 1000 * seconds / frames
        if name != "full_decode":
            result[f"{name}_vs_full"] = seconds / best["full_decode"]
    return result


def _default_mimi() -> Any:
    torch.manual_seed(0)
    mimi: Any = MimiModel(MimiConfig())
    mimi.eval()
    with torch.no_grad():
        randomize_codebooks(mimi, torch.Generator().manual_seed(0))
    return mimi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the host is shared: 1 is steadiest)")
    parser.add_argument("--steps", type=int, default=48, help="measured steps per batch size")
    parser.add_argument("--codec-frames", type=int, default=96)
    parser.add_argument("--skip-default-mimi", action="store_true", help="skip the full-size (79M) Mimi codec")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    engine = TalkerEngine(
        build_preset(args.preset), TalkerOptions(max_sessions=8, max_batch=8, segment_ms_per_char=0.0)
    )
    measure_batch(engine, 1, 4, staggered=False)  # warm-up
    batch1 = measure_batch(engine, 1, args.steps, staggered=False)
    batch8 = measure_batch(engine, 8, args.steps, staggered=False)
    batch8_staggered = measure_batch(engine, 8, args.steps, staggered=True)
    report: dict[str, Any] = {
        "preset": args.preset,
        "threads": args.threads,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "loadavg_before": load_before},
        "torch": torch.__version__,
        "frame_ms": engine.frame_ms,
        "batch_1": batch1,
        "batch_8": batch8,
        "batch_8_staggered": batch8_staggered,
        "batching_gain_8_over_1": batch8["frames_per_s"] / batch1["frames_per_s"],
        "batching_gain_8_staggered_over_1": batch8_staggered["frames_per_s"] / batch1["frames_per_s"],
        "ttfa": measure_ttfa(engine, runs=9),
        "codec_preset": measure_codec(engine.model.csm.codec_model, args.codec_frames, rounds=7),
    }
    if not args.skip_default_mimi:
        report["codec_default_mimi"] = measure_codec(_default_mimi(), frames=96, rounds=3)
    report["host"]["loadavg_after"] = os.getloadavg()
    text = json.dumps(report, indent=2)
    print(text)
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text + "\n")


if __name__ == "__main__":
    main()
