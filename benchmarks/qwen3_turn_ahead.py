"""A realtime user turn's encode at its end, heard as it came (``turn_ahead``) against encoded whole at the end.

For each turn length in ``--seconds``, a turn of seeded noise with digital-silence gaps and one loud burst (its
loudest frame, ``early`` at 1 s or ``late`` 0.5 s before its end: a late one changes every earlier window's log-mel
clamp, so no window encoded ahead stands) is encoded by the engine's input encoder two ways:

- ``whole``: :meth:`InputEncoder.audio` of the whole turn once it has ended (``-E audio_ahead=false``);
- ``ahead``: the turn heard in 100 ms pieces but the last (:meth:`TurnAhead.hear`), its whole 8-s windows encoded on
  the encoder's thread meanwhile, then :meth:`InputEncoder.finish_turn` with the whole turn's audio.

Timed: from the turn's end to its tokens (``end_ms``: what a response waits for), medians over ``--repeats``. The
pieces are heard as fast as the loop goes, except that each window is let be encoded before the audio after it is
heard, as at a speaker's real-time pace (an 8-s window takes far less than 8 s to encode). Each ``ahead`` result is
checked against ``whole`` (``max_abs_diff``, ``rel_err``).

    python -m benchmarks.qwen3_turn_ahead --model preset:tiny --seconds 4,12,20,30 \\
        --out docs/benchmarks/qwen3_turn_ahead_cpu.json
    python -m benchmarks.qwen3_turn_ahead --model preset:qwen3-omni-30b-a3b --device cuda --dtype bfloat16 \\
        --seconds 4,12,20,30 --out $OUT/qwen3_turn_ahead_gpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from omnigate.engines.qwen3_omni.audio_ahead import ENCODER_RATE, complete_windows
from omnigate.engines.qwen3_omni.encoder import InputEncoder
from omnigate.engines.qwen3_omni.model import load_model

RATE = 24_000  # a realtime session's user audio
PIECE = RATE // 10 * 2  # 100 ms appends


def turn(seconds: float, peak_s: float, seed: int) -> bytes:
    samples = (np.random.default_rng(seed).standard_normal(int(seconds * RATE)) * 3000).clip(-9000, 9000)
    for start in range(2, int(seconds), 4):
        samples[int(start * RATE) : int((start + 0.5) * RATE)] = 0
    burst = int(peak_s * RATE)
    samples[burst : burst + RATE // 5] = 30000 * np.sin(np.arange(RATE // 5) * 0.3)
    return samples.astype("<i2").tobytes()


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


async def whole(encoder: InputEncoder, pcm: bytes) -> tuple[float, torch.Tensor]:
    started = time.perf_counter()
    tokens = await encoder.audio(pcm, RATE)
    synchronize()
    return (time.perf_counter() - started) * 1000.0, tokens


async def ahead(encoder: InputEncoder, pcm: bytes) -> tuple[float, torch.Tensor, int, int]:
    windows_before = encoder.stats.windows_ahead
    kept_before = encoder.stats.windows_kept
    hearing = encoder.turn_ahead(RATE)
    heard = len(pcm) - PIECE
    deadline = time.monotonic() + 600
    for start in range(0, heard, PIECE):
        hearing.hear(pcm[start : min(start + PIECE, heard)])
        # A speaker's pace: each window is encoded before the audio after it comes (one piece of slack for the
        # resampler's delay), so a louder frame later finds the earlier windows encoded under the older clamp.
        due = complete_windows(start // 2 * ENCODER_RATE // RATE, hearing.window_frames)
        while len(hearing.windows) < due:
            if time.monotonic() > deadline:
                raise RuntimeError("the windows heard ahead were not encoded")
            await asyncio.sleep(0.005)
    started = time.perf_counter()
    tokens = await encoder.finish_turn(hearing, pcm)
    synchronize()
    elapsed = (time.perf_counter() - started) * 1000.0
    return elapsed, tokens, encoder.stats.windows_ahead - windows_before, encoder.stats.windows_kept - kept_before


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    model = load_model(args.model, seed=0, device=args.device, dtype=args.dtype, slots=1, max_context=4096)
    encoder = InputEncoder(model, max_waiting=4)
    encoder.start()
    rows: list[dict[str, Any]] = []
    try:
        await whole(encoder, turn(2.0, 1.0, 0))  # warm-up
        for seconds in args.seconds:
            for where, peak_s in (("early", 1.0), ("late", seconds - 0.5)):
                pcm = turn(seconds, peak_s, seed=int(seconds * 10))
                whole_ms: list[float] = []
                ahead_ms: list[float] = []
                encoded = kept = 0
                diff = rel = 0.0
                for _ in range(args.repeats):
                    w_ms, reference = await whole(encoder, pcm)
                    a_ms, tokens, encoded, kept = await ahead(encoder, pcm)
                    whole_ms.append(w_ms)
                    ahead_ms.append(a_ms)
                    delta = (tokens.float() - reference.float()).abs()
                    diff = max(diff, float(delta.max()))
                    rel = max(rel, float(delta.norm() / reference.float().norm()))
                row = {
                    "seconds": seconds,
                    "peak": where,
                    "whole_end_ms": round(statistics.median(whole_ms), 2),
                    "ahead_end_ms": round(statistics.median(ahead_ms), 2),
                    "windows_encoded_ahead": encoded,
                    "windows_kept": kept,
                    "max_abs_diff": diff,
                    "rel_err": rel,
                }
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        await asyncio.to_thread(encoder.stop)
    return {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "host": platform.node(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="preset:tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--seconds", type=lambda s: [float(x) for x in s.split(",")], default=[4.0, 12.0, 20.0, 30.0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args))
    text = json.dumps({"command": " ".join(sys.argv), **result}, indent=2)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
