"""GPU benchmark of the talker engine: in-process step timings and the real server under the load-test CLI.

Run on the GPU machine from the repository root (writes ``talker_gpu.json`` into ``--out``)::

    python benchmarks/talker_gpu.py --out docs/benchmarks

Two phases, each in its own process so that GPU memory is measured and released cleanly:

``inprocess``
    the memory bandwidth; the kernels against their torch references (time); the engine built as the server builds
    it (load time, CUDA-graph capture, memory: weights, KV per slot, codec state per session); one step's GPU time
    per batch size; where a step's time goes (backbone, depth decoder, sampling, codec and PCM, host copy, Python)
    against the time to read the weights once per step; engine steps in steady state; engine-side time to first
    audio; and the naive baseline, transformers ``generate()`` plus ``MimiModel.decode`` on the same model.
``server``
    ``omnigate serve --engine talker --model preset:csm-1b -E device=cuda -E dtype=bfloat16`` driven over
    WebSocket by ``omnigate-loadtest`` on the same machine (``--client-processes`` processes, default 8, their
    per-session records pooled and judged as one level): TTFA and real-time factor at fixed concurrencies, then a
    search for the largest concurrency with zero underruns and p99 TTFA within the SLO, sampling GPU memory. The
    clients offer ``permessage-deflate`` as clients at their defaults do (``--no-compression``: they offer nothing),
    and each level records what the server answered.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

FRAME_MS = 80.0


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ==== in-process phase ===============================================================================================


def _cuda_time_ms(fn: Callable[[], object], reps: int = 20) -> float:
    """Median GPU time of ``fn`` by CUDA events, after a warm-up call."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)))
    return statistics.median(times)


