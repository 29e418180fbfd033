"""Live video chat latency and vision-encoder cost, in one command.

Starts the real gateway in this process (omni engine + talker speech engine), then at each session count N opens N
WebSocket clients of ``/v1/video/chat/stream`` that send JPEG camera frames at ``--fps`` and ask one question every
``--query-every`` seconds; it reports, per level, the time from ``video.query`` to the first text delta and to the
first audio byte (p50/p95/max over every query after the first round; the first round apart), and why each level's
questions ended: terminal statuses, error codes with a few messages, questions still open after ``--drain`` seconds,
and the thinker's token rate (each decode step is one batched forward over every answer in flight: its steps per
second and answers per step say how the batch grows with the sessions). The time from first text to first audio is
split where the speech session's segmenter released the answer's first unit to the talker (the client replays the
segmenter over the text deltas as they arrive; the answer's end flushes it): text to unit is the thinker's and the
segmenter's, unit to audio the talker's. The thinker's worker time is split too: frames encoded ahead, frames
encoded in prefills, prefill forwards, decode steps. ``--compare-before`` runs the levels twice in the same server:
as built, then with the omni engine's ``encode_ahead`` off (a question's prefill encodes its new frames, as before
frames were encoded as they arrive).
The talker admits by slots (``--admission slots``) so that a level measures what the engines carry; ``headroom``
measures what a production gateway admits. Then it measures the vision encoder alone:
milliseconds per frame when every frame is new, and when the frames are unchanged (their vision tokens come from
the session's encoder cache).

GPU (published shapes, random weights):
    python -m benchmarks.video_chat_gpu --out $OUT/video_chat_gpu.json
The GPU run's code path on the CPU with tiny presets (a dry run; or set BENCH_DEVICE, BENCH_DTYPE,
BENCH_SPEECH_MODEL, BENCH_OMNI_MODEL):
    python -m benchmarks.video_chat_gpu --device cpu --dtype float32 --speech-model preset:tiny \
        --omni-model preset:tiny --levels 1 --duration 10 --out /tmp/video_chat_dry.json
CPU smoke run (tiny omni preset, the synthetic speech engine):
    python -m benchmarks.video_chat_gpu --tiny --levels 1,8 --out docs/benchmarks/video_chat.json

Qwen3-Omni (``serve --engine qwen3-omni``: one model sees the frames, hears the question and answers in its own
voice; no speech engine), GPU and its CPU dry run:
    python -m benchmarks.video_chat_gpu --engine qwen3-omni --model preset:qwen3-omni-30b-a3b --levels 16,64 \
        --out $OUT/qwen3_omni_video_chat_h200.json
    python -m benchmarks.video_chat_gpu --engine qwen3-omni --model preset:tiny --device cpu --dtype float32 \
        --levels 1 --duration 5 --out /tmp/q3_video_chat_dry.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import io
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from omnigate.gateway.settings import Settings
from omnigate.sessions.segmenter import TextSegmenter
from tests.serving import serve

ROUTE = "/v1/video/chat/stream"


def camera_frames(count: int, size: tuple[int, int] = (640, 480)) -> list[str]:
    """A moving picture (a bright square crossing a gradient) as base64 JPEGs, so the frame filter keeps them."""
    out = []
    w, h = size
    base = np.tile(np.linspace(0, 200, w, dtype=np.uint8), (h, 1))
    for i in range(count):
        img = np.stack([base, base[::-1], np.full_like(base, 80)], axis=-1).copy()
        x = (i * 37) % (w - 80)
        img[100:180, x : x + 80] = 255
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, "JPEG", quality=80)
        out.append(base64.b64encode(buf.getvalue()).decode())
    return out


def summary(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {
        "n": len(values),
        "p50_ms": round(statistics.median(ordered) * 1000, 1),
        "p95_ms": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] * 1000, 1),
        "max_ms": round(ordered[-1] * 1000, 1),
    }


class Outcomes:
    """Why the queries of a level ended: terminal statuses and error codes by count, a few messages of each code."""

    EXAMPLES = 3

    def __init__(self) -> None:
        self.statuses: Counter[str] = Counter()
        self.text_statuses: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = {}
        self.closed: Counter[str] = Counter()
        self.unfinished = 0  # questions still unanswered when the level and its drain time ended

    def error(self, event: dict[str, Any]) -> None:
        code = str(event.get("code", "?"))
        if event.get("fatal"):
            code += " (fatal)"
        self.errors[code] += 1
        seen = self.examples.setdefault(code, [])
        message = str(event.get("message", ""))[:200]
        if len(seen) < self.EXAMPLES and message not in seen:
            seen.append(message)

    def report(self) -> dict[str, Any]:
        return {
            "audio_done_status": dict(self.statuses),
            "text_done_status": dict(self.text_statuses),
            "error_codes": dict(self.errors),
            "error_examples": self.examples,
            "session_ends": dict(self.closed),
            "unfinished": self.unfinished,
        }


async def one_session(
    url: str, frames: list[str], args: argparse.Namespace, results: dict[str, list[float]], outcomes: Outcomes
) -> None:
    async with connect(url + ROUTE, max_size=None) as ws:
        # The route's default audio format (wav), as the page asks for it: the timings read no audio bytes.
        config = {"num_frames": args.num_frames, "max_new_tokens": args.max_new_tokens}
        await ws.send(json.dumps({"type": "session.config", **config}))
        loop = asyncio.get_running_loop()
        end = loop.time() + args.duration
        state: dict[str, Any] = {"asked": None, "text": False, "audio": False, "round": 0}
        # The speech session's segmenter (its default configuration) replayed over the text as it arrives: when it
        # would release the answer's first unit to the talker.
        timing: dict[str, Any] = {"segmenter": TextSegmenter(), "text_at": None, "unit_at": None}
        # A question is open until both its text and its audio terminal came: the next one waits for it (a new
        # question would cancel the answer in flight, and a slow answer would read as cancelled, not as slow).
        text_open, audio_open = asyncio.Event(), asyncio.Event()

        async def reader() -> None:
            with contextlib.suppress(ConnectionClosed):
                await read_events()
            outcomes.closed[f"server closed: {ws.close_code} {ws.close_reason or ''}".strip()] += 1

        async def read_events() -> None:
            async for message in ws:
                event = json.loads(message)
                kind = event["type"]
                asked = state["asked"]
                if kind == "error":
                    on_error(event)
                    continue
                if asked is None:
                    continue
                now = time.perf_counter()
                if kind == "response.text.delta" and timing["unit_at"] is None:
                    segmenter = timing["segmenter"]
                    if segmenter.push(event["delta"], now * 1000) or segmenter.poll(now * 1000):
                        timing["unit_at"] = now
                if kind == "response.text.delta" and not state["text"]:
                    state["text"] = True
                    timing["text_at"] = now
                    # A session's first question warms it up (reported apart: at many sessions it may be the only one)
                    key = "first_text" if state["round"] > 1 else "first_text_round1"
                    results[key].append(now - asked)
                elif kind == "response.audio.delta" and not state["audio"]:
                    state["audio"] = True
                    key = "first_audio" if state["round"] > 1 else "first_audio_round1"
                    results[key].append(now - asked)
                    if state["round"] > 1 and timing["text_at"] is not None:
                        unit_at = timing["unit_at"]
                        if unit_at is None:  # released by the segmenter's timer (max_wait_ms)
                            deadline = timing["segmenter"].next_deadline_ms()
                            unit_at = min(now, deadline / 1000) if deadline is not None else now
                        results["text_to_unit"].append(unit_at - timing["text_at"])
                        results["unit_to_audio"].append(now - unit_at)
                elif kind == "response.text.done":
                    if timing["unit_at"] is None:
                        timing["unit_at"] = now  # the answer's end flushes the segmenter
                    outcomes.text_statuses[event["status"]] += 1
                    text_open.clear()
                elif kind == "response.audio.done":
                    results["status_" + event["status"]].append(0.0)
                    outcomes.statuses[event["status"]] += 1
                    audio_open.clear()
                elif kind == "session.done":
                    outcomes.closed[str(event.get("reason"))] += 1

        def on_error(event: dict[str, Any]) -> None:
            outcomes.error(event)
            results["errors"].append(0.0)

        read = asyncio.create_task(reader())
        i = 0
        next_query = loop.time() + args.query_every * np.random.default_rng(hash(url) & 0xFFFF).random()
        try:
            while loop.time() < end:
                await ws.send(json.dumps({"type": "video.frame", "data": frames[i % len(frames)]}))
                i += 1
                if loop.time() >= next_query and not text_open.is_set() and not audio_open.is_set():
                    state.update(asked=time.perf_counter(), text=False, audio=False)
                    timing.update(segmenter=TextSegmenter(), text_at=None, unit_at=None)
                    text_open.set()
                    audio_open.set()
                    state["round"] += 1
                    await ws.send(json.dumps({"type": "video.query", "text": "What is moving in the picture?"}))
                    next_query = loop.time() + args.query_every
                await asyncio.sleep(1.0 / args.fps)  # the camera's frame rate (a client pacing, not synchronisation)
            # The level's time is up: no new question; the one still open may finish within --drain.
            drain_end = loop.time() + args.drain
            while (text_open.is_set() or audio_open.is_set()) and loop.time() < drain_end and not read.done():
                await ws.send(json.dumps({"type": "video.frame", "data": frames[i % len(frames)]}))
                i += 1
                await asyncio.sleep(1.0 / args.fps)
            if text_open.is_set() or audio_open.is_set():
                outcomes.unfinished += 1
        except ConnectionClosed:
            pass  # the server ended the session: the reader recorded why
        finally:
            read.cancel()


async def level(url: str, sessions: int, frames: list[str], args: argparse.Namespace) -> dict[str, Any]:
    from collections import defaultdict

    results: dict[str, list[float]] = defaultdict(list)
    outcomes = Outcomes()
    await asyncio.gather(*(one_session(url, frames, args, results, outcomes) for _ in range(sessions)))
    return {
        "sessions": sessions,
        "first_text_delta": summary(results["first_text"]),
        "first_audio_byte": summary(results["first_audio"]),
        "text_to_first_unit": summary(results["text_to_unit"]),
        "first_unit_to_audio": summary(results["unit_to_audio"]),
        "first_question": {
            "first_text_delta": summary(results["first_text_round1"]),
            "first_audio_byte": summary(results["first_audio_round1"]),
        },
        "completed": len(results["status_completed"]),
        "cancelled": len(results["status_cancelled"]),
        "failed": len(results["status_error"]),
        "errors": len(results["errors"]),
        **outcomes.report(),
    }


def encoder_cost(engine: Any, frames: int) -> dict[str, float]:
    """ms per frame of the vision tokens: every frame new, then the same frames again from the encoder cache."""
    from omnigate.engines.omni.request import EncoderCache, FrameInput

    model = engine.model
    rng = np.random.default_rng(0)
    inputs = [
        FrameInput(bytes([i % 256, i // 256]), rng.integers(0, 255, (model.frame_size, model.frame_size, 3), np.uint8))
        for i in range(frames)
    ]
    cache = EncoderCache(capacity=frames)
    request = type("R", (), {"frames": tuple(inputs), "cache": cache})()
    engine._frame_tokens([request])  # warm-up (kernels, allocator)
    cache = EncoderCache(capacity=frames)
    request.cache = cache
    sync = _sync(model)
    started = time.perf_counter()
    engine._frame_tokens([request])
    sync()
    fresh = (time.perf_counter() - started) / frames
    started = time.perf_counter()
    engine._frame_tokens([request])
    sync()
    reused = (time.perf_counter() - started) / frames
    return {
        "frames": frames,
        "tokens_per_frame": model.tokens_per_frame,
        "frame_size": model.frame_size,
        "new_frame_ms": round(fresh * 1000, 3),
        "unchanged_frame_ms": round(reused * 1000, 4),
    }


def qwen3_encoder_cost(chat: Any, frames: int) -> dict[str, float]:
    """ms per frame of Qwen3-Omni's vision encoder on new frames (an unchanged one costs a cache lookup)."""
    model = chat.turns.model
    size = chat.info.frame_size
    pictures = [np.random.default_rng(i).integers(0, 255, (size, size, 3), np.uint8) for i in range(frames)]
    model.encode_frames(pictures)  # warm-up (kernels, allocator)
    sync = _sync(model)
    sync()
    started = time.perf_counter()
    model.encode_frames(pictures)
    sync()
    return {
        "frames": frames,
        "tokens_per_frame": chat.info.tokens_per_frame,
        "frame_size": size,
        "new_frame_ms": round((time.perf_counter() - started) / frames * 1000, 3),
    }


