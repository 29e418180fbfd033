"""Robot policy (pi0 shapes, random weights) on one GPU: one-robot latency, and how many robots at 10 Hz and 2 Hz
one GPU serves with p99 latency <= 100 ms, batched against one-robot-per-request serving of the same model.

Everything runs in one process through the server's own policy engine and scheduler (``PolicyEngine``,
``PolicyPool``), without the WebSocket: the measured latency is from an observation handed to the scheduler to
its actions back on the event loop. Each simulated robot ticks at its control rate with a random phase; at a tick
it sends an observation (two 224x224 uint8 cameras, an 8-value state, a prompt) unless its previous one is still
unanswered, in which case the tick is counted as missed (the robot keeps executing its last action chunk). A level
serves its robots when the p99 latency is at most ``--slo-ms``.

- batched: the scheduler batches every waiting observation, earliest deadline first, up to ``--max-batch``;
- per request (openpi's serving): the same scheduler and model limited to a batch of one, so robots are served one
  at a time, as openpi's ``WebsocketPolicyServer`` does.

Needs torch and transformers. Run from the repository root:

    PYTHONPATH=. python benchmarks/robot_gpu.py --out robot_gpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnigate.engines.policy.engine import PolicyEngine
from omnigate.engines.policy.model import Pi0Dims
from omnigate.engines.policy.pool import PolicyPool, PolicyReply
from omnigate.engines.policy.spec import Observation, PolicyStream


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON report to write")
    parser.add_argument("--model", default="preset:pi0")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cameras", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--slo-ms", type=float, default=100.0)
    parser.add_argument("--level-s", type=float, default=2.5, help="measured seconds per level (after 0.5 s warm-up)")
    parser.add_argument("--rates", default="10,2", help="control rates (Hz) to find capacity at (empty: none)")
    parser.add_argument("--fused", default="on", help="on: the merged-weight layers; off: the reference layers")
    parser.add_argument(
        "--state-cache", default="on", help="on: the state token's keys and values cached; off: recomputed per step"
    )
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak for MFU (H200 SXM)")
    parser.add_argument("--robots", default="1,2,3,4,6,8,12,16,24,32,48,64,96,128", help="robot counts, in order")
    parser.add_argument("--single", type=int, default=60, help="sequential one-robot observations")
    parser.add_argument(
        "--per-request-robots", default="1,2,3,4,6,8", help="robot counts served one per request (empty: none)"
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def make_observation(info: Any, seed: int) -> Observation:
    rng = np.random.default_rng(seed)
    size = info.image_size
    return Observation(
        images=[rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in info.image_keys],
        state=rng.standard_normal(info.state_dim).astype(np.float32),
        prompt="pick up the red block and put it in the bowl",
    )


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def flops_per_inference(dims: Pi0Dims) -> float:
    """Matmul FLOPs of one inference (2 per multiply-add; attention scores included), from the shapes."""
    vision, backbone, expert = dims.vision, dims.backbone, dims.expert
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    v_w, v_ff, v_layers = vision["hidden_size"], vision["intermediate_size"], vision["num_hidden_layers"]
    vision_flops = dims.cameras * patches * v_layers * 2 * (4 * v_w * v_w + 2 * v_w * v_ff + 2 * patches * v_w)

    def gemma_flops(cfg: dict[str, Any], tokens: int, context: int) -> float:
        w, ff, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
        q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
        per_token = 2 * (w * q + 2 * w * kv + q * w + 3 * w * ff) + 4 * context * q
        return float(cfg["num_hidden_layers"] * tokens * per_token)

    prefix = dims.cameras * patches + dims.max_prompt_tokens
    suffix = 1 + dims.action_horizon
    return (
        vision_flops
        + gemma_flops(backbone, prefix, prefix)
        + dims.flow_steps * gemma_flops(expert, suffix, prefix + suffix)
    )


def time_steps(
    engine: PolicyEngine, observation: Observation, batches: list[int], reps: int, peak_flops: float
) -> dict[str, Any]:
    """Back-to-back engine steps per batch size: p50, the throughput it gives and the MFU against ``peak_flops``."""
    flops = flops_per_inference(engine.dims)
    out: dict[str, Any] = {}
    for batch in batches:
        streams = [PolicyStream() for _ in range(batch)]
        for stream in streams:
            stream.observation = observation
        engine.step(streams)
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            engine.step(streams)
            times.append((time.perf_counter() - started) * 1000.0)
        p50 = percentile(times, 50) or 0.0
        out[str(batch)] = {
            "p50_ms": p50,
            "p99_ms": percentile(times, 99),
            "observations_per_s": batch * 1000 / p50,
            "mfu": batch * flops / (p50 / 1000) / peak_flops,
        }
    return out


class Robot:
    """One simulated robot: ticks at its rate, one observation in flight at most."""

    def __init__(self) -> None:
        self.sent_at = 0.0
        self.busy = False
        self.latencies_ms: list[float] = []
        self.ticks = 0
        self.missed = 0
        self.errors = 0
        self.measuring = False
        self.replied = asyncio.Event()

    def on_reply(self, reply: PolicyReply) -> None:
        if reply.result is None:
            self.errors += 1
        elif self.measuring:
            self.latencies_ms.append((time.perf_counter() - self.sent_at) * 1000.0)
        self.busy = False
        self.replied.set()


async def run_level(
    engine: PolicyEngine,
    observation: Observation,
    robots: int,
    rate_hz: float,
    max_batch: int,
    level_s: float,
    seed: int,
) -> dict[str, Any]:
    pool = PolicyPool(engine, max_batch=max_batch)
    pool.start()
    rng = random.Random(seed)
    period = 1.0 / rate_hz
    fleet = [Robot() for _ in range(robots)]
    sessions = [pool.open(robot.on_reply, rate_hz=rate_hz) for robot in fleet]
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05
    warm_until, stop_at = start + 0.5, start + 0.5 + level_s

    async def drive(robot: Robot, session: Any) -> None:
        tick = start + rng.random() * period
        while tick < stop_at:
            await asyncio.sleep(max(0.0, tick - loop.time()))
            measuring = loop.time() >= warm_until
            robot.measuring = measuring
            if robot.busy:
                if measuring:
                    robot.missed += 1
            else:
                robot.busy = True
                robot.sent_at = time.perf_counter()
                pool.submit(session, observation)
            if measuring:
                robot.ticks += 1
            tick += period

    try:
        await asyncio.gather(*(drive(r, s) for r, s in zip(fleet, sessions, strict=True)))
        await asyncio.sleep(0.3)  # answers to the last ticks
    finally:
        for session in sessions:
            pool.close(session)
        await asyncio.to_thread(_stop_scheduler, pool)
    latencies = [x for robot in fleet for x in robot.latencies_ms]
    ticks = sum(r.ticks for r in fleet)
    return {
        "robots": robots,
        "rate_hz": rate_hz,
        "max_batch": max_batch,
        "observations": len(latencies),
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "max_ms": max(latencies, default=None),
        "missed_ticks": sum(r.missed for r in fleet),
        "missed_fraction": sum(r.missed for r in fleet) / ticks if ticks else None,
        "errors": sum(r.errors for r in fleet),
        "mean_batch": None if pool.steps == 0 else pool.observations_total / pool.steps,
    }


def _stop_scheduler(pool: PolicyPool) -> None:
    pool.stop(shutdown_engine=False)  # the engine is shared by every level


async def capacity(
    engine: PolicyEngine,
    observation: Observation,
    rate_hz: float,
    max_batch: int,
    counts: list[int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The largest robot count of ``counts`` (tried in order, up to the first failure) with p99 <= the SLO."""
    levels, served = [], 0
    for robots in counts:
        level = await run_level(engine, observation, robots, rate_hz, max_batch, args.level_s, args.seed + robots)
        level["passed"] = level["p99_ms"] is not None and level["p99_ms"] <= args.slo_ms and level["errors"] == 0
        levels.append(level)
        print(json.dumps(level), file=sys.stderr, flush=True)
        if not level["passed"]:
            break
        served = robots
    return {"robots_served": served, "levels": levels}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    engine = PolicyEngine.load(
        args.model,
        device=args.device,
        dtype=args.dtype,
        cameras=str(args.cameras),
        max_batch=str(args.max_batch),
        seed=str(args.seed),
        fused=args.fused,
        state_cache=args.state_cache,
    )
    load_s = time.perf_counter() - started
    info = engine.info
    observation = make_observation(info, args.seed)
    report: dict[str, Any] = {
        "model": info.model,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "cameras": args.cameras,
        "parameters": sum(p.numel() for p in engine.policy.parameters()),
        "gflops_per_inference": flops_per_inference(engine.dims) / 1e9,
        "action_horizon": info.action_horizon,
        "flow_steps": info.flow_steps,
        "fused": engine.fused,
        "state_cache": engine.state_cache,
        "kernels": os.environ.get("OMNIGATE_KERNELS", "triton on CUDA"),
        "mfu_peak_tflops": args.peak_tflops,
        "load_and_capture_s": load_s,
        "graph_batches": list(engine.graph_batches),
        "slo_p99_ms": args.slo_ms,
    }
    print(json.dumps(report), file=sys.stderr, flush=True)
    batches = sorted({1, 2, 4, 8, 16, 32, args.max_batch})
    report["step_by_batch"] = time_steps(
        engine, observation, [b for b in batches if b <= args.max_batch], 8, args.peak_tflops * 1e12
    )
    print(json.dumps(report["step_by_batch"]), file=sys.stderr, flush=True)

    # One robot, observation after observation, through the scheduler.
    single = Robot()
    single.measuring = True
    pool = PolicyPool(engine)
    pool.start()
    session = pool.open(single.on_reply)
    for _ in range(args.single):
        single.busy, single.sent_at = True, time.perf_counter()
        single.replied.clear()
        pool.submit(session, observation)
        await single.replied.wait()
    pool.close(session)
    await asyncio.to_thread(_stop_scheduler, pool)
    report["one_robot"] = {
        "observations": len(single.latencies_ms),
        "p50_ms": percentile(single.latencies_ms[5:], 50),
        "p99_ms": percentile(single.latencies_ms[5:], 99),
    }
    print(json.dumps(report["one_robot"]), file=sys.stderr, flush=True)

    counts = [int(x) for x in args.robots.split(",")]
    report["batched"], report["per_request"] = {}, {}
    for rate in (float(x) for x in args.rates.split(",") if x):
        report["batched"][f"{rate:g}"] = await capacity(engine, observation, rate, args.max_batch, counts, args)
        per_request_counts = [int(x) for x in args.per_request_robots.split(",") if x]
        if per_request_counts:
            report["per_request"][f"{rate:g}"] = await capacity(engine, observation, rate, 1, per_request_counts, args)
    one_p50 = report["one_robot"]["p50_ms"]
    steps = report["step_by_batch"]
    report["targets"] = {
        "one_robot_p50_le_20_ms": one_p50 is not None and one_p50 <= 20.0,
        "step_batch_8_le_2x_batch_1": "8" in steps and steps["8"]["p50_ms"] <= 2 * steps["1"]["p50_ms"],
        "robots_at_10_hz_ge_16": report["batched"].get("10", {}).get("robots_served", 0) >= 16,
        "robots_at_2_hz_ge_64": report["batched"].get("2", {}).get("robots_served", 0) >= 64,
    }
    report["total_s"] = time.perf_counter() - started
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(main_async(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("one_robot", "targets", "total_s")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
