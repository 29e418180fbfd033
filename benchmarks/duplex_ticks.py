"""Lockstep tick timing of a duplex model: what one batched 80 ms step costs for B sessions, and whether a real-time
clock keeps up. Needs only torch, transformers and numpy (the GPU script runs where msgspec is not installed).

A tick is missed when its step ends after the next tick was due (the engine clock's definition): the sessions'
output then falls behind real time.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from omnigate.engines.duplex.frames import FrameModel

FRAME_SAMPLES = 1920


@dataclass(frozen=True)
class BatchTiming:
    """Back-to-back steps of ``batch`` sessions."""

    batch: int
    steps: int
    step_ms_p50: float
    step_ms_p90: float
    step_ms_p99: float
    step_ms_max: float
    over_frame: int  # steps longer than one frame: each would be a missed tick
    frames_per_s: float  # session-frames produced per second of compute

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PacedRun:
    """Ticks on a real-time clock (deadline every frame), as the engine's clock runs them."""

    batch: int
    ticks: int
    late_ticks: int
    missed_ticks: int
    step_ms_p99: float
    step_ms_max: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@contextlib.contextmanager
def gil_contention(threads: int, *, burst_us: float = 200.0, idle_us: float = 600.0) -> Iterator[None]:
    """``threads`` threads that hold the GIL in bursts of pure-Python work with short sleeps between, as a loaded
    server's event loop and codec threads do (each about 25 % of the GIL at the defaults). A step that hands the GIL
    away often (every eagerly launched op does) waits behind them; a step of a few graph replays hardly does."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            end = time.perf_counter() + burst_us / 1e6
            while time.perf_counter() < end:
                pass
            time.sleep(idle_us / 1e6)

    workers = [threading.Thread(target=spin, name=f"gil-contention-{i}", daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    try:
        yield
    finally:
        stop.set()
        for worker in workers:
            worker.join()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    index = min(len(ordered) - 1, max(0, round(q / 100.0 * (len(ordered) - 1))))
    return ordered[index]


def _audio(rng: np.random.Generator, batch: int) -> np.ndarray:
    return (rng.standard_normal((batch, FRAME_SAMPLES)) * 2000.0).astype(np.int16)


def _start(frames: FrameModel, batch: int) -> list[int]:
    slots = list(range(batch))
    for slot in slots:
        frames.reset(slot, seed=slot + 1)
    return slots


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_batch(
    frames: FrameModel, batch: int, *, steps: int, warmup: int, frame_ms: float, seed: int = 0
) -> BatchTiming:
    """``steps`` timed steps of ``batch`` fresh sessions after ``warmup`` untimed ones."""
    rng = np.random.default_rng(seed)
    slots = _start(frames, batch)
    for _ in range(warmup):
        frames.step(slots, _audio(rng, batch))
    _sync(frames.device)
    times: list[float] = []
    for _ in range(steps):
        pcm = _audio(rng, batch)
        t0 = time.perf_counter()
        frames.step(slots, pcm)  # ends with the output on the host: the step is complete
        times.append((time.perf_counter() - t0) * 1000.0)
    return BatchTiming(
        batch=batch,
        steps=steps,
        step_ms_p50=statistics.median(times),
        step_ms_p90=percentile(times, 90),
        step_ms_p99=percentile(times, 99),
        step_ms_max=max(times),
        over_frame=sum(1 for t in times if t > frame_ms),
        frames_per_s=batch * 1000.0 / statistics.fmean(times),
    )


def paced(frames: FrameModel, batch: int, *, seconds: float, frame_ms: float, seed: int = 0) -> PacedRun:
    """Run ``batch`` sessions on a real-time tick clock for ``seconds``; count late and missed ticks."""
    rng = np.random.default_rng(seed)
    slots = _start(frames, batch)
    frame_s = frame_ms / 1000.0
    frames.step(slots, _audio(rng, batch))  # first-step allocations are not a tick
    times: list[float] = []
    late = missed = 0
    deadline = time.perf_counter()
    end = deadline + seconds
    while deadline < end:
        now = time.perf_counter()
        if now < deadline:
            time.sleep(deadline - now)
        pcm = _audio(rng, batch)
        t0 = time.perf_counter()
        frames.step(slots, pcm)
        done = time.perf_counter()
        times.append((done - t0) * 1000.0)
        due = deadline + frame_s
        if done > due:
            late += 1
        deadline = due
        behind = int((done - deadline) / frame_s)
        if behind >= 1:  # the engine clock drops a backlog of whole ticks instead of bursting them
            missed += behind
            deadline += behind * frame_s
    return PacedRun(
        batch=batch,
        ticks=len(times),
        late_ticks=late,
        missed_ticks=missed,
        step_ms_p99=percentile(times, 99),
        step_ms_max=max(times),
    )


def largest_within(timings: list[BatchTiming]) -> int:
    """The largest batch none of whose timed steps took longer than a frame (0 if none)."""
    fitting = [t.batch for t in timings if t.over_frame == 0]
    return max(fitting, default=0)


STAGES = (
    "duplex/encode",
    "duplex/think",
    "duplex/temporal",
    "duplex/text",
    "duplex/depth",
    "duplex/decode",
    "duplex/to_host",
)


def profile_stages(frames: FrameModel, batch: int, *, steps: int, seed: int = 0) -> dict[str, dict[str, float]]:
    """Per tick and stage: host time (launching and Python) and device time, in ms, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    rng = np.random.default_rng(seed)
    slots = _start(frames, batch)
    for _ in range(3):
        frames.step(slots, _audio(rng, batch))
    activities = [ProfilerActivity.CPU]
    if frames.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            frames.step(slots, _audio(rng, batch))
        _sync(frames.device)
    stages: dict[str, dict[str, float]] = {}
    for event in prof.key_averages():
        if event.key in STAGES:
            device_us = getattr(event, "device_time_total", 0.0) or getattr(event, "cuda_time_total", 0.0)
            stages[event.key] = {
                "host_ms": event.cpu_time_total / 1000.0 / steps,
                "device_ms": device_us / 1000.0 / steps,
            }
    return stages


def graphs_match_eager(frames: FrameModel, batch: int, *, steps: int) -> bool:
    """Whether replayed graphs (codec stages and model) produce the tokens eager steps produce, and the same audio
    to within 2 of 32767, for the same fresh sessions and input."""
    tokens: list[list[list[int]]] = []
    audio: list[np.ndarray] = []
    for graphs in (False, True):
        frames.use_graphs = graphs
        rng = np.random.default_rng(7)
        slots = _start(frames, batch)
        outs = [frames.step(slots, _audio(rng, batch)) for _ in range(steps)]
        tokens.append([out.text for out in outs])
        audio.append(np.stack([out.pcm for out in outs]).astype(np.int64))
    return tokens[0] == tokens[1] and int(np.abs(audio[0] - audio[1]).max()) <= 2
