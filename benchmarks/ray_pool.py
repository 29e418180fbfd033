"""Engines on Ray against the in-process pool, in one run on one machine:

1. added latency per chunk of the Ray hop (replica hands a message over -> it reaches the gateway's sink) beside
   the in-process pool's own hop (engine step returns -> its outputs reach the sink on the event loop), and the
   time from opening a stream to its first audio for both;
2. capacity of two engine replicas against one (realtime streams the engine tier sustains when saturated);
3. what a killed replica costs: streams failed, time until the gateway knows, until a new stream gets audio
   elsewhere, until Serve has replaced the replica.

The engine is the synthetic accelerator model (a batched step blocks its scheduler for ``rtf`` x the chunk), on a
Ray cluster of a head and two worker nodes on loopback, one replica per worker. This process is the gateway.
Writes ``docs/benchmarks/ray.json``. Run from the repository root:

    .venv/bin/python benchmarks/ray_pool.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.cluster_utils import Cluster

from omnigate.engines.base import AudioChunk, EngineOutput, EngineStream, StreamDone, SynthesisParams
from omnigate.engines.pool import EnginePool
from omnigate.engines.remote import admin
from omnigate.engines.remote.pool import RemoteEnginePool
from omnigate.engines.remote.serve import EngineAppArgs, ServeDirectory
from omnigate.engines.synthetic import SyntheticEngine

OUTPUT = Path("docs/benchmarks/ray.json")
TONE = SynthesisParams(voice="tone", max_audio_ms=600_000)
# Realtime-paced streams for the latency run: 40 ms chunks, each step blocks for its chunk's duration.
LATENCY_SPEC = "chunk_ms=40,rtf=1.0,max_sessions=64,max_batch=64"
# A batched accelerator for the capacity run: a step serves up to 8 streams and costs half its chunk, so one
# replica sustains about 16 realtime streams.
CAPACITY_SPEC = "chunk_ms=40,rtf=0.5,max_sessions=256,max_batch=8"
TEXT = "x" * 2000  # 120 s of audio: longer than any run


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary_ms(seconds: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000.0 for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 0.50), 3),
        "p90_ms": round(percentile(ms, 0.90), 3),
        "p99_ms": round(percentile(ms, 0.99), 3),
        "mean_ms": round(statistics.fmean(ms), 3),
    }


class StampingEngine(SyntheticEngine):
    """Records when each chunk's step returned, to time the in-process hop to the sink."""

    def __init__(self, engine: SyntheticEngine) -> None:
        super().__init__(engine.config)
        self.stamps: dict[int, float] = {}

    def step(self, streams: Sequence[EngineStream], budget_ms: Sequence[float]) -> list[list[EngineOutput]]:
        outputs = super().step(streams, budget_ms)
        now = time.monotonic()
        for out in outputs:
            for item in out:
                if isinstance(item, AudioChunk):
                    self.stamps[id(item)] = now
        return outputs


class Stream:
    """A sink that counts audio and notes first audio and the end."""

    def __init__(self, on_chunk: Callable[[AudioChunk], None] | None = None) -> None:
        self.opened = time.monotonic()
        self.first_audio: float | None = None
        self.audio_ms = 0.0
        self.done: StreamDone | None = None
        self.started = asyncio.Event()
        self.ended = asyncio.Event()
        self._on_chunk = on_chunk

    def __call__(self, outputs: list[EngineOutput]) -> None:
        for item in outputs:
            if isinstance(item, AudioChunk):
                if self.first_audio is None:
                    self.first_audio = time.monotonic()
                    self.started.set()
                self.audio_ms += item.duration_ms
                if self._on_chunk is not None:
                    self._on_chunk(item)
            elif isinstance(item, StreamDone):
                self.done = item
                self.ended.set()


async def run_streams(
    pool: Any, count: int, seconds: float, on_chunk: Callable[[AudioChunk], None] | None
) -> list[Stream]:
    streams = []
    handles = []
    for _ in range(count):
        sink = Stream(on_chunk)
        handle = pool.open(TONE, sink, initial_credit_ms=1e9)
        pool.push_text(handle, TEXT)
        pool.end_input(handle)
        streams.append(sink)
        handles.append(handle)
    await asyncio.sleep(seconds)
    for handle in handles:
        pool.abort(handle)
    return streams


async def latency(remote: RemoteEnginePool, sessions: int, seconds: float) -> dict[str, Any]:
    local_engine = StampingEngine(SyntheticEngine.from_spec(LATENCY_SPEC))
    local = EnginePool(local_engine)
    local.start()
    local_hops: list[float] = []

    def local_chunk(chunk: AudioChunk) -> None:
        stamp = local_engine.stamps.pop(id(chunk), None)
        if stamp is not None:
            local_hops.append(time.monotonic() - stamp)

    try:
        local_streams = await run_streams(local, sessions, seconds, local_chunk)
    finally:
        await asyncio.to_thread(local.stop)
    remote_hops: list[float] = []
    remote._observe_hop = remote_hops.append
    try:
        remote_streams = await run_streams(remote, sessions, seconds, None)
    finally:
        remote._observe_hop = None

    def first_audio(streams: list[Stream]) -> list[float]:
        return [s.first_audio - s.opened for s in streams if s.first_audio is not None]

    return {
        "sessions": sessions,
        "seconds": seconds,
        "in_process_hop": summary_ms(local_hops),
        "ray_added_hop": summary_ms(remote_hops),
        "open_to_first_audio_in_process": summary_ms(first_audio(local_streams)),
        "open_to_first_audio_ray": summary_ms(first_audio(remote_streams)),
    }