def _sync(model: Any) -> Any:
    import torch

    if model.device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny omni preset and synthetic speech on the CPU")
    env = os.environ.get
    parser.add_argument("--device", default=env("BENCH_DEVICE", "cuda"), help="torch device of both engines")
    parser.add_argument("--dtype", default=env("BENCH_DTYPE", "bfloat16"), help="dtype of both engines")
    parser.add_argument("--speech-model", default=env("BENCH_SPEECH_MODEL", "preset:csm-1b"), help="talker --model")
    parser.add_argument("--omni-model", default=env("BENCH_OMNI_MODEL", "preset:qwen2.5-omni-3b"))
    parser.add_argument(
        "--engine",
        default="cascade",
        choices=["cascade", "qwen3-omni"],
        help="cascade: the omni thinker and a speech engine; qwen3-omni: serve --engine qwen3-omni --model MODEL",
    )
    parser.add_argument("--model", default="preset:qwen3-omni-30b-a3b", help="the qwen3-omni --model")
    parser.add_argument("--max-context", type=int, default=1024, help="the qwen3-omni engine's context per slot")
    parser.add_argument(
        "--admission",
        default=env("BENCH_ADMISSION", "slots"),
        choices=["slots", "headroom"],
        help="the talker's admission: slots (default) measures what the engines carry at every level; headroom "
        "refuses speech streams the talker would not keep on time (engine_busy), as a production gateway does",
    )
    parser.add_argument("--levels", default="1,16,64", help="session counts, comma-separated")
    parser.add_argument("--fps", type=float, default=2.0)
    parser.add_argument("--query-every", type=float, default=6.0, help="seconds between a session's questions")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per level")
    parser.add_argument(
        "--drain", type=float, default=30.0, help="seconds a level waits for the answers still open at its end"
    )
    parser.add_argument("--num-frames", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--encoder-frames", type=int, default=32)
    parser.add_argument(
        "--compare-before",
        action="store_true",
        help="run the levels again with the omni engine's encode_ahead off (frames encoded when a question asks)",
    )
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "video_chat_gpu.json")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    top = max(levels)
    qwen3 = args.engine == "qwen3-omni"
    if qwen3:
        options = {"device": args.device, "dtype": args.dtype, "max_sessions": str(top)}
        settings = Settings(
            engine="qwen3-omni",
            model=args.model,
            engine_options={**options, "max_context": str(args.max_context)},
            max_sessions=2 * top,
            idle_timeout_s=120.0,
        )
    elif args.tiny:
        settings = Settings(engine="synthetic", omni_model="preset:tiny", omni_options={"max_sessions": str(top)})
    else:
        placement = {"device": args.device, "dtype": args.dtype}
        settings = Settings(
            engine="talker",
            model=args.speech_model,
            engine_options={**placement, "max_sessions": str(top), "max_batch": str(top)},
            omni_model=args.omni_model,
            omni_options={**placement, "max_sessions": str(top)},
            max_sessions=2 * top,
            idle_timeout_s=120.0,
            admission=args.admission,
        )
    frames = camera_frames(24)
    report: dict[str, Any] = {
        "command": "python -m benchmarks.video_chat_gpu " + " ".join(sys.argv[1:]),
        "omni_model": settings.model if qwen3 else settings.omni_model,
        "speech_engine": "the model's own voice" if qwen3 else f"{settings.engine} {settings.model or ''}".strip(),
        "engine_options": settings.engine_options,
        "omni_options": settings.omni_options,
        "admission": settings.admission,
        "fps": args.fps,
        "query_every_s": args.query_every,
        "duration_s_per_level": args.duration,
        "num_frames": args.num_frames,
        "max_new_tokens": args.max_new_tokens,
    }
    if hasattr(os, "getloadavg"):
        report["load_before"] = os.getloadavg()
    with serve(settings) as server:
        engine = server.app.state.omni_engine
        report["tokens_per_frame"] = engine.info.tokens_per_frame
        if qwen3:
            report["levels"] = []
            for sessions in levels:
                encoded, reused, started = engine.frames_encoded_total, engine.frames_reused_total, time.perf_counter()
                calls = dataclasses.asdict(engine.turns.encoder.stats)
                result = asyncio.run(level(server.ws_url, sessions, frames, args))
                # The input encoder's forwards over the level and what they carried (the batching of its questions).
                after = dataclasses.asdict(engine.turns.encoder.stats)
                result["encoder_calls"] = {k: v if k.startswith("largest") else v - calls[k] for k, v in after.items()}
                result["frames_encoded"] = engine.frames_encoded_total - encoded
                result["frames_from_the_session_cache"] = engine.frames_reused_total - reused
                result["level_wall_s"] = round(time.perf_counter() - started, 1)
                print(json.dumps(result), flush=True)
                report["levels"].append(result)
            report["encoder"] = qwen3_encoder_cost(engine, args.encoder_frames)
        else:
            passes = [("levels", True), ("levels_before", False)] if args.compare_before else [("levels", True)]
            for key, ahead in passes:
                engine.ahead_enabled = ahead
                report[key] = [run_level(server, engine, sessions, frames, args) for sessions in levels]
            engine.ahead_enabled = True
            report["encoder"] = encoder_cost(engine, args.encoder_frames)
        print(json.dumps(report["encoder"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


# The thinker's counters whose change over a level is reported (``omni_`` and the name; seconds rounded to ms).
WORKER_COUNTERS = (
    "frames_encoded_total",
    "frames_ahead_total",
    "frames_ahead_dropped_total",
    "frames_reused_total",
    "encode_ahead_seconds_total",
    "encode_seconds_total",
    "prefill_seconds_total",
    "decode_seconds_total",
)


def run_level(server: Any, engine: Any, sessions: int, frames: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """One level of ``sessions`` clients, with the thinker's counters over it."""
    tokens, steps, rows = engine.tokens_total, engine.steps, engine.decode_rows_total
    prefill_tokens, started = engine.prefill_tokens_total, time.perf_counter()
    forwards, prompts, padded = (
        engine.stats.prefill_forwards,
        engine.stats.prefilled_prompts,
        engine.stats.padded_steps,
    )
    counters = {name: getattr(engine, name) for name in WORKER_COUNTERS}
    result = asyncio.run(level(server.ws_url, sessions, frames, args))
    wall = time.perf_counter() - started
    result["encode_ahead"] = engine.ahead_enabled
    for name, before in counters.items():
        result["omni_" + name.removesuffix("_total")] = round(getattr(engine, name) - before, 3)
    # One decode step advances every answer in flight by a token: the token rate is shared by them all.
    result["omni_steps"] = engine.steps - steps
    result["omni_tokens"] = engine.tokens_total - tokens
    result["omni_tokens_per_s"] = round(result["omni_tokens"] / wall, 1)
    result["omni_steps_per_s"] = round(result["omni_steps"] / wall, 1)
    result["omni_answers_per_step"] = round((engine.decode_rows_total - rows) / max(1, result["omni_steps"]), 2)
    result["omni_prefill_tokens"] = engine.prefill_tokens_total - prefill_tokens
    # Several questions' prompts share one prefill forward; padded steps replay a captured graph on CUDA.
    result["omni_prefill_forwards"] = engine.stats.prefill_forwards - forwards
    result["omni_prompts_per_prefill"] = round(
        (engine.stats.prefilled_prompts - prompts) / max(1, result["omni_prefill_forwards"]), 2
    )
    result["omni_padded_steps"] = engine.stats.padded_steps - padded
    result["level_wall_s"] = round(wall, 1)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
