"""Live chunk-causal video through the real server: first fragment, first client-decoded frame, sustained fps per
stream for several concurrent live streams, prompt change to first chunk with it; then where a chunk's time goes
(transformer forwards by batch size, VAE, H.264 encode, fMP4 mux), and the whole-clip path on the same shapes.
With ``--baseline`` (a copy of an earlier ``causal.py``), that forward is timed beside the served one, checked
against it, and both get a kernel census.

Each level starts N websockets clients together on ``WS /v1/realtime/video`` (``video.create`` with ``live``); each
reads for ``--seconds`` then cancels. Clocks are the client's (``time.perf_counter`` in one process with the server).
Sustained fps per stream = frames of chunks after the first / time from the first chunk's event to the last's.
The first stream of each level sends ``video.prompt`` after its second chunk; the figure is the time from sending
it to the ``video.chunk`` event of the first chunk generated with it. Run from the repository root:

    PYTHONPATH=. python benchmarks/video_live.py --out video_live.json --seconds 62 \
        --baseline old_causal.py                                                            # H200: wan-1.3b-causal
    PYTHONPATH=. python benchmarks/video_live.py --out cpu.json --preset tiny-causal --device cpu --dtype float32 \\
        --vae-dtype float32 --width 64 --height 64 --fps 8 --streams 1,2 --seconds 4 --no-clip
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import io
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import av
import torch
from websockets.asyncio.client import connect

from benchmarks.video_forward import (
    FORWARDS_PER_CHUNK,
    census,
    check,
    forwards,
    full_caches,
    load_baseline,
    time_chunk,
)
from omnigate.codecs.video import FragmentedMp4Writer
from omnigate.engines.video.denoise import encode_prompt, to_rgb_frames, vae_latents
from omnigate.engines.video.live import LiveVideoEngine
from omnigate.engines.video.vae_stream import StreamingVaeDecoder
from omnigate.gateway.settings import Settings
from tests.serving import serve

VIDEO = "/v1/realtime/video"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="wan-1.3b-causal")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--vae-dtype", default="bfloat16")
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--fps", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=3)
    parser.add_argument("--cache-frames", type=int, default=12)
    parser.add_argument("--streams", default="1,2,4,8")
    parser.add_argument("--seconds", type=float, default=12.0, help="per level, from each stream's create")
    parser.add_argument("--no-clip", action="store_true", help="skip the whole-clip comparison")
    parser.add_argument("--no-split", action="store_true", help="skip the per-piece timing (and the whole clip)")
    parser.add_argument(
        "--overlap-decode", action="store_true", help="decode each chunk on a second thread while the next denoises"
    )
    parser.add_argument(
        "--baseline", type=Path, help="a copy of an earlier causal.py: its forward timed beside the served one"
    )
    parser.add_argument("--baseline-batches", default="1,4", help="batch sizes the earlier forward is timed at")
    return parser.parse_args(argv)


def _decode_first(segments: bytes) -> int:
    with av.open(io.BytesIO(segments)) as container:
        return sum(1 for _ in container.decode(video=0))


async def one_stream(url: str, args: argparse.Namespace, seed: int, switch: bool) -> dict[str, Any]:
    create = {
        "type": "video.create",
        "prompt": "a red fox running through deep snow",
        "live": True,
        "width": args.width,
        "height": args.height,
        "fps": args.fps,
        "steps": args.steps,
        "chunk_frames": args.chunk,
        "seed": seed,
    }
    result: dict[str, Any] = {"chunks": []}
    async with connect(url + VIDEO, max_size=None) as ws:
        began = time.perf_counter()
        await ws.send(json.dumps(create))
        deadline = began + args.seconds
        init = b""
        prompt_sent: float | None = None
        cancelled = False
        while True:
            timeout = max(0.01, deadline - time.perf_counter()) if not cancelled else 120.0
            try:
                message = await asyncio.wait_for(ws.recv(), timeout)
            except TimeoutError:
                await ws.send(json.dumps({"type": "video.cancel"}))
                cancelled = True
                continue
            now = time.perf_counter() - began
            if isinstance(message, bytes):
                if not init:
                    init = message
                elif "first_fragment_s" not in result:
                    result["first_fragment_s"] = now
                    frames = await asyncio.to_thread(_decode_first, init + message)
                    result["first_decoded_frame_s"] = time.perf_counter() - began
                    result["first_fragment_frames_decoded"] = frames
                continue
            event = json.loads(message)
            kind = event["type"]
            if kind == "video.chunk":
                result["chunks"].append({"at": now, "frames": event["frames"], "prompt_id": event["prompt_id"]})
                if switch and prompt_sent is None and len(result["chunks"]) == 2:
                    prompt_sent = time.perf_counter() - began
                    await ws.send(json.dumps({"type": "video.prompt", "prompt": "a grey wolf under the moon"}))
                if prompt_sent is not None and event["prompt_id"] == 1 and "prompt_to_chunk_s" not in result:
                    result["prompt_to_chunk_s"] = now - prompt_sent
            elif kind == "video.prompt.updated":
                result["prompt_updated"] = {"at": now - (prompt_sent or 0.0), **event}
            elif kind == "video.done":
                result["done"] = {k: event.get(k) for k in ("status", "frames", "code", "stats")}
                break
            elif kind == "error":
                result["error"] = event
                if not cancelled:
                    break
    chunks = result["chunks"]
    if len(chunks) >= 3:
        span = chunks[-1]["at"] - chunks[0]["at"]
        result["sustained_fps"] = sum(c["frames"] for c in chunks[1:]) / span
    return result


async def level(url: str, args: argparse.Namespace, streams: int) -> dict[str, Any]:
    results = await asyncio.gather(*(one_stream(url, args, 100 + i, i == 0) for i in range(streams)))
    fps = [r["sustained_fps"] for r in results if "sustained_fps" in r]
    return {
        "streams": streams,
        "first_fragment_s": [r.get("first_fragment_s") for r in results],
        "first_decoded_frame_s": [r.get("first_decoded_frame_s") for r in results],
        "sustained_fps_per_stream": fps,
        "sustained_fps_min": min(fps) if fps else None,
        "sustained_fps_median": statistics.median(fps) if fps else None,
        "prompt_to_chunk_s": results[0].get("prompt_to_chunk_s"),
        "chunks_per_stream": [len(r["chunks"]) for r in results],
        "errors": [r["error"] for r in results if "error" in r],
        "streams_detail": results,
    }


def _timed(device: torch.device, fn: Any, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def split(engine: LiveVideoEngine, args: argparse.Namespace, batches: list[int]) -> dict[str, Any]:
    """Where a chunk's time goes, measured piece by piece on the server's model (idle by then)."""
    model = engine.model
    device = model.device
    scale = model.spatial_scale
    shape = (model.latent_channels, args.chunk, args.height // scale, args.width // scale)
    context = encode_prompt(model, "a red fox running through deep snow")
    generator = torch.Generator().manual_seed(0)

    # Per forward: a chunk's 5 forwards timed together, each stream's cache its own with its past keys rotated
    # afresh once per chunk, as when serving; the served forward, and the earlier code's where it is given (then
    # also checked against it, and both get a kernel census at one stream).
    ways = forwards(model, context, load_baseline(args.baseline) if args.baseline else None)
    served = "current"
    caches = full_caches(model, args, max(batches), shape)
    transformer: dict[str, float] = {}
    previous: dict[str, float] = {}
    previous_batches = [int(b) for b in args.baseline_batches.split(",")] if args.baseline else []
    for batch in batches:
        latents = torch.randn((batch, *shape), generator=generator).to(device)
        times = torch.full((batch, args.chunk), 750.0, device=device)
        time_chunk(ways[served], latents, times, caches[:batch], 1)  # warm-up at this batch size
        transformer[str(batch)] = time_chunk(ways[served], latents, times, caches[:batch], 2) / FORWARDS_PER_CHUNK
        if batch in previous_batches:
            time_chunk(ways["previous"], latents, times, caches[:batch], 1)
            previous[str(batch)] = time_chunk(ways["previous"], latents, times, caches[:batch], 2) / FORWARDS_PER_CHUNK
        print(f"forward at batch {batch}: {transformer[str(batch)]:.4f} s (previous {previous.get(str(batch))})")
    checked = check(ways, model, shape, caches[:2], generator) if args.baseline else None
    one = torch.randn((1, *shape), generator=generator).to(device)
    at = torch.full((1, args.chunk), 750.0, device=device)
    kernels = {name: census(forward, one, at, caches[:1]) for name, forward in ways.items()}
    del caches
    clean = torch.randn((1, *shape), generator=generator).to(device)
    vae: dict[str, float] = {}
    for label, dtype in (("vae_dtype", model.vae.dtype), ("float32", torch.float32)):
        module = model.vae if dtype == model.vae.dtype else copy.deepcopy(model.vae).to(dtype)
        decoder = StreamingVaeDecoder(module)
        decoder.decode(vae_latents(model, clean).to(dtype))  # the first chunk, whose first frame is single
        vae[label] = _timed(
            device, lambda d=decoder, m=module: to_rgb_frames(d.decode(vae_latents(model, clean).to(m.dtype)))
        )
        decoder.close()
    sample_decoder = StreamingVaeDecoder(model.vae)
    sample_decoder.decode(vae_latents(model, clean))
    frames = to_rgb_frames(sample_decoder.decode(vae_latents(model, clean)))  # a later chunk: 4 frames per latent
    sample_decoder.close()
    writer = FragmentedMp4Writer(args.width, args.height, args.fps, preset="veryfast")
    writer.begin()
    encoder = writer._encoder  # encode and mux apart: the writer does both in push()
    encode_s, mux_s = [], []
    for _ in range(3):
        start = time.perf_counter()
        packets = []
        for rgb in frames:
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p")
            frame.pts = writer.frames_in
            writer.frames_in += 1
            packets.extend(encoder.encode(frame))
        encoded = time.perf_counter()
        writer._fragment(packets)
        encode_s.append(encoded - start)
        mux_s.append(time.perf_counter() - encoded)
    config = model.transformer.config
    tokens = (args.height // model.size_multiple) * (args.width // model.size_multiple) * args.chunk  # patches
    window_tokens = tokens // args.chunk * (args.cache_frames + args.chunk)
    dim = int(config.num_attention_heads) * int(config.attention_head_dim)
    params = sum(p.numel() for p in model.transformer.blocks.parameters())
    # Per forward of one stream: 2 x parameters x tokens for the linear layers, 4 x tokens x keys x dim for
    # attention (QK^T and AV), cross-attention to the text ignored (512 keys).
    flops = 2 * params * tokens + 4 * int(config.num_layers) * tokens * window_tokens * dim
    return {
        "forward_relative_error_to_previous": checked,
        "forward_census_one_stream": kernels,
        "transformer_forward_s_by_batch": transformer,
        "previous_transformer_forward_s_by_batch": previous,
        "previous_achieved_tflops_by_batch": {b: flops * int(b) / t / 1e12 for b, t in previous.items()},
        "forwards_per_chunk": args.steps + 1,
        "vae_decode_chunk_s": vae,
        "encode_chunk_s": statistics.median(encode_s),
        "mux_chunk_s": statistics.median(mux_s),
        "frames_per_chunk": len(frames),
        "flops_per_forward_per_stream": flops,
        "flops_per_chunk_per_stream": flops * (args.steps + 1),
        "achieved_tflops_by_batch": {b: flops * int(b) / t / 1e12 for b, t in transformer.items()},
    }


def whole_clip(engine: LiveVideoEngine, args: argparse.Namespace) -> dict[str, Any]:
    """The full-denoise path on the same model and shapes: 81 frames, the same few steps, no guidance."""
    from benchmarks.video_measure import Clip, measure

    clip = Clip(args.width, args.height, 81, args.fps, args.steps, guidance_scale=1.0)
    return measure(engine.model, clip, encode=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    levels = [int(n) for n in args.streams.split(",")]
    options = {
        "device": args.device,
        "dtype": args.dtype,
        "vae_dtype": args.vae_dtype,
        "max_sessions": str(max(levels)),
        "max_frames_in_flight": str(4 * args.chunk * 4),
        "cache_frames": str(args.cache_frames),
        "overlap_decode": str(args.overlap_decode).lower(),
    }
    report: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/video_live.py", *(argv or sys.argv[1:])]),
        "host": platform.node(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "options": options,
        "levels": [],
    }
    began = time.perf_counter()
    settings = Settings(engine="synthetic", video_model=f"preset:{args.preset}", video_options=options)
    with serve(settings) as server:
        engine: LiveVideoEngine = server.app.state.video_engine
        report["load_s"] = time.perf_counter() - began
        warm = copy.copy(args)
        warm.seconds = min(args.seconds, 4.0)
        asyncio.run(level(server.ws_url, warm, 1))  # warm-up: kernels, allocator, encoder
        for streams in levels:
            result = asyncio.run(level(server.ws_url, args, streams))
            report["levels"].append(result)
            print(
                f"{streams} streams: first fragment {result['first_fragment_s']}, "
                f"fps {result['sustained_fps_per_stream']}, prompt->chunk {result['prompt_to_chunk_s']}",
                flush=True,
            )
            args.out.write_text(json.dumps(report, indent=1, default=str))
        report["engine"] = {
            "forwards_run": engine.forwards_run,
            "batched_samples": engine.batched_samples,
            "chunks_decoded": engine.chunks_decoded,
            "decode_calls": engine.decode_calls,
        }
        try:
            if not args.no_split:
                report["split"] = split(engine, args, levels)
                brief = {k: v for k, v in report["split"].items() if k != "forward_census_one_stream"}
                print("split", json.dumps(brief, default=str), flush=True)
                for name, found in report["split"]["forward_census_one_stream"].items():
                    print("census", name, json.dumps(found["per_forward_ms_by_kind"]), flush=True)
                args.out.write_text(json.dumps(report, indent=1, default=str))
            if not (args.no_clip or args.no_split):
                report["whole_clip"] = whole_clip(engine, args)
                print("whole clip", json.dumps(report["whole_clip"]["time_to_first_frame_s"]), flush=True)
        except Exception as exc:  # keep the levels' figures when a later part fails
            report["failed"] = f"{type(exc).__name__}: {exc}"
            print("failed:", report["failed"], flush=True)
        if args.device.startswith("cuda"):
            report["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    args.out.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
