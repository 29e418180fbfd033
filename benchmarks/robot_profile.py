"""Where a pi0 policy step goes on one GPU: the vision tower, the backbone's prefix pass and the action expert's
denoising loop, each captured as a CUDA graph and timed by replay, per batch size, for the reference layers and the
fused ones; the fused path's error against the reference; and a kernel census of one eager step of each.

Needs torch and transformers and a GPU. Run from the repository root:

    PYTHONPATH=. python benchmarks/robot_profile.py --out robot_profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.robot_gpu import flops_per_inference
from omnigate.engines.policy.model import Pi0Policy, build_random, pi0_dims


def inputs(policy: Pi0Policy, batch: int, seed: int) -> dict[str, torch.Tensor]:
    dims, device = policy.dims, torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(seed)
    size = int(dims.vision["image_size"])
    mask = torch.zeros(batch, dims.max_prompt_tokens, dtype=torch.bool, device=device)
    for i in range(batch):
        mask[i, : 12 + (7 * i) % (dims.max_prompt_tokens - 12)] = True  # prompts of several lengths
    return {
        "images": torch.rand(batch, dims.cameras, 3, size, size, device=device, generator=g).bfloat16() * 2 - 1,
        "tokens": torch.randint(3, 259, (batch, dims.max_prompt_tokens), device=device, generator=g),
        "mask": mask,
        "state": torch.randn(batch, dims.max_state_dim, device=device, generator=g).bfloat16(),
        "noise": torch.randn(batch, dims.action_horizon, dims.max_action_dim, device=device, generator=g).bfloat16(),
    }


def graph_ms(fn: Callable[[], Any], reps: int = 20) -> float:
    """Median replay time of ``fn`` captured as one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2]


def census(policy: Pi0Policy, x: dict[str, torch.Tensor], fused: bool) -> dict[str, Any]:
    """Kernels of one eager step: count, summed kernel time, and the ten largest by total time."""
    run = lambda: policy.sample_actions(x["images"], x["tokens"], x["mask"], x["state"], x["noise"], fused)  # noqa: E731
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total_us = sum(e.self_device_time_total for e in kernels)
    top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:10]
    return {
        "kernels": sum(e.count for e in kernels),
        "kernel_ms": total_us / 1000,
        "top": [{"name": e.key[:90], "count": e.count, "ms": e.self_device_time_total / 1000} for e in top],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", default="1,2,4,8,16,32")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    args = parser.parse_args()
    policy = build_random(pi0_dims(2), torch.device("cuda"), torch.bfloat16, seed=0)
    policy.pack()
    flops = flops_per_inference(policy.dims)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tflop": flops / 1e12}
    with torch.inference_mode():
        x = inputs(policy, 4, seed=1)
        args_ = (x["images"], x["tokens"], x["mask"], x["state"], x["noise"])
        ref = policy.sample_actions(*args_).float()
        fused = policy.sample_actions(*args_, fused=True).float()
        alone = torch.cat([policy.sample_actions(*(a[i : i + 1] for a in args_), fused=True) for i in range(4)])
        report["fused_vs_reference_rel"] = ((fused - ref).norm() / ref.norm()).item()
        report["batched_vs_alone_rel"] = ((fused - alone.float()).norm() / fused.norm()).item()
        print(json.dumps(report), file=sys.stderr, flush=True)
        report["census_batch_1"] = {}
        for name, flag in (("reference", False), ("fused", True)):
            report["census_batch_1"][name] = census(policy, inputs(policy, 1, 2), flag)
            print(json.dumps(report["census_batch_1"][name]), file=sys.stderr, flush=True)
        report["graphs"] = {}
        for batch in (int(b) for b in args.batches.split(",")):
            x = inputs(policy, batch, seed=batch)
            row: dict[str, Any] = {}
            for name, flag in (("reference", False), ("fused", True)):
                images, tokens, mask = x["images"], x["tokens"], x["mask"]
                vision = graph_ms(lambda: policy.embed_prefix(images, tokens, mask, flag))  # noqa: B023
                prefix = graph_ms(lambda: policy.prefix_kv(images, tokens, mask, flag))  # noqa: B023
                full = graph_ms(
                    lambda: policy.sample_actions(images, tokens, mask, x["state"], x["noise"], flag)  # noqa: B023
                )
                row[name] = {
                    "vision_ms": vision,
                    "backbone_ms": prefix - vision,
                    "denoise_ms": full - prefix,
                    "step_ms": full,
                    "mfu": batch * flops / (full / 1000) / (args.peak_tflops * 1e12),
                }
                torch.cuda.empty_cache()
            report["graphs"][str(batch)] = row
            print(batch, json.dumps(row), file=sys.stderr, flush=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'batch':>5} {'path':>9} {'vision':>7} {'backbone':>8} {'denoise':>8} {'step':>7} {'MFU':>5}")
    for batch, row in report["graphs"].items():
        for name, r in row.items():
            print(
                f"{batch:>5} {name:>9} {r['vision_ms']:7.2f} {r['backbone_ms']:8.2f} {r['denoise_ms']:8.2f}"
                f" {r['step_ms']:7.2f} {r['mfu']:5.1%}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