def _graph(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured as a CUDA graph (after two warm-up runs on a side stream); returns its replay."""
    import torch

    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def measure_bandwidth() -> dict[str, float]:
    import torch

    source = torch.empty(1 << 30, dtype=torch.float32, device="cuda").normal_()  # 4 GiB
    target = torch.empty_like(source)
    ms = _cuda_time_ms(lambda: target.copy_(source), reps=10)
    moved = 2 * source.numel() * source.element_size()
    return {"copy_ms": ms, "tb_per_s_read_plus_write": moved / ms / 1e9}


def kernel_timings() -> dict[str, Any]:
    """Each Triton kernel against its plain-torch reference at engine shapes (bfloat16), GPU time per call."""
    import torch

    from omnigate.kernels import triton_kernels as tk
    from omnigate.kernels.attention import slot_attention_reference
    from omnigate.kernels.pcm import PACK_EXTRA, pack_pcm_reference
    from omnigate.kernels.sampling import sample_tokens_reference
    from omnigate.kernels.sampling_types import SamplingRows, Vocabulary

    out: dict[str, Any] = {}
    dev, bf = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)

    def attention(rows: int, capacity: int) -> dict[str, float]:
        keys = torch.randn(rows + 1, capacity, 8, 64, device=dev, dtype=bf, generator=gen)
        values = torch.randn_like(keys)
        q = torch.randn(rows, 32, 64, device=dev, dtype=bf, generator=gen)
        slots = torch.arange(rows, device=dev)
        lengths = torch.randint(200, capacity, (rows,), device=dev, generator=gen)
        triton_ms = _cuda_time_ms(lambda: tk.slot_attention(q, keys, values, slots, lengths, 0.125))
        ref_ms = _cuda_time_ms(lambda: slot_attention_reference(q, keys, values, slots, lengths, 0.125))
        read = int(lengths.sum()) * 8 * 64 * 2 * 2
        return {
            "triton_ms": triton_ms,
            "sdpa_masked_reference_ms": ref_ms,
            "kv_bytes_read": read,
            "triton_tb_per_s": read / triton_ms / 1e9,
        }

    for rows in (1, 64, 512):
        out[f"slot_attention_b{rows}_ctx1024"] = attention(rows, 1024)
    count, vocab_size, window = 512, 2051, 16
    logits = torch.randn(count, vocab_size, device=dev, dtype=bf, generator=gen) * 3
    rows_ = SamplingRows(
        temperature=torch.full((count,), 0.9, device=dev),
        top_k=torch.full((count,), 50, dtype=torch.int32, device=dev),
        top_p=torch.full((count,), 0.95, device=dev),
        penalty=torch.full((count,), 1.1, device=dev),
        seeds=torch.arange(count, device=dev),
        counters=torch.zeros(count, dtype=torch.int64, device=dev),
        history_slots=torch.arange(count, device=dev),
        ring=torch.zeros(count, dtype=torch.int64, device=dev),
    )
    history = torch.randint(0, 2048, (count, window), device=dev, generator=gen)
    vocab = Vocabulary(valid_ids=2048, eos_id=0)
    out["sampling_b512"] = {
        "triton_ms": _cuda_time_ms(lambda: tk.sample_tokens(logits, rows_, history, 0, vocab)),
        "torch_reference_ms": _cuda_time_ms(lambda: sample_tokens_reference(logits, rows_, history, 0, vocab)),
    }
    audio = torch.randn(count, 1920, device=dev, generator=gen) * 0.5
    flags = torch.zeros(count, dtype=torch.bool, device=dev)
    packed = torch.empty(count, 1920 + PACK_EXTRA, dtype=torch.int16, device=dev)
    out["pack_pcm_b512"] = {
        "triton_ms": _cuda_time_ms(lambda: tk.pack_pcm(audio, flags, packed)),
        "torch_reference_ms": _cuda_time_ms(lambda: pack_pcm_reference(audio, flags, packed)),
    }
    return out


def _param_bytes(module: Any) -> int:
    seen, total = set(), 0
    for tensor in list(module.parameters()) + list(module.buffers()):
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    return total


def _weight_read_bytes(engine: Any) -> dict[str, int]:
    """Bytes of weights one step must read: the backbone once, the depth decoder and its projector once per
    residual codebook, each codebook head once."""
    csm = engine.model.csm
    codebooks = engine.frames.num_codebooks
    backbone = sum(p.numel() * p.element_size() for p in csm.backbone_model.layers.parameters())
    depth_layers = sum(p.numel() * p.element_size() for p in csm.depth_decoder.model.layers.parameters())
    projector = sum(p.numel() * p.element_size() for p in csm.depth_decoder.model.inputs_embeds_projector.parameters())
    heads = csm.depth_decoder.codebooks_head.weight
    head_bytes = heads.numel() * heads.element_size() + csm.lm_head.weight.numel() * csm.lm_head.weight.element_size()
    per_step = backbone + (codebooks - 1) * (depth_layers + projector) + head_bytes
    return {
        "backbone": backbone,
        "depth_layers": depth_layers,
        "depth_projector": projector,
        "heads": head_bytes,
        "per_step": per_step,
    }


def _fill_slots(engine: Any, rows: int, length: int) -> list[int]:
    """Give slots ``0..rows-1`` a context of ``length`` tokens (contents irrelevant to cost)."""
    slots = list(range(rows))
    cache = engine.frames.cache
    for slot in slots:
        cache.reset(slot)
    cache.commit(slots, [length] * rows)
    return slots


def _step_rows(engine: Any, slots: list[int]) -> Any:
    from omnigate.engines.talker.frame_step import StepRows

    cache = engine.frames.cache
    return StepRows(
        slots=slots,
        positions=[cache.length(s) for s in slots],
        seeds=list(range(len(slots))),
        counters=[0] * len(slots),
        rings=[0] * len(slots),
        fresh=[0] * len(slots),
        decoding=len(slots),
    )


def step_timings(engine: Any, sizes: list[int], context: int) -> dict[str, Any]:
    """Per batch size: the step's CUDA-graph replay (GPU time) and a whole ``FrameStep.run`` (wall, copies and host
    sync included), with every row at ``context`` tokens of history."""
    import torch

    step = engine.device_step
    graphs = step.graphs
    out: dict[str, Any] = {}
    for rows in sizes:
        slots = _fill_slots(engine, rows, context)
        spec = _step_rows(engine, slots)
        step.run(spec)
        bucket = graphs.bucket(rows)
        gpu_ms = _cuda_time_ms(functools.partial(graphs.replay, bucket))
        walls = []
        for _ in range(15):
            t0 = time.perf_counter()
            step.run(spec)
            walls.append((time.perf_counter() - t0) * 1000)
        wall = statistics.median(walls)
        out[str(rows)] = {
            "bucket": bucket,
            "graph_gpu_ms": gpu_ms,
            "run_wall_ms": wall,
            "streams_realtime_if_only_this": int(rows * FRAME_MS / wall),
        }
        log(f"step rows={rows} bucket={bucket} gpu={gpu_ms:.2f} ms wall={wall:.2f} ms")
    torch.cuda.synchronize()
    return out


def step_breakdown(engine: Any, rows: int, context: int) -> dict[str, float]:
    """GPU time of each part of a step, each captured as its own CUDA graph at ``rows`` rows."""
    import torch

    from omnigate.kernels.pcm import pack_pcm
    from omnigate.kernels.sampling import sample_tokens

    frames, codec, step = engine.frames, engine.codec, engine.device_step
    slots = _fill_slots(engine, rows, context)
    dev = frames.device
    slot_t = torch.tensor(slots, device=dev)
    pos_t = torch.full((rows,), context, device=dev, dtype=torch.int64)
    hidden = torch.randn(rows, frames.backbone.heads * frames.backbone.head_dim, device=dev, dtype=frames.dtype)
    codes = torch.randint(1, 2048, (rows, frames.num_codebooks), device=dev)
    logits = torch.randn(rows, frames.vocab_size, device=dev, dtype=frames.dtype)
    sampling = step._sampling.head(rows)
    vocab = frames.sampler.vocabulary
    flags = torch.zeros(rows, dtype=torch.bool, device=dev)

    def backbone() -> None:
        frames.decode(slot_t, pos_t, step.last_frames[slot_t])

    def depth_and_sampling() -> None:
        frames.generate(hidden, sampling, step.history)

    def sampling_only() -> None:
        for i in range(frames.num_codebooks):
            sample_tokens(logits, sampling, step.history[:, i], i, vocab)

    def codec_and_pcm() -> None:
        pack_pcm(codec.decode_frames(codes[:, :, None], slot_t), flags, step.out[:rows])

    parts = {
        "backbone_ms": _cuda_time_ms(_graph(backbone)),
        "depth_with_sampling_ms": _cuda_time_ms(_graph(depth_and_sampling)),
        "sampling_ms": _cuda_time_ms(_graph(sampling_only)),
        "codec_and_pcm_ms": _cuda_time_ms(_graph(codec_and_pcm)),
    }
    parts["depth_decoder_ms"] = parts["depth_with_sampling_ms"] - parts["sampling_ms"]
    host = step._host_out[0]
    copies = []
    for _ in range(20):
        t0 = time.perf_counter()
        host[:rows].copy_(step.out[:rows], non_blocking=True)
        torch.cuda.current_stream().synchronize()
        copies.append((time.perf_counter() - t0) * 1000)
    parts["host_copy_ms"] = statistics.median(copies)
    return parts


def _open_long(engine: Any, seed: int) -> Any:
    from omnigate.engines.base import SynthesisParams

    stream = engine.open(SynthesisParams(voice="0", max_audio_ms=600_000), seed=seed)
    stream.pending_text.append("Steady speech for measuring the engine. " * 6)
    stream.input_done = True
    return stream


def _start_all(engine: Any, streams: list[Any]) -> None:
    """Step until every stream has prefilled and produced audio (new text is prefilled a token budget per step)."""
    for _ in range(256):
        if all(stream.draws > 0 for stream in streams):
            return
        engine.step(streams, [1e12] * len(streams))
    raise RuntimeError("streams did not all start")


def engine_steady(engine: Any, rows: int, steps: int = 15) -> dict[str, float]:
    """``engine.step`` wall time per step with ``rows`` streams mid-utterance (unlimited credit)."""
    from omnigate.engines.base import AudioChunk

    streams = [_open_long(engine, seed=1000 + k) for k in range(rows)]
    budgets = [1e12] * rows
    first = time.perf_counter()
    engine.step(streams, budgets)
    prefill_ms = (time.perf_counter() - first) * 1000
    _start_all(engine, streams)
    for _ in range(2):
        engine.step(streams, budgets)
    walls, frames = [], 0
    for _ in range(steps):
        t0 = time.perf_counter()
        outputs = engine.step(streams, budgets)
        walls.append((time.perf_counter() - t0) * 1000)
        frames += sum(round(o.duration_ms / FRAME_MS) for out in outputs for o in out if isinstance(o, AudioChunk))
    for stream in streams:
        engine.close(stream)
    wall = statistics.median(walls)
    return {
        "first_step_with_prefill_ms": prefill_ms,
        "step_wall_ms": wall,
        "engine_rtf": wall / FRAME_MS,
        "frames_per_step": frames / steps,
    }


def engine_ttfa(engine: Any, background: int, trials: int = 9) -> dict[str, float]:
    """Wall time from the step that takes a new stream's text to the end of the step that returns its first audio
    chunk (the same step, or the next one when steps overlap), with ``background`` other streams mid-utterance in
    the same steps."""
    from omnigate.engines.base import AudioChunk

    others = [_open_long(engine, seed=5000 + k) for k in range(background)]
    _start_all(engine, others)
    times = []
    for trial in range(trials):
        new = _open_long(engine, seed=9000 + trial)
        t0 = time.perf_counter()
        for _ in range(2):
            out = engine.step([*others, new], [1e12] * (len(others) + 1))[-1]
            if any(isinstance(o, AudioChunk) for o in out):
                break
        else:
            raise RuntimeError("the first two steps of a stream brought no audio")
        times.append((time.perf_counter() - t0) * 1000)
        engine.close(new)
    for stream in others:
        engine.close(stream)
    times.sort()
    return {"p50_ms": statistics.median(times), "max_ms": times[-1], "trials": trials}


def naive_baseline(engine: Any, batches: list[int]) -> dict[str, Any]:
    """transformers ``generate()`` then ``MimiModel.decode`` on the same model and weights, per batch size."""
    import torch

    csm = engine.model.csm
    codec = csm.codec_model
    ids = engine.model.segments.encode("0", "The quick brown fox jumps over the lazy dog near the river bank.")
    out: dict[str, Any] = {}
    for batch in batches:
        input_ids = torch.tensor([ids] * batch, device="cuda")

        def generate(frames: int, input_ids: torch.Tensor = input_ids) -> torch.Tensor:
            torch.cuda.synchronize()
            with torch.no_grad():
                audio = csm.generate(
                    input_ids=input_ids,
                    do_sample=True,
                    depth_decoder_do_sample=True,
                    max_new_tokens=frames,
                )
            result: torch.Tensor = audio if isinstance(audio, torch.Tensor) else audio[0]
            return result

        generate(2)
        t0 = time.perf_counter()
        first = generate(1)
        with torch.no_grad():
            codec.decode(first.reshape(batch, -1, first.shape[-1]).transpose(1, 2)[..., -1:].long())
        torch.cuda.synchronize()
        first_ms = (time.perf_counter() - t0) * 1000
        frames = 8
        t0 = time.perf_counter()
        codes = generate(frames)
        torch.cuda.synchronize()
        gen_ms = (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        with torch.no_grad():
            codec.decode(codes.reshape(batch, -1, codes.shape[-1]).transpose(1, 2).long())
        torch.cuda.synchronize()
        decode_ms = (time.perf_counter() - t0) * 1000
        made = codes.shape[-2] if codes.dim() == 3 else frames
        per_frame = (gen_ms + decode_ms) / max(1, made)
        rtf = per_frame / FRAME_MS
        out[str(batch)] = {
            "first_frame_ms": first_ms,
            "frames_generated": int(made),
            "generate_ms": gen_ms,
            "decode_ms": decode_ms,
            "ms_per_frame": per_frame,
            "rtf": rtf,
            "realtime_streams": batch if rtf <= 1.0 else 0,
            "ttfa_whole_7s_utterance_ms": first_ms + per_frame * (7000 / FRAME_MS),
        }
        log(f"naive batch={batch}: first frame {first_ms:.0f} ms, {per_frame:.0f} ms per frame, RTF {rtf:.2f}")
    out["capacity"] = max((v["realtime_streams"] for v in out.values()), default=0)
    return out


def run_inprocess(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers
    import triton

    from omnigate.engines.talker.engine import TalkerEngine

    result: dict[str, Any] = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name(),
    }
    log(f"GPU {result['gpu']}, torch {torch.__version__}, triton {triton.__version__}")
    result["bandwidth"] = measure_bandwidth()
    torch.cuda.empty_cache()
    log(f"copy bandwidth {result['bandwidth']['tb_per_s_read_plus_write']:.2f} TB/s")
    result["kernels"] = kernel_timings()
    log(f"kernels {json.dumps(result['kernels'])}")
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    engine = TalkerEngine.load(args.model, **engine_options(args))
    load_s = time.perf_counter() - t0
    graphs = engine.device_step.graphs
    if graphs is None:
        raise RuntimeError("the engine captured no CUDA graphs")
    csm = engine.model.csm
    memory = {
        "weights_talker_bytes": _param_bytes(csm) - _param_bytes(csm.codec_model),
        "weights_codec_bytes": _param_bytes(csm.codec_model),
        "kv_per_slot_bytes": engine.frames.cache.bytes_per_slot,
        "codec_state_per_session_bytes": engine.codec.bytes_per_slot,
        "allocated_after_load_bytes": torch.cuda.memory_allocated() - before,
        "reserved_after_load_bytes": torch.cuda.memory_reserved(),
        "max_context_tokens": engine.frames.cache.capacity,
        "slots": engine.options.max_sessions,
    }
    result["engine"] = {
        "load_s": load_s,
        "graph_capture_s": graphs.capture_s,
        "buckets": graphs.buckets,
        "memory": memory,
    }
    log(f"engine loaded in {load_s:.1f} s (graph capture {graphs.capture_s:.1f} s); memory {json.dumps(memory)}")
    weights = _weight_read_bytes(engine)
    bandwidth = result["bandwidth"]["tb_per_s_read_plus_write"] * 1e12
    result["weight_read"] = {**weights, "ms_per_step_at_copy_bandwidth": weights["per_step"] / bandwidth * 1000}
    sizes = [s for s in (1, 64, 256, 512, 768) if s <= engine.options.max_batch]
    result["steps"] = step_timings(engine, sizes, args.context)
    result["breakdown"] = {}
    for rows in [s for s in (1, 512) if s <= engine.options.max_batch]:
        result["breakdown"][str(rows)] = step_breakdown(engine, rows, args.context)
        log(f"breakdown rows={rows}: {json.dumps(result['breakdown'][str(rows)])}")
    result["steady"] = {}
    for rows in [s for s in args.steady_sizes if s <= engine.options.max_sessions]:
        result["steady"][str(rows)] = engine_steady(engine, rows, steps=10)
        log(f"steady rows={rows}: {json.dumps(result['steady'][str(rows)])}")
    for rows, parts in result["breakdown"].items():
        step_gpu = result["steps"][rows]["graph_gpu_ms"]
        parts["full_step_gpu_ms"] = step_gpu
        if rows in result["steady"]:
            parts["python_and_host_ms"] = result["steady"][rows]["step_wall_ms"] - step_gpu - parts["host_copy_ms"]
    result["engine_ttfa"] = {
        "idle": engine_ttfa(engine, 0, trials=5),
        "with_255_others": engine_ttfa(engine, min(255, engine.options.max_sessions - 1), trials=3),
    }
    log(f"engine TTFA {json.dumps(result['engine_ttfa'])}")
    result["memory_peak_inprocess_bytes"] = torch.cuda.max_memory_allocated()
    if not args.skip_naive:
        result["naive"] = naive_baseline(engine, args.naive_batches)
    return result


def engine_options(args: argparse.Namespace) -> dict[str, str]:
    return dict(option.split("=", 1) for option in args.engine_option)


# ==== server phase ====================================================================================================


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class GpuMemorySampler:
    """Largest GPU memory in use (nvidia-smi, MiB) and the mean GPU utilization (%) while running."""

    def __init__(self) -> None:
        self.peak_mib = 0
        self.utilization: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                text = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used,utilization.gpu", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout
                used, busy = (float(v) for v in text.splitlines()[0].split(","))
                self.peak_mib = max(self.peak_mib, int(used))
                self.utilization.append(busy)
            self._stop.wait(0.5)

    @property
    def mean_utilization(self) -> float | None:
        return sum(self.utilization) / len(self.utilization) if self.utilization else None

    def __enter__(self) -> GpuMemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def running_server(args: argparse.Namespace, port: int, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    launcher = ["-m", "omnigate.gateway.cli"]
    if args.profile_engine:
        profiled = Path(__file__).with_name("profiled_server.py")
        launcher = [str(profiled), "--profile-out", str(log_path.with_name("engine.prof"))]
    if args.switch_interval_ms is not None:
        # The engine thread and the event loop share the GIL; this sets how long one may hold it against the other.
        launcher = [
            "-c",
            f"import sys; sys.setswitchinterval({args.switch_interval_ms / 1000!r}); "
            "from omnigate.gateway.cli.serve import main; sys.exit(main())",
        ]
    command = [
        sys.executable,
        *launcher,
        "serve",
        "--engine",
        "talker",
        "--model",
        args.model,
        *[part for option in args.engine_option for part in ("-E", option)],
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--engine-process",
        args.engine_process,
        "--workers",
        str(args.workers),
        "--admission",
        args.admission,
    ]
    log(f"server: {shlex.join(command)}")
    with log_path.open("wb") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        try:
            yield server
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def gateway_pid(server: subprocess.Popen[bytes]) -> int:
    """The process whose CPU the load test samples: the serve process itself, or with an engine core the first
    gateway worker the serve supervisor started (the core and the other workers are its other children)."""
    import psutil

    workers = [child.pid for child in psutil.Process(server.pid).children() if "--attach-core" in child.cmdline()]
    return min(workers) if workers else server.pid


def wait_ready(url: str, server: subprocess.Popen[bytes], timeout_s: float) -> float:
    import httpx

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        time.sleep(1)
    raise RuntimeError("the server did not become ready")


def _histogram_quantile(series: dict[str, float], name: str, q: float) -> float | None:
    """Upper bucket bound holding quantile ``q`` of a Prometheus histogram's increase over the level."""
    total = series.get(f"{name}_count", 0.0)
    if total <= 0:
        return None
    bounds = sorted(
        (float(key.split('le="')[1].rstrip('"}')), value)
        for key, value in series.items()
        if key.startswith(f"{name}_bucket{{")
    )
    for bound, count in bounds:
        if count >= q * total:
            return bound
    return None


