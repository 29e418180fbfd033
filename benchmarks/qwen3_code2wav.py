"""The streaming Qwen3-Omni Code2Wav's cost against one full decode and against ``chunked_decode``, same codes.

For each dtype and each batch of ``B`` rows, ``--frames`` random codec frames per row are decoded three ways:

- ``full``: one ``Code2Wav.forward`` over all frames of all rows (the reference, and the cost floor of exact audio);
- ``chunked``: transformers' ``Code2Wav.chunked_decode`` (chunks of ``--hf-chunk`` frames, 25 frames of left context
  re-decoded per chunk), batched over the same rows;
- ``stream``: :class:`Code2WavStream`, pushing chunks of ``C`` frames (each of ``--chunks``) for all rows at once;
  on CUDA both ``eager`` (kernels launched from Python) and ``graphs`` (each push shape replayed from a CUDA graph).

Times are medians over ``--repeats`` after a warm-up, with the device synchronized. ``stream_over_full`` is the
target ratio (<= 1.1). Each streamed result is checked against the full decode (``rel_err``: the norm of the
difference over the norm of the full decode, after the stream's leading ``delay_samples`` zeros). One push per
setting is also timed on the host alone (``push_host_ms``: Python and kernel launches, no synchronization) and its
device kernels counted, which says whether small pushes are bound by launches.

CPU, tiny config (seconds)::

    python -m benchmarks.qwen3_code2wav --preset tiny --rows 1,4 --chunks 1,5,25 --frames 50 \\
        --out docs/benchmarks/qwen3_code2wav_cpu.json

H200, the released Qwen3-Omni-30B-A3B Code2Wav shapes (random weights)::

    python -m benchmarks.qwen3_code2wav --preset released --device cuda --dtypes float32,bfloat16 \\
        --rows 1,8,64 --chunks 1,5,25 --frames 50 --out $OUT/qwen3_code2wav_gpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from omnigate.engines.qwen3_omni.code2wav_stream import Code2WavStream

# The released checkpoint's code2wav_config equals the config class defaults (8 layers, 1024 wide, 16 heads,
# window 72, 16 quantizers of 2048, upsampling 2x2 then 8x5x4x3, decoder 1536 wide).
PRESETS: dict[str, dict[str, Any]] = {
    "released": {},
    "tiny": {
        "codebook_size": 64,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_quantizers": 4,
        "decoder_dim": 64,
    },
}


def build(preset: str, device: str, dtype: torch.dtype) -> Any:
    torch.manual_seed(0)
    config = Qwen3OmniMoeCode2WavConfig(**PRESETS[preset])
    with torch.device(device):
        model = Qwen3OmniMoeCode2Wav(config)
    return model.eval().to(dtype)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str, repeats: int) -> tuple[float, Any]:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up, and its last result."""
    result = fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def stream_all(stream: Code2WavStream, codes: torch.Tensor, chunk: int) -> torch.Tensor:
    rows = [stream.open() for _ in range(codes.shape[0])]
    pieces = [stream.push(rows, codes[..., t : t + chunk]) for t in range(0, codes.shape[-1], chunk)]
    for row in rows:
        stream.close(row)
    return torch.cat(pieces, dim=-1)


def push_profile(stream: Code2WavStream, codes: torch.Tensor, device: str) -> dict[str, float]:
    """One push on rows already past their first frames: host time alone, device kernels counted."""
    rows = [stream.open() for _ in range(codes.shape[0])]
    stream.push(rows, codes)
    sync(device)
    start = time.perf_counter()
    stream.push(rows, codes)
    host = time.perf_counter() - start
    sync(device)
    kernels = 0
    if device == "cuda":
        activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            stream.push(rows, codes)
            sync(device)
        kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    for row in rows:
        stream.close(row)
    return {"push_host_ms": host * 1e3, "push_kernels": kernels}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (got.double() - ref.double()).norm()
    return float(diff / ref.double().norm().clamp_min(1e-30))