async def capacity(remote: RemoteEnginePool, streams: int, seconds: float) -> dict[str, Any]:
    """Realtime streams sustained: audio produced per second of wall time, the engines saturated."""
    await remote.refresh()
    started = time.monotonic()
    sinks = await run_streams(remote, streams, seconds, None)
    wall = time.monotonic() - started
    produced_s = sum(s.audio_ms for s in sinks) / 1000.0
    per_stream = sorted(s.audio_ms / 1000.0 / wall for s in sinks)
    return {
        "replicas": remote.replicas_up,
        "streams": streams,
        "seconds": round(wall, 2),
        "realtime_streams_sustained": round(produced_s / wall, 2),
        "slowest_stream_x_realtime": round(per_stream[0], 3),
        "fastest_stream_x_realtime": round(per_stream[-1], 3),
    }


async def killed_replica(remote: RemoteEnginePool, sessions: int) -> dict[str, Any]:
    await remote.refresh()
    sinks: list[Stream] = []
    handles = []
    for _ in range(sessions):
        sink = Stream()
        handle = remote.pin_session().open(TONE, sink, initial_credit_ms=1e9)
        remote.push_text(handle, TEXT)
        remote.end_input(handle)
        sinks.append(sink)
        handles.append(handle)
    await asyncio.wait_for(asyncio.gather(*(s.started.wait() for s in sinks)), 60)
    victim = handles[0].replica
    on_victim = sum(1 for h in handles if h.replica == victim)
    pid = (await asyncio.to_thread(admin.replica_stats, victim)).pid
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    failed = [s for s, h in zip(sinks, handles, strict=True) if h.replica == victim]
    await asyncio.wait_for(asyncio.gather(*(s.ended.wait() for s in failed)), 60)
    known = time.monotonic() - killed
    fresh = Stream()
    handle = remote.open(TONE, fresh, initial_credit_ms=1e9)
    remote.push_text(handle, "x" * 20)
    remote.end_input(handle)
    await asyncio.wait_for(fresh.ended.wait(), 60)
    assert fresh.first_audio is not None
    new_stream_audio = fresh.first_audio - killed
    while remote.replicas_up < 2:
        await remote.refresh()
        await asyncio.sleep(0.2)
    replaced = time.monotonic() - killed
    survivors_failed = sum(1 for s, h in zip(sinks, handles, strict=True) if h.replica != victim and s.done is not None)
    for h in handles:
        remote.abort(h)
    return {
        "sessions": sessions,
        "on_killed_replica": on_victim,
        "failed": sum(1 for s in failed if s.done is not None and s.done.reason == "error"),
        "failed_error": failed[0].done.error if failed[0].done is not None else None,
        "other_sessions_failed": survivors_failed,
        "gateway_knows_s": round(known, 3),
        "new_stream_first_audio_s": round(new_stream_audio, 3),
        "serve_replaced_replica_s": round(replaced, 2),
        "fresh_stream_replica": handle.replica,
        "victim": victim,
    }


def start_cluster(workers: int) -> Cluster:
    os.environ["RAY_AUTH_MODE"] = "disabled"
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"node_ip_address": "127.0.0.2", "num_cpus": 1, "include_dashboard": False},
    )
    for i in range(workers):
        cluster.add_node(node_ip_address=f"127.0.0.{3 + i}", num_cpus=1, resources={"engine_slot": 1.0})
    admin.connect(cluster.address)
    serve.start(proxy_location="Disabled")
    return cluster


def deploy(spec: str, replicas: int) -> None:
    for name in admin.engine_apps():
        serve.delete(name)
    args = EngineAppArgs(engine="synthetic", model=spec, num_cpus=0.1, resources={"engine_slot": 1.0})
    admin.deploy(args, replicas)


async def connect_pool() -> RemoteEnginePool:
    pool = RemoteEnginePool(ServeDirectory(), poll_interval_s=1.0)
    await pool.start(60.0)
    return pool


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {}
    await asyncio.to_thread(deploy, LATENCY_SPEC, 1)
    pool = await connect_pool()
    try:
        report["latency"] = [await latency(pool, n, args.seconds) for n in (1, 16)]
    finally:
        await pool.close()
    report["capacity"] = []
    for replicas in (1, 2):
        await asyncio.to_thread(deploy, CAPACITY_SPEC, replicas)
        pool = await connect_pool()
        try:
            report["capacity"].append(await capacity(pool, args.capacity_streams, args.seconds))
        finally:
            await pool.close()
    one, two = report["capacity"]
    report["capacity_ratio_two_vs_one"] = round(
        two["realtime_streams_sustained"] / one["realtime_streams_sustained"], 2
    )
    await asyncio.to_thread(deploy, LATENCY_SPEC, 2)
    pool = await connect_pool()
    try:
        report["killed_replica"] = await killed_replica(pool, args.kill_sessions)
    finally:
        await pool.close()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds per latency and capacity run")
    parser.add_argument("--capacity-streams", type=int, default=64, help="streams that saturate the engines")
    parser.add_argument("--kill-sessions", type=int, default=16)
    parser.add_argument("--out", type=Path, default=OUTPUT)
    args = parser.parse_args()
    cluster = start_cluster(workers=2)
    try:
        results = asyncio.run(measure(args))
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    report = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "ray": ray.__version__},
        "setup": {
            "cluster": "head + 2 worker nodes on loopback (ray.cluster_utils.Cluster), one replica per worker",
            "latency_engine": LATENCY_SPEC,
            "capacity_engine": CAPACITY_SPEC,
        },
        **results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