def server_side(metric_series: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """What the server itself reported over a level: engine steps, event-loop lag, CPU of the process."""
    delta = {m["name"]: float(m["delta"]) for m in metric_series}
    steps = delta.get("omnigate_engine_step_duration_seconds_count", 0.0)
    lags = delta.get("omnigate_event_loop_lag_seconds_count", 0.0)
    step_ms = 1000 * delta.get("omnigate_engine_step_duration_seconds_sum", 0.0) / steps if steps else None
    step_p99 = _histogram_quantile(delta, "omnigate_engine_step_duration_seconds", 0.99)
    return {
        "engine_steps": steps,
        "engine_step_mean_ms": step_ms,
        "engine_step_p99_ms_upper_bound": _ms(step_p99),
        "engine_steps_over_50ms_fraction": (
            1 - delta.get('omnigate_engine_step_duration_seconds_bucket{le="0.05"}', 0.0) / steps if steps else None
        ),
        "engine_batch_mean": delta.get("omnigate_engine_batch_size_sum", 0.0) / steps if steps else None,
        "engine_busy_fraction": delta.get("omnigate_engine_step_duration_seconds_sum", 0.0) / wall_s,
        "loop_lag_mean_ms": 1000 * delta.get("omnigate_event_loop_lag_seconds_sum", 0.0) / lags if lags else None,
        "loop_lag_p99_ms_upper_bound": _ms(_histogram_quantile(delta, "omnigate_event_loop_lag_seconds", 0.99)),
        "server_cpu_cores": delta.get("server_process_cpu_seconds_total", 0.0) / wall_s,
        "server_loop_thread_cpu_cores": delta.get("server_process_main_thread_cpu_seconds_total", 0.0) / wall_s,
        # the engine's time by stage, as fractions of the level's wall time (the engine's own timers)
        "engine_stage_fraction": {
            name.split('stage="')[1].rstrip('"}'): value / wall_s
            for name, value in delta.items()
            if name.startswith("omnigate_engine_stage_seconds_total{")
        },
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def client_shares(sessions: int, processes: int) -> list[int]:
    """Sessions per client process: as even as possible, no process without a session."""
    count = max(1, min(processes, sessions))
    return [sessions // count + (1 if index < sessions % count else 0) for index in range(count)]


def loadtest_command(
    args: argparse.Namespace, url: str, pid: int, level: int, sessions: int, index: int, report_path: Path
) -> list[str]:
    """One client process's ``omnigate-loadtest run`` (``sessions`` of the level's ``level``); the first one also
    samples the server."""
    ramp = min(args.ramp, max(0.0, level / 100.0))
    command = [
        sys.executable,
        "-m",
        "omnigate.loadtest.cli",
        "run",
        url,
        "--target",
        "ws-speech",
        "--sessions",
        str(sessions),
        "--duration",
        str(args.level_duration),
        "--warmup",
        str(args.warmup),
        "--ramp",
        str(ramp),
        "--drain",
        str(args.drain),
        "--slo-ttfa-ms",
        str(args.slo_ttfa_ms),
        "--seed",
        str(1 + index),
        "--out",
        str(report_path),
        "--quiet",
    ]
    command += ["--server-pid", str(pid)] if index == 0 else ["--no-metrics"]
    if args.no_compression:
        command.append("--no-compression")
    return command


def pooled_level(levels: list[Any], slo_ttfa_ms: float) -> dict[str, Any]:
    """One level measured by several client processes, pooled from their per-session records and judged as one."""
    from omnigate.loadtest.report import Unfinished, slo_verdict
    from omnigate.loadtest.stats import distribution

    records = [record for level in levels for record in level.session_records]
    utterances = [u for record in records for u in record.utterances]
    completed = [u for u in utterances if u.status == "completed"]
    ttfa = distribution(u.ttfa_ms for u in completed if u.ttfa_ms is not None)
    rtf = distribution(u.rtf for u in completed if u.rtf is not None)
    errors: dict[str, int] = {}
    negotiated: dict[str, dict[str, int]] = {}
    for level in levels:
        for code, count in level.errors.items():
            errors[code] = errors.get(code, 0) + count
        for key, answers in level.negotiated.items():
            for answer, count in answers.items():
                negotiated.setdefault(key, {})[answer] = negotiated.setdefault(key, {}).get(answer, 0) + count
    underruns = sum(level.underruns for level in levels)
    unfinished = Unfinished(
        failed=sum(1 for u in utterances if u.status == "failed"),
        cut_off=sum(1 for u in utterances if u.status == "cut_off"),
        cut_off_connecting=sum(1 for r in records if r.status == "cut_off" and r.connect_ms is None),
    )
    verdict = slo_verdict(ttfa, underruns, errors, slo_ttfa_ms, measured_sessions=len(records), unfinished=unfinished)
    return {
        "passed": verdict.passed,
        "reasons": verdict.reasons,
        "ttfa_ms": {"count": ttfa.count, "p50": ttfa.p50, "p90": ttfa.p90, "p99": ttfa.p99, "max": ttfa.max},
        "rtf": {"p50": rtf.p50, "p99": rtf.p99},
        "underruns": underruns,
        "utterances": {
            "total": len(utterances),
            "completed": len(completed),
            "failed": unfinished.failed,
            "cut_off": unfinished.cut_off,
            "with_underruns": sum(1 for u in completed if u.underruns),
        },
        "errors": errors,
        "negotiated": negotiated,
        "audio_s": sum(level.audio_s for level in levels),
        "client_cpu_percent": [level.client_cpu_percent for level in levels],
    }


def run_level(args: argparse.Namespace, url: str, pid: int, sessions: int, out_dir: Path) -> dict[str, Any]:
    import msgspec

    from omnigate.loadtest.report import LoadTestReport

    shares = client_shares(sessions, args.client_processes)
    paths = [out_dir / f"loadtest_{sessions}_{index}.json" for index in range(len(shares))]
    commands = [
        loadtest_command(args, url, pid, sessions, share, index, path)
        for index, (share, path) in enumerate(zip(shares, paths, strict=True))
    ]
    t0 = time.perf_counter()
    with GpuMemorySampler() as gpu:
        clients = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for c in commands]
        failures = [client.communicate()[1] for client in clients]
    wall = time.perf_counter() - t0
    missing = [index for index, path in enumerate(paths) if not path.exists()]
    if missing:
        raise RuntimeError(f"load test at {sessions} failed: {failures[missing[0]][-2000:]}")
    levels = [msgspec.json.decode(path.read_bytes(), type=LoadTestReport).levels[0] for path in paths]
    summary = {
        "sessions": sessions,
        "client_processes": len(shares),
        **pooled_level(levels, args.slo_ttfa_ms),
        "gpu_memory_peak_mib": gpu.peak_mib,
        "gpu_utilization_mean_percent": gpu.mean_utilization,
        "server_side": server_side(msgspec.to_builtins(levels[0].server_metrics), levels[0].wall_s),
        "wall_s": wall,
        "commands": [shlex.join(command) for command in commands],
    }
    if not args.keep_level_reports:
        for path in paths:
            path.unlink()
    log(
        f"level {sessions}: passed={summary['passed']} TTFA p50={summary['ttfa_ms']['p50']} "
        f"p99={summary['ttfa_ms']['p99']} underruns={summary['underruns']} reasons={summary['reasons']} "
        f"negotiated={summary['negotiated']} server={json.dumps(summary['server_side'])} "
        f"gpu_util={summary['gpu_utilization_mean_percent']}"
    )
    return summary


def run_server_phase(args: argparse.Namespace, out_dir: Path, save: Callable[[dict[str, Any]], None]) -> None:
    """Fill the server section, handing it to ``save`` after every level (a cut-off run keeps what it measured)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    deadline = args.started + args.deadline_s
    result: dict[str, Any] = {"levels": [], "capacity": None}
    save(result)
    with running_server(args, port, out_dir / "server.log") as server:
        result["ready_s"] = wait_ready(url, server, timeout_s=600)
        log(f"server ready in {result['ready_s']:.1f} s")
        pid = gateway_pid(server)
        result["engine_process"], result["workers"], result["sampled_pid"] = args.engine_process, args.workers, pid
        levels = [int(v) for v in args.levels.split(",") if v]
        for sessions in levels:
            result["levels"].append(run_level(args, url, pid, sessions, out_dir))
            save(result)
        passed = [lv["sessions"] for lv in result["levels"] if lv["passed"]]
        failed = [lv["sessions"] for lv in result["levels"] if not lv["passed"]]
        low = max(passed, default=0)
        high = min([f for f in failed if f > low], default=None)
        per_level = args.level_duration + args.drain + 10
        while time.perf_counter() + per_level < deadline:
            if high is None:
                if low >= args.max_level:
                    break
                probe = args.capacity_start if low < args.capacity_start else int(low * 1.5)
                probe = min(probe, args.max_level)
            elif high - low <= args.capacity_resolution:
                break
            else:
                probe = (low + high) // 2
            level = run_level(args, url, pid, probe, out_dir)
            result["levels"].append(level)
            if level["passed"]:
                low = probe
            else:
                high = probe
            result["capacity"] = {"passed_max": low, "first_failed_above": high}
            save(result)
        result["capacity"] = {"passed_max": low, "first_failed_above": high}
    save(result)


# ==== orchestration ===================================================================================================


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="folder for talker_gpu.json")
    parser.add_argument("--phases", default="inprocess,server", help="comma-separated: inprocess, server")
    parser.add_argument("--phase", choices=["inprocess"], help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--model", default="preset:csm-1b")
    parser.add_argument(
        "-E",
        dest="engine_option",
        action="append",
        default=None,
        help="engine option KEY=VALUE (repeatable); the defaults below when none is given",
    )
    parser.add_argument("--context", type=int, default=512, help="history tokens per row in step timings")
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument("--naive-batches", type=lambda t: [int(v) for v in t.split(",")], default=[1, 8])
    parser.add_argument("--steady-sizes", type=lambda t: [int(v) for v in t.split(",")], default=[1, 512])
    parser.add_argument("--levels", default="1,8,64,256", help="fixed concurrencies measured first")
    parser.add_argument(
        "--profile-engine",
        action="store_true",
        help="profile the server's engine steps, inline or in the engine core (engine.prof in --out)",
    )
    parser.add_argument(
        "--switch-interval-ms", type=float, help="the server's GIL switch interval (Python's default: 5 ms)"
    )
    parser.add_argument("--capacity-start", type=int, default=512)
    parser.add_argument("--capacity-resolution", type=int, default=64)
    parser.add_argument("--max-level", type=int, default=768)
    parser.add_argument("--level-duration", type=float, default=12.0)
    parser.add_argument("--warmup", type=float, default=4.0)
    parser.add_argument("--ramp", type=float, default=4.0)
    parser.add_argument("--drain", type=float, default=12.0)
    parser.add_argument("--slo-ttfa-ms", type=float, default=300.0)
    parser.add_argument(
        "--deadline-s", type=float, default=540.0, help="no new capacity level starts past this (from the start)"
    )
    parser.add_argument("--keep-level-reports", action="store_true")
    parser.add_argument(
        "--no-compression",
        action="store_true",
        help="clients offer no permessage-deflate (by default they offer it, as browsers and websockets clients do)",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=8,
        help="load-test processes per level, sessions spread evenly (so that no client process is what saturates)",
    )
    parser.add_argument(
        "--engine-process",
        choices=["auto", "core", "inline"],
        default="auto",
        help="serve's --engine-process: the engine in an engine-core process or in the gateway process",
    )
    parser.add_argument("--workers", type=int, default=1, help="serve's --workers (gateway processes on one core)")
    parser.add_argument(
        "--admission",
        choices=["headroom", "slots"],
        default="slots",
        help="serve's --admission: slots measures what the engine carries; headroom what the server admits",
    )
    args = parser.parse_args(argv)
    if args.engine_process != "inline" and args.switch_interval_ms is not None:
        parser.error("--switch-interval-ms sets the GIL switch interval of a gateway that runs its engine inline")
    args.started = time.perf_counter()
    if args.engine_option is None:
        args.engine_option = [
            "device=cuda",
            "dtype=bfloat16",
            "max_sessions=768",
            "max_batch=768",
            "max_context=1024",
            "top_p=0.95",
            "repetition_penalty=1.1",
        ]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.phase == "inprocess":
        result = run_inprocess(args)
        (args.out / "talker_gpu_inprocess.json").write_text(json.dumps(result, indent=2))
        return 0
    phases = set(args.phases.split(","))
    report: dict[str, Any] = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "engine_options": args.engine_option,
        "model": args.model,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    path = args.out / "talker_gpu.json"
    if "inprocess" in phases:
        child = [sys.executable, __file__, "--phase", "inprocess", "--out", str(args.out), "--model", args.model]
        child += [part for option in args.engine_option for part in ("-E", option)]
        child += ["--context", str(args.context)] + (["--skip-naive"] if args.skip_naive else [])
        child += ["--naive-batches", ",".join(map(str, args.naive_batches))]
        child += ["--steady-sizes", ",".join(map(str, args.steady_sizes))]
        log(f"in-process phase: {shlex.join(child)}")
        done = subprocess.run(child, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        inprocess = args.out / "talker_gpu_inprocess.json"
        if done.returncode == 0 and inprocess.exists():
            report["inprocess"] = json.loads(inprocess.read_text())
            inprocess.unlink()
        else:
            report["inprocess_error"] = f"exit code {done.returncode}"
        path.write_text(json.dumps(report, indent=2))
    if "server" in phases:

        def save(server: dict[str, Any]) -> None:
            report["server"] = server
            path.write_text(json.dumps(report, indent=2))

        try:
            run_server_phase(args, args.out, save)
        except Exception as exc:  # the partial report is still worth writing
            report["server_error"] = repr(exc)
            log(f"server phase failed: {exc!r}")
        path.write_text(json.dumps(report, indent=2))
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