def exactness(model: Any, streams: dict[str, Code2WavStream], rows: int, frames: int) -> dict[str, Any]:
    """Each mode's stream (pushes of 1, 2, 3, ... frames) against the full decode with TF32 off: true float32 on
    CUDA, where cuDNN's convolutions otherwise run in TF32 (~1e-3 apart between any two ways of splitting them)."""
    config = model.config
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, config.codebook_size, (rows, config.num_quantizers, frames), generator=gen)
    sizes, total = [], 0
    while total < frames:
        sizes.append(min(len(sizes) + 1, frames - total))
        total += sizes[-1]
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        device = next(model.parameters()).device
        full = model(codes.to(device))[:, 0]
        out: dict[str, Any] = {"rows": rows, "pushes": sizes, "full_peak": float(full.abs().max())}
        for mode, stream in streams.items():
            ids = [stream.open() for _ in range(rows)]
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            got = torch.cat([stream.push(ids, codes[..., a : a + n]) for a, n in zip(starts, sizes, strict=True)], -1)
            for row in ids:
                stream.close(row)
            diff = got[:, stream.delay_samples :].double() - full.double()
            out[mode] = {"max_abs": float(diff.abs().max()), "rel_err": rel_err(got[:, stream.delay_samples :], full)}
        return out
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@torch.inference_mode()
def run_dtype(args: argparse.Namespace, out: dict[str, Any], save: Callable[[], None]) -> None:
    """Fill ``out`` (``{"dtype": name}``) with the batches measured in that dtype, saving after each."""
    dtype_name = out["dtype"]
    dtype = getattr(torch, dtype_name)
    model = build(args.preset, args.device, dtype)
    modes = ["eager", "graphs"] if args.device == "cuda" else ["eager"]
    streams = {
        mode: Code2WavStream(model, max(args.rows), args.device, dtype, max_frames=args.frames, graphs=mode == "graphs")
        for mode in modes
    }
    stream = streams["eager"]
    if dtype == torch.float32:
        out["exact_tf32_off"] = exactness(model, streams, min(4, max(args.rows)), 20)
        print(json.dumps({"exact_tf32_off": out["exact_tf32_off"]}), flush=True)
    config = model.config
    gen = torch.Generator().manual_seed(1)
    out.update(bytes_per_row=stream.bytes_per_row, samples_per_frame=stream.samples_per_frame, batches=[])
    out["delay_samples"] = stream.delay_samples
    for rows in args.rows:
        codes = torch.randint(0, config.codebook_size, (rows, config.num_quantizers, args.frames), generator=gen)
        # The stream gets the codes on the host, as an engine holds its talker's sampled codes; the full and chunked
        # decodes get them on the device.
        host_codes, codes = codes, codes.to(args.device)
        audio_s = rows * args.frames * stream.samples_per_frame / 24000
        full_s, full = timed(lambda codes=codes: model(codes), args.device, args.repeats)
        chunked_s, chunked = timed(
            lambda codes=codes: model.chunked_decode(codes, chunk_size=args.hf_chunk, left_context_size=25),
            args.device,
            args.repeats,
        )
        full = full[:, 0]
        entry: dict[str, Any] = {
            "rows": rows,
            "frames": args.frames,
            "audio_s": audio_s,
            "full_ms": full_s * 1e3,
            "full_rtf": full_s / audio_s,
            "chunked_decode": {
                "chunk": args.hf_chunk,
                "ms": chunked_s * 1e3,
                "over_full": chunked_s / full_s,
                # Its chunk boundaries drop delay_samples each: compare the first chunk, where it is a full forward.
                "samples": int(chunked.shape[-1]),
            },
            "stream": [],
        }
        for mode, chunk in ((mode, chunk) for mode in modes for chunk in args.chunks):
            stream = streams[mode]
            stream_s, streamed = timed(
                lambda c=chunk, s=stream, codes=host_codes: stream_all(s, codes, c), args.device, args.repeats
            )
            profile = push_profile(stream, host_codes[..., :chunk], args.device)
            entry["stream"].append(
                {
                    "mode": mode,
                    "chunk": chunk,
                    "ms": stream_s * 1e3,
                    "ms_per_push": stream_s * 1e3 / -(-args.frames // chunk),
                    "stream_over_full": stream_s / full_s,
                    "stream_over_chunked": stream_s / chunked_s,
                    "rel_err": rel_err(streamed[:, stream.delay_samples :], full),
                    **profile,
                }
            )
        out["batches"].append(entry)
        save()
        print(json.dumps({"dtype": dtype_name, **{k: v for k, v in entry.items() if k != "stream"}}), flush=True)
        for s in entry["stream"]:
            print("   ", json.dumps(s), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--rows", default="1,4", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--chunks", default="1,5,25", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--frames", type=int, default=50)
    parser.add_argument("--hf-chunk", type=int, default=25, help="chunked_decode's chunk size (vllm-omni uses 25)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.qwen3_code2wav", *(argv if argv is not None else sys.argv[1:])]),
        "preset": args.preset,
        "config": PRESETS[args.preset] or "Qwen3OmniMoeCode2WavConfig defaults (the released shapes)",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "results": [],
    }

    def save() -> None:
        # Rewritten after every batch, so a run cut short keeps what it measured.
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    for name in args.dtypes.split(","):
        report["results"].append({"dtype": name})
        run_dtype(args, report["results"][-1], save)
    print("dtype     mode   rows chunk  full_ms  stream_ms  stream/full  chunked/full  push_host_ms  kernels  rel_err")
    for result in report["results"]:
        for entry in result["batches"]:
            for s in entry["stream"]:
                print(
                    f"{result['dtype']:9} {s['mode']:6} {entry['rows']:4} {s['chunk']:5}"
                    f" {entry['full_ms']:8.1f} {s['ms']:10.1f}"
                    f" {s['stream_over_full']:12.2f} {entry['chunked_decode']['over_full']:13.2f}"
                    f" {s['push_host_ms']:13.2f} {s['push_kernels']:8} {s['rel_err']:.1e}"
                )


if __name__ == "__main__":
    main()
