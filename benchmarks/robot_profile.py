"""Where a pi0 policy step goes on one GPU: the vision tower, the backbone's prefix pass and the action expert's
denoising loop, each captured as a CUDA graph and timed by replay, per batch size. The vision tower and the backbone
run the fused layers; the denoising loop runs each of:

- ``fused``: the fused layers with the state token recomputed at every flow step under one bool mask, torch ops only
  (``OMNIGATE_KERNELS=reference``): the step before the state cache;
- ``cached-sdpa``: the state token's keys and values cached, the action tokens' attention through SDPA's
  memory-efficient kernel with an additive key mask, torch ops only;
- ``cached``: the same with the Triton kernels (RoPE and cache write in one kernel, the split-KV attention,
  ``gelu_tanh(gate) * up``): the engine's default.

Also: each path's error against the reference layers (bf16, batch 4, prompts of several lengths), the Triton
kernels' error against their references, the expert's attention alone on each implementation, and a kernel census of
one eager step. Needs torch, transformers, Triton and a GPU. Run from the repository root:

    PYTHONPATH=. python benchmarks/robot_profile.py --out robot_profile.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from benchmarks.robot_gpu import flops_per_inference
from omnigate.engines.policy.model import Pi0Dims, Pi0Policy, build_random, pi0_dims, tiny_dims
from omnigate.kernels import triton_policy_kernels
from omnigate.kernels.gelu_mul import gelu_tanh_mul_reference
from omnigate.kernels.prefix_attention import key_bias, prefix_attention_reference

# name: (state_cache, Triton kernels)
PATHS = {"fused": (False, False), "cached-sdpa": (True, False), "cached": (True, True)}


@contextlib.contextmanager
def kernels(triton: bool) -> Iterator[None]:
    """The Triton kernels on (the default on CUDA) or the torch references (``OMNIGATE_KERNELS=reference``)."""
    before = os.environ.get("OMNIGATE_KERNELS")
    os.environ["OMNIGATE_KERNELS"] = "triton" if triton else "reference"
    try:
        yield
    finally:
        if before is None:
            del os.environ["OMNIGATE_KERNELS"]
        else:
            os.environ["OMNIGATE_KERNELS"] = before


def inputs(policy: Pi0Policy, batch: int, seed: int) -> dict[str, torch.Tensor]:
    dims = policy.dims
    parameter = next(policy.parameters())
    device, dtype = parameter.device, parameter.dtype
    g = torch.Generator(device=device).manual_seed(seed)
    size = int(dims.vision["image_size"])
    mask = torch.zeros(batch, dims.max_prompt_tokens, dtype=torch.bool, device=device)
    for i in range(batch):
        mask[i, : 12 + (7 * i) % (dims.max_prompt_tokens - 12)] = True  # prompts of several lengths
    return {
        "images": torch.rand(batch, dims.cameras, 3, size, size, device=device, generator=g).to(dtype) * 2 - 1,
        "tokens": torch.randint(3, 259, (batch, dims.max_prompt_tokens), device=device, generator=g),
        "mask": mask,
        "state": torch.randn(batch, dims.max_state_dim, device=device, generator=g).to(dtype),
        "noise": torch.randn(batch, dims.action_horizon, dims.max_action_dim, device=device, generator=g).to(dtype),
    }


def relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def graph_ms(fn: Callable[[], Any], reps: int = 20) -> float:
    """Median replay time of ``fn`` captured as one CUDA graph (on a CPU, for a dry run: its median wall time)."""
    if not torch.cuda.is_available():
        fn()
        wall = []
        for _ in range(reps):
            started = time.perf_counter()
            fn()
            wall.append((time.perf_counter() - started) * 1000)
        return sorted(wall)[len(wall) // 2]
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


def census(policy: Pi0Policy, x: dict[str, torch.Tensor], state_cache: bool) -> dict[str, Any]:
    """Kernels of one eager step: count, summed kernel time, and the ten largest by total time."""
    args = (x["images"], x["tokens"], x["mask"], x["state"], x["noise"])
    run = lambda: policy.sample_actions(*args, fused=True, state_cache=state_cache)  # noqa: E731
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    found = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total_us = sum(e.self_device_time_total for e in found)
    top = sorted(found, key=lambda e: e.self_device_time_total, reverse=True)[:10]
    return {
        "kernels": sum(e.count for e in found),
        "kernel_ms": total_us / 1000,
        "top": [{"name": e.key[:90], "count": e.count, "ms": e.self_device_time_total / 1000} for e in top],
    }


def expert_shapes(dims: Pi0Dims) -> tuple[int, int, int, int]:
    """The expert's attention: query heads, head size, prefix length, suffix length (the state token and actions)."""
    patches = (int(dims.vision["image_size"]) // int(dims.vision["patch_size"])) ** 2
    prefix = dims.cameras * patches + dims.max_prompt_tokens
    return int(dims.expert["num_attention_heads"]), int(dims.expert["head_dim"]), prefix, 1 + dims.action_horizon


def kernel_checks(dims: Pi0Dims, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The Triton kernels against their references on fresh random inputs (float32 references), the expert's
    shapes: the action tokens' heads over the whole cache, and the state token's over the prefix and itself."""
    heads, dim, prefix, suffix = expert_shapes(dims)
    g = torch.Generator(device=device).manual_seed(11)
    out: dict[str, Any] = {}
    for name, (batch, tokens, keys_n) in {
        "actions_b1": (1, suffix - 1, prefix + suffix),
        "actions_b8": (8, suffix - 1, prefix + suffix),
        "state_b4": (4, 1, prefix + 1),
    }.items():
        q = torch.randn(batch, tokens, heads + 2, dim, device=device, generator=g).to(dtype)[:, :, :heads]
        k = torch.randn(batch, keys_n, dim, device=device, generator=g).to(dtype)
        v = torch.randn(batch, keys_n, dim, device=device, generator=g).to(dtype)
        valid = torch.rand(batch, prefix, device=device, generator=g) > 0.05
        valid[:, 0] = True
        bias = key_bias(valid, keys_n - prefix)
        ref = prefix_attention_reference(q.float(), k.float(), v.float(), bias)
        got = triton_policy_kernels.prefix_attention(q, k, v, bias)
        sdpa = prefix_attention_reference(q, k, v, bias)
        out[name] = {"triton_rel": relative(got, ref), "sdpa_rel": relative(sdpa, ref),
                     "triton_max_abs": (got.float() - ref).abs().max().item()}  # fmt: skip
    gate_up = torch.randn(suffix, 2 * int(dims.expert["intermediate_size"]), device=device, generator=g).to(dtype) * 3
    out["gelu_tanh_mul_max_abs"] = (
        (triton_policy_kernels.gelu_tanh_mul(gate_up).float() - gelu_tanh_mul_reference(gate_up).float()).abs().max()
    ).item()
    return out


def per_call_us(call: Callable[[], Any]) -> float:
    """Microseconds per call of ``call``, 20 calls captured in one graph."""
    return graph_ms(lambda: [call() for _ in range(20)]) * 50


def attention_timings(dims: Pi0Dims, device: torch.device, dtype: torch.dtype, batches: list[int]) -> dict[str, Any]:
    """The expert's attention alone (us per call): the masked call the fused layers make over the state token and the
    actions (on CUDA cuDNN picks it), SDPA's memory-efficient kernel with the additive key mask over the actions, and
    the Triton kernel's block shapes."""
    heads, dim, prefix, suffix = expert_shapes(dims)
    total = prefix + suffix
    out: dict[str, Any] = {}
    for batch in batches:
        q = torch.randn(batch, suffix - 1, heads + 2, dim, device=device).to(dtype)[:, :, :heads]
        k = torch.randn(batch, total, dim, device=device).to(dtype)
        v = torch.randn_like(k)
        bias = key_bias(torch.ones(batch, prefix, dtype=torch.bool, device=device), suffix)
        folded = torch.randn(batch, 1, suffix * heads, dim, device=device).to(dtype)
        mask = torch.ones(batch, 1, suffix * heads, total, dtype=torch.bool, device=device)
        mask[:, :, :heads, prefix + 1 :] = False
        masked = functools.partial(F.scaled_dot_product_attention, folded, k[:, None], v[:, None], attn_mask=mask)
        row = {
            "masked_51_tokens": per_call_us(masked),
            "sdpa_efficient": per_call_us(functools.partial(prefix_attention_reference, q, k, v, bias)),
        }
        for bm, bn, warps in ((64, 64, 8), (64, 64, 4), (32, 64, 4), (64, 32, 4), (128, 64, 8)):
            name = f"triton_{bm}x{bn}_w{warps}"
            try:
                row[name] = per_call_us(
                    functools.partial(triton_policy_kernels.prefix_attention, q, k, v, bias, bm, bn, warps)
                )
            except Exception as exc:  # a block shape that does not fit is reported, not fatal
                row[name] = float("nan")
                print(f"{name}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
        out[str(batch)] = row
        print("attention", batch, json.dumps(row), file=sys.stderr, flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", default="1,2,4,8,16,32")
    parser.add_argument("--attention-batches", default="1,8,32", help="batches to time the expert's attention at")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--preset", default="pi0", choices=("pi0", "tiny"), help="tiny: a dry run on a CPU")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    device, dtype = torch.device("cuda" if on_gpu else "cpu"), torch.bfloat16 if on_gpu else torch.float32
    dims = (pi0_dims if args.preset == "pi0" else tiny_dims)(2)
    policy = build_random(dims, device, dtype, seed=0)
    policy.pack()
    flops = flops_per_inference(policy.dims)
    name = torch.cuda.get_device_name() if on_gpu else "cpu"
    report: dict[str, Any] = {"device": name, "torch": torch.__version__, "tflop": flops / 1e12}

    def save() -> None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    with torch.inference_mode():
        report["kernel_checks"] = kernel_checks(dims, device, dtype)
        print(json.dumps(report["kernel_checks"]), file=sys.stderr, flush=True)
        x = inputs(policy, 4, seed=1)
        args_ = (x["images"], x["tokens"], x["mask"], x["state"], x["noise"])
        ref = policy.sample_actions(*args_).float()
        errors: dict[str, float] = {}
        for name, (state_cache, triton) in PATHS.items():
            with kernels(triton):
                out = policy.sample_actions(*args_, fused=True, state_cache=state_cache).float()
                alone = torch.cat(
                    [
                        policy.sample_actions(*(a[i : i + 1] for a in args_), fused=True, state_cache=state_cache)
                        for i in range(4)
                    ]
                )
            errors[f"{name}_vs_reference_rel"] = relative(out, ref)
            errors[f"{name}_batched_vs_alone_rel"] = relative(out, alone.float())
        report["errors"] = errors
        print(json.dumps(errors), file=sys.stderr, flush=True)
        save()
        report["attention_us"] = attention_timings(
            dims, device, dtype, [int(b) for b in args.attention_batches.split(",")]
        )
        save()
        if on_gpu:
            with kernels(True):
                report["census_batch_1_cached"] = census(policy, inputs(policy, 1, 2), state_cache=True)
            print(json.dumps(report["census_batch_1_cached"]), file=sys.stderr, flush=True)
        report["graphs"] = {}
        for batch in (int(b) for b in args.batches.split(",")):
            x = inputs(policy, batch, seed=batch)
            images, tokens, mask = x["images"], x["tokens"], x["mask"]
            reps = 20 if batch <= 8 else 8
            vision = graph_ms(lambda: policy.embed_prefix(images, tokens, mask, True), reps)  # noqa: B023
            prefix_ms = {}
            for triton in (False, True):  # the backbone's MLP activation is one of the Triton kernels
                with kernels(triton):
                    prefix_ms[triton] = graph_ms(lambda: policy.prefix_kv(images, tokens, mask, True), reps)  # noqa: B023
            row: dict[str, Any] = {"vision_ms": vision}
            for name, (state_cache, triton) in PATHS.items():
                prefix = prefix_ms[triton]
                with kernels(triton):
                    full = graph_ms(
                        lambda: policy.sample_actions(images, tokens, mask, x["state"], x["noise"], True, state_cache),  # noqa: B023
                        reps,
                    )
                row[name] = {
                    "backbone_ms": prefix - vision,
                    "denoise_ms": full - prefix,
                    "step_ms": full,
                    "mfu": batch * flops / (full / 1000) / (args.peak_tflops * 1e12),
                }
                if on_gpu:
                    torch.cuda.empty_cache()
            report["graphs"][str(batch)] = row
            print(batch, json.dumps(row), file=sys.stderr, flush=True)
            save()
    print(f"{'batch':>5} {'path':>11} {'vision':>7} {'backbone':>8} {'denoise':>8} {'step':>7} {'MFU':>6}")
    for batch, row in report["graphs"].items():
        for name in PATHS:
            r = row[name]
            print(
                f"{batch:>5} {name:>11} {row['vision_ms']:7.2f} {r['backbone_ms']:8.2f} {r['denoise_ms']:8.2f}"
                f" {r['step_ms']:7.2f} {r['mfu']:6.1%}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
