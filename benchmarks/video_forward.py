"""The chunk-causal transformer forward on a GPU, each way of running it, at a full cache window (832x480 by default).

Ways: the previous code (``--baseline PATH``: a copy of an earlier ``omnigate/engines/video/causal.py``) and the
current code. Each is timed per chunk
(the 5 forwards of 4 flow steps and the cache write, the cache's rotated keys made afresh once per chunk as when
serving), checked against the previous code on fresh inputs (relative L2 error of the flow and of the new keys), and
each gets a kernel census (torch.profiler, device time by kernel). Then the VAE decode of
a chunk with cuDNN's autotuner and channels-last 3D. Run from the repository root:

    PYTHONPATH=. python benchmarks/video_forward.py --out video_forward.json --baseline /path/to/old_causal.py
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from omnigate.engines.video.causal import ChunkKvCache, causal_forward
from omnigate.engines.video.denoise import encode_prompt, to_rgb_frames, vae_latents
from omnigate.engines.video.model import VideoModel, build_preset
from omnigate.engines.video.vae_stream import StreamingVaeDecoder

FORWARDS_PER_CHUNK = 5
Forward = Callable[[torch.Tensor, torch.Tensor, list[ChunkKvCache]], tuple[torch.Tensor, list[Any]]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="wan-1.3b-causal")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--chunk", type=int, default=3)
    parser.add_argument("--cache-frames", type=int, default=12)
    parser.add_argument("--baseline", type=Path, help="a copy of the previous causal.py to compare with")
    parser.add_argument("--batches", default="1,4", help="batch sizes (the first: every variant; others: the best)")
    parser.add_argument("--repeat", type=int, default=3, help="chunks timed per variant")
    parser.add_argument("--no-vae", action="store_true")
    return parser.parse_args(argv)


def load_baseline(path: Path) -> ModuleType:
    """Import a copy of an earlier causal.py under its own name."""
    spec = importlib.util.spec_from_file_location("baseline_causal", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def forwards(model: VideoModel, context: torch.Tensor, baseline: ModuleType | None) -> dict[str, Forward]:
    """Every way of running one forward, by name: "current", and "previous" where a baseline is given."""
    transformer = model.transformer

    def run(module: Any) -> Forward:
        return lambda x, t, caches: module.causal_forward(transformer, x, t, context.expand(x.shape[0], -1, -1), caches)

    ways = {"current": run(sys.modules[causal_forward.__module__])}
    if baseline is not None:
        ways["previous"] = run(baseline)
    return ways


def full_caches(model: VideoModel, args: argparse.Namespace, count: int, latents_shape: tuple[int, ...]) -> Any:
    """``count`` caches holding a full window (each its own tensors, as streams' caches are)."""
    generator = torch.Generator().manual_seed(0)
    context = encode_prompt(model, "a red fox running through deep snow")
    cache = ChunkKvCache(args.cache_frames)
    while cache.frames < args.cache_frames:
        x = torch.randn((1, *latents_shape), generator=generator).to(model.device)
        t = torch.zeros(1, args.chunk, device=model.device)
        _, kv = causal_forward(model.transformer, x, t, context, [cache])
        cache.append(kv, args.chunk)
    caches = [cache]
    for _ in range(count - 1):
        other = ChunkKvCache(args.cache_frames, [(k.clone(), v.clone()) for k, v in cache.layers])
        other.chunk_frames.extend(cache.chunk_frames)
        caches.append(other)
    return caches


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_chunk(forward: Forward, x: torch.Tensor, t: torch.Tensor, caches: list[ChunkKvCache], repeat: int) -> float:
    """Median seconds of a chunk's forwards, each chunk starting with no rotated keys (as after an append)."""
    times = []
    for _ in range(repeat):
        for cache in caches:
            cache.rotated_keys = []
        _sync(x.device)
        start = time.perf_counter()
        for _ in range(FORWARDS_PER_CHUNK):
            forward(x, t, caches)
        _sync(x.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def census(forward: Forward, x: torch.Tensor, t: torch.Tensor, caches: list[ChunkKvCache]) -> dict[str, Any]:
    """Device time of one chunk's forwards by kernel, and by kind (attention, matrix products, the rest)."""
    from torch.profiler import ProfilerActivity, profile

    for cache in caches:
        cache.rotated_keys = []
    activity = ProfilerActivity.CUDA if x.is_cuda else ProfilerActivity.CPU  # the CPU: a dry run of the script
    with profile(activities=[activity]) as prof:
        for _ in range(FORWARDS_PER_CHUNK):
            forward(x, t, caches)
        _sync(x.device)
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA or not x.is_cuda:
            entry = kernels.setdefault(event.name, [0.0, 0])
            entry[0] += (event.device_time_total if x.is_cuda else event.self_cpu_time_total) / 1e3  # ms
            entry[1] += 1
    kinds = {"attention": 0.0, "matmul": 0.0, "elementwise_and_other": 0.0}
    for name, (ms, _) in kernels.items():
        lowered = name.lower()
        if any(word in lowered for word in ("flash", "fmha", "attention", "sdpa", "cudnn_generated")):
            kinds["attention"] += ms
        elif any(word in lowered for word in ("gemm", "nvjet", "cutlass", "xmma", "sm90_")):
            kinds["matmul"] += ms
        else:
            kinds["elementwise_and_other"] += ms
    top = sorted(kernels.items(), key=lambda item: -item[1][0])[:25]
    return {
        "per_forward_ms_by_kind": {kind: ms / FORWARDS_PER_CHUNK for kind, ms in kinds.items()},
        "kernel_launches_per_forward": sum(n for _, n in kernels.values()) / FORWARDS_PER_CHUNK,
        "top_kernels_per_forward": [
            {"name": name[:160], "ms": ms / FORWARDS_PER_CHUNK, "calls": n / FORWARDS_PER_CHUNK}
            for name, (ms, n) in top
        ],
    }


def compare_forwards(model: VideoModel, args: argparse.Namespace, baseline: ModuleType | None) -> dict[str, Any]:
    """Time, check and census the ways of running a forward."""
    scale = model.spatial_scale
    shape = (model.latent_channels, args.chunk, args.height // scale, args.width // scale)
    context = encode_prompt(model, "a red fox running through deep snow")
    ways = forwards(model, context, baseline)
    batches = [int(b) for b in str(args.batches).split(",")]
    caches = full_caches(model, args, max(batches), shape)
    generator = torch.Generator().manual_seed(1)
    report: dict[str, Any] = {"chunk_s": {}, "relative_error_to_previous": {}, "census": {}}
    for batch in batches:
        x = torch.randn((batch, *shape), generator=generator).to(model.device)
        t = torch.full((batch, args.chunk), 750.0, device=model.device)
        for name, forward in ways.items():
            time_chunk(forward, x, t, caches[:batch], 1)  # warm-up: autotunes, allocates
            chunk = time_chunk(forward, x, t, caches[:batch], args.repeat)
            report["chunk_s"][f"{name}@{batch}"] = chunk
            print(f"batch {batch} {name}: {chunk / FORWARDS_PER_CHUNK * 1e3:.1f} ms per forward", flush=True)
    if "previous" in ways:
        report["relative_error_to_previous"] = check(ways, model, shape, caches[:2], generator)
    x = torch.randn((1, *shape), generator=generator).to(model.device)
    t = torch.full((1, args.chunk), 750.0, device=model.device)
    for name, forward in ways.items():
        report["census"][name] = census(forward, x, t, caches[:1])
    return report


def check(
    ways: dict[str, Forward], model: VideoModel, shape: tuple[int, ...], caches: list[ChunkKvCache], generator: Any
) -> dict[str, Any]:
    """The current forward against the previous one on fresh inputs (two streams' caches, rotated keys made
    afresh): relative L2 error of the flow and of every layer's new keys and values (the worst layer)."""
    for cache in caches:
        cache.rotated_keys = []
    x = torch.randn((len(caches), *shape), generator=generator).to(model.device)
    t = torch.full((len(caches), shape[1]), 500.0, device=model.device)
    ref_out, ref_kv = ways["previous"](x, t, caches)
    out, kv = ways["current"](x, t, caches)
    return {
        "flow": relative_error(out, ref_out),
        "keys": max(relative_error(k, rk) for (k, _), (rk, _) in zip(kv, ref_kv, strict=True)),
        "values": max(relative_error(v, rv) for (_, v), (_, rv) in zip(kv, ref_kv, strict=True)),
        "finite": bool(torch.isfinite(out).all()),
    }


def compare_vae(model: VideoModel, args: argparse.Namespace) -> dict[str, Any]:
    """A later chunk's VAE decode (3 latent frames to 12 RGB frames): default, with cuDNN's autotuner, and with
    channels-last 3D weights and inputs as well."""
    scale = model.spatial_scale
    generator = torch.Generator().manual_seed(2)
    chunks = [
        torch.randn(
            (1, model.latent_channels, args.chunk, args.height // scale, args.width // scale), generator=generator
        )
        for _ in range(6)
    ]
    report: dict[str, Any] = {"chunk_s": {}, "relative_error": {}}
    reference: list[torch.Tensor] = []
    for name in ("default", "cudnn_benchmark", "cudnn_benchmark+channels_last"):
        torch.backends.cudnn.benchmark = name != "default"
        vae = model.vae if name != "cudnn_benchmark+channels_last" else copy.deepcopy(model.vae)
        if name.endswith("channels_last"):
            for param in vae.parameters():
                if param.dim() in (4, 5):
                    layout = torch.channels_last_3d if param.dim() == 5 else torch.channels_last
                    param.data = param.data.contiguous(memory_format=layout)
        decoder = StreamingVaeDecoder(vae)
        outputs, times = [], []
        for index, chunk in enumerate(chunks):
            latents = vae_latents(model, chunk.to(model.device)).to(vae.dtype)
            if name.endswith("channels_last"):
                latents = latents.contiguous(memory_format=torch.channels_last_3d)
            _sync(model.device)
            start = time.perf_counter()
            video = decoder.decode(latents)
            to_rgb_frames(video)
            _sync(model.device)
            if index >= 2:  # the first chunk is shorter, the second autotunes
                times.append(time.perf_counter() - start)
            outputs.append(video.float())
        decoder.close()
        report["chunk_s"][name] = statistics.median(times)
        if not reference:
            reference = outputs
        report["relative_error"][name] = max(relative_error(o, r) for o, r in zip(outputs, reference, strict=True))
        print(f"vae {name}: {report['chunk_s'][name] * 1e3:.0f} ms per chunk", flush=True)
    torch.backends.cudnn.benchmark = False
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = build_preset(args.preset, device=args.device, dtype=args.dtype, vae_dtype=args.dtype)
    baseline = load_baseline(args.baseline) if args.baseline else None
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else None
    report: dict[str, Any] = {"torch": torch.__version__, "gpu": gpu, "args": vars(args)}
    with torch.inference_mode():
        report["forward"] = compare_forwards(model, args, baseline)
        args.out.write_text(json.dumps(report, indent=1, default=str))
        if not args.no_vae:
            report["vae"] = compare_vae(model, args)
    args.out.write_text(json.dumps(report, indent=1, default=str))
    forward = report["forward"]
    for name, seconds in forward["chunk_s"].items():
        print(f"{name:>12}: {seconds / FORWARDS_PER_CHUNK * 1e3:7.1f} ms/forward")
    print("current against previous:", json.dumps(forward["relative_error_to_previous"]))
    for name, found in forward["census"].items():
        print(name, json.dumps(found["per_forward_ms_by_kind"]), found["kernel_launches_per_forward"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
