"""Talker step on the GPU, side by side: steps that overlap the host work or wait for it, Mimi in float32 or bfloat16.

Run on the GPU machine from the repository root (writes ``talker_step_gpu.json`` into ``--out``)::

    python -m benchmarks.talker_step_gpu --out docs/benchmarks

For each Mimi decoder dtype the engine is built as the server builds it (``preset:csm-1b``, bfloat16 talker, 768
slots, CUDA graphs) and measured at each row count:

- the step's CUDA graph (GPU time, every row at ``--context`` tokens) and the Mimi decode plus s16 packing alone;
- ``engine.step`` in steady state (every row a stream mid-utterance, unlimited credit), with ``overlap_steps`` off
  and on: wall time per step and the fraction of it the GPU was busy with the step's graph. Once with the engine
  thread alone, and once beside a Python thread that holds the GIL 40 % of the time (2 ms of work, 3 ms asleep),
  as a server's event loop does under load.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.talker_gpu import (
    FRAME_MS,
    _cuda_time_ms,
    _fill_slots,
    _graph,
    _open_long,
    _start_all,
    log,
    step_timings,
)

ENGINE_OPTIONS = {
    "device": "cuda",
    "dtype": "bfloat16",
    "max_sessions": "768",
    "max_batch": "768",
    "max_context": "1024",
    "top_p": "0.95",
    "repetition_penalty": "1.1",
    # Random weights never end a unit; without the preset's per-character cap every row keeps its stream for the
    # whole measurement, so each setting steps the same number of rows.
    "segment_ms_per_char": "0",
}


class GilContender:
    """A Python thread that takes the GIL ``busy_ms`` out of every ``busy_ms + idle_ms``, like a busy event loop."""

    def __init__(self, busy_ms: float = 2.0, idle_ms: float = 3.0) -> None:
        self._busy_s = busy_ms / 1000
        self._idle_s = idle_ms / 1000
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            until = time.perf_counter() + self._busy_s
            while time.perf_counter() < until:
                sum(i * i for i in range(200))
            time.sleep(self._idle_s)

    def __enter__(self) -> GilContender:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def codec_timing(engine: Any, rows: int) -> float:
    """GPU time of the Mimi decode of one frame per row plus its s16 packing, as its own CUDA graph."""
    import torch

    from omnigate.kernels.pcm import pack_pcm

    slots = torch.tensor(_fill_slots(engine, rows, 16), device=engine.frames.device)
    codes = torch.randint(1, 2048, (rows, engine.frames.num_codebooks, 1), device=engine.frames.device)
    flags = torch.zeros(rows, dtype=torch.bool, device=engine.frames.device)
    out = engine.device_step.out[:rows]

    def codec_and_pcm() -> None:
        pack_pcm(engine.codec.decode_frames(codes, slots), flags, out)

    return _cuda_time_ms(_graph(codec_and_pcm))


def steady(engine: Any, rows: int, graph_ms: float, steps: int) -> dict[str, Any]:
    """``engine.step`` per step with ``rows`` streams mid-utterance, each overlap setting, alone and contended."""
    from omnigate.engines.base import AudioChunk

    streams = [_open_long(engine, seed=1000 + k) for k in range(rows)]
    budgets = [1e12] * rows
    _start_all(engine, streams)
    out: dict[str, Any] = {}
    for contended in (False, True):
        for overlap in (False, True):
            engine.overlap_steps = overlap
            with GilContender() if contended else _Nothing():
                for _ in range(3):
                    engine.step(streams, budgets)
                walls, frames = [], 0
                for _ in range(steps):
                    t0 = time.perf_counter()
                    outputs = engine.step(streams, budgets)
                    walls.append((time.perf_counter() - t0) * 1000)
                    frames += sum(
                        round(o.duration_ms / FRAME_MS) for row in outputs for o in row if isinstance(o, AudioChunk)
                    )
            wall = statistics.median(walls)
            key = ("contended" if contended else "alone") + ("_overlap" if overlap else "_wait")
            out[key] = {
                "step_wall_ms": wall,
                "step_wall_p90_ms": sorted(walls)[int(0.9 * (len(walls) - 1))],
                "frames_per_step": frames / steps,
                "gpu_busy_fraction": min(1.0, graph_ms / wall),
                "streams_realtime": int(rows * FRAME_MS / wall),
            }
            log(f"steady rows={rows} {key}: {json.dumps(out[key])}")
    engine.step(streams, budgets)  # collect the last overlapped step
    for stream in streams:
        engine.close(stream)
    engine.overlap_steps = True
    return out


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None


def measure(codec_dtype: str, sizes: list[int], context: int, steps: int) -> dict[str, Any]:
    import torch

    from omnigate.engines.talker.engine import TalkerEngine

    t0 = time.perf_counter()
    engine = TalkerEngine.load("preset:csm-1b", **ENGINE_OPTIONS, codec_dtype=codec_dtype)
    result: dict[str, Any] = {
        "load_s": time.perf_counter() - t0,
        "codec_state_per_session_bytes": engine.codec.bytes_per_slot,
        "allocated_after_load_bytes": torch.cuda.memory_allocated(),
    }
    gc.freeze()
    log(f"codec {codec_dtype}: loaded in {result['load_s']:.1f} s")
    result["graph"] = step_timings(engine, sizes, context)
    result["codec_and_pcm_ms"] = {}
    result["steady"] = {}
    for rows in sizes:
        result["codec_and_pcm_ms"][str(rows)] = codec_timing(engine, rows)
        log(f"codec {codec_dtype} rows={rows}: {result['codec_and_pcm_ms'][str(rows)]:.2f} ms")
    for rows in sizes:
        result["steady"][str(rows)] = steady(engine, rows, result["graph"][str(rows)]["graph_gpu_ms"], steps)
    del engine
    gc.unfreeze()
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--sizes", type=lambda t: [int(v) for v in t.split(",")], default=[1, 256, 512, 768])
    parser.add_argument("--codec-dtypes", default="float32,bfloat16")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12, help="timed steady-state steps per setting")
    args = parser.parse_args(argv)
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "benchmarks.talker_step_gpu", *sys.argv[1:]]),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "engine_options": ENGINE_OPTIONS,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "codec": {},
    }
    path = args.out / "talker_step_gpu.json"
    for codec_dtype in args.codec_dtypes.split(","):
        report["codec"][codec_dtype] = measure(codec_dtype, args.sizes, args.context, args.steps)
        path.write_text(json.dumps(report, indent=2))
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
