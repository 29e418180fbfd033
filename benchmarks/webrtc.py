"""WebRTC transport: sessions per core, CPU per session, TTFA over WebRTC vs WebSocket, Opus encoding cost.

Every measurement drives the real server (``omnigate serve`` on uvloop, in its own process group) with the load-test
CLI (``omnigate-loadtest``, in another process group; aiortc client peers for ``--target webrtc``). The server's CPU
is read with psutil around each level. Writes ``docs/benchmarks/webrtc.json``. From the repository root:

    .venv/bin/python benchmarks/webrtc.py all
    .venv/bin/python benchmarks/webrtc.py capacity --levels 10,20,30,40 --duration 20
    .venv/bin/python benchmarks/webrtc.py ttfa --duration 40
    .venv/bin/python benchmarks/webrtc.py encode
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
from aiortc import rtp
from aiortc.codecs.opus import OpusEncoder

from omnigate.codecs.resample import pcm_to_frame
from omnigate.codecs.rtc_audio import RtcOpusStream

OUTPUT = Path("docs/benchmarks/webrtc.json")
# Short replies (about two seconds of speech each): WebRTC plays out in real time, so long texts give few samples.
TTFA_CORPUS = Path(__file__).with_name("webrtc_ttfa_corpus.txt")
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def server(*options: str) -> Iterator[tuple[str, psutil.Process]]:
    """``omnigate serve`` in its own process group on a free loopback port; yields its URL and process."""
    port = free_port()
    command = [PYTHON, "-m", "omnigate.gateway.cli", "serve", "--port", str(port), "--log-level", "warning"]
    command += ["--webrtc-host-address", "127.0.0.1", *options]
    process = subprocess.Popen(command, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not become ready")
            time.sleep(0.2)
        yield url, psutil.Process(process.pid)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)


ACTIVE = re.compile(r'^omnigate_sessions_active\{transport="([a-z-]+)"\} ([0-9.]+)$', re.MULTILINE)


def active_sessions(url: str) -> float:
    """Live sessions of every transport, from the server's /metrics."""
    with contextlib.suppress(httpx.HTTPError):
        text = httpx.get(url + "/metrics", timeout=2).text
        return sum(float(value) for _, value in ACTIVE.findall(text))
    return 0.0


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def load_level(url: str, server_process: psutil.Process, sessions: int, *arguments: str) -> dict[str, Any]:
    """One ``omnigate-loadtest run`` in its own process group: the report's level, and the CPU of server and
    client measured over the samples (every 0.5 s) where all ``sessions`` were live on the server."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "report.json"
        command = [PYTHON, "-m", "omnigate.loadtest.cli", "run", url, *arguments, "--out", str(out), "--quiet"]
        command += ["--server-pid", str(server_process.pid)]
        client = subprocess.Popen(command, start_new_session=True)
        client_process = psutil.Process(client.pid)
        samples: list[tuple[float, float, float, bool]] = []  # time, server CPU s, client CPU s, all live
        while client.poll() is None:
            with contextlib.suppress(psutil.Error):
                full = active_sessions(url) >= sessions
                samples.append((time.monotonic(), cpu_seconds(server_process), cpu_seconds(client_process), full))
            time.sleep(0.5)
        if client.returncode not in (0, 1):  # 1: a level missed the SLO, which the benchmark reports
            raise RuntimeError(f"omnigate-loadtest failed with {client.returncode}")
        report = json.loads(out.read_text())
    wall = server_cpu = client_cpu = 0.0
    for before, after in itertools.pairwise(samples):
        if before[3] and after[3]:
            wall += after[0] - before[0]
            server_cpu += after[1] - before[1]
            client_cpu += after[2] - before[2]
    level: dict[str, Any] = report["levels"][0]
    return {
        "level": level,
        "full_load_s": wall,
        "server_cpu_cores": server_cpu / wall if wall else float("nan"),
        "client_cpu_cores": client_cpu / wall if wall else float("nan"),
    }


def metric_delta(level: dict[str, Any], name: str) -> float:
    for entry in level.get("server_metrics") or []:
        if entry["name"] == name:
            return float(entry["delta"])
    return 0.0


def server_ttfa_ms(level: dict[str, Any]) -> float | None:
    """Mean server-side TTFA (engine stream opened to first audio leaving the outbox) over the level."""
    transport = "webrtc" if level["target"]["target"] == "webrtc" else "ws-speech"
    count = metric_delta(level, f'omnigate_ttfa_seconds_count{{transport="{transport}"}}')
    total = metric_delta(level, f'omnigate_ttfa_seconds_sum{{transport="{transport}"}}')
    return round(1000 * total / count, 1) if count else None


def summarize(result: dict[str, Any], sessions: int) -> dict[str, Any]:
    level = result["level"]
    return {
        "sessions": sessions,
        "full_load_s": round(result["full_load_s"], 1),
        "server_cpu_cores": round(result["server_cpu_cores"], 3),
        "server_cpu_percent_per_session": round(100 * result["server_cpu_cores"] / sessions, 2),
        "client_cpu_cores": round(result["client_cpu_cores"], 3),
        "utterances": level["utterances"]["total"],
        "utterances_with_underruns": level["utterances"]["with_underruns"],
        "client_underruns": level["underruns"],
        "server_underrun_frames": metric_delta(level, 'omnigate_webrtc_frames_total{kind="underrun"}'),
        "server_skipped_frames": metric_delta(level, 'omnigate_webrtc_frames_total{kind="skipped"}'),
        "server_audio_frames": metric_delta(level, 'omnigate_webrtc_frames_total{kind="audio"}'),
        "ttfa_ms_p50": _round(level["ttfa_ms"].get("p50")),
        "ttfa_ms_p90": _round(level["ttfa_ms"].get("p90")),
        "ttfa_ms_p99": _round(level["ttfa_ms"].get("p99")),
        "ttfa_count": level["ttfa_ms"].get("count", 0),
        "server_ttfa_ms_mean": server_ttfa_ms(level),
        "gap_ms_p99": _round(level["gap_ms"].get("p99")),
        "gap_ms_max": _round(level["gap_ms"].get("max")),
        "connect_ms_p50": _round(level["connect_ms"].get("p50")),
        "errors": level["errors"],
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def capacity(levels: list[int], duration: float) -> dict[str, Any]:
    """Closed loops of N WebRTC sessions speaking the corpus through the synthetic engine (real-time pacing)."""
    rows = []
    with server("--engine", "synthetic", "--max-sessions", "1000") as (url, process):
        for sessions in levels:
            arguments = ["--target", "webrtc", "--sessions", str(sessions), "--duration", str(duration)]
            arguments += ["--warmup", "4", "--ramp", "2", "--drain", "15"]
            row = summarize(load_level(url, process, sessions, *arguments), sessions)
            row["load_average_1m_after"] = round(os.getloadavg()[0], 2)  # the host is shared: how busy it was
            print(json.dumps(row), flush=True)
            rows.append(row)
    return {"engine": "synthetic (tone, rtf 0)", "duration_s": duration, "levels": rows}


def ttfa(duration: float) -> dict[str, Any]:
    """One session at a time speaking short replies over WebRTC and over WebSocket, alternating, with the piper
    voice and with the synthetic engine (no model time: what is left is what the transport adds)."""
    out: dict[str, Any] = {"duration_s": duration, "corpus": TTFA_CORPUS.name}
    for engine in ("piper", "synthetic"):
        runs: dict[str, list[dict[str, Any]]] = {}
        with server("--engine", engine) as (url, process):
            for target in ("webrtc", "ws-speech", "webrtc", "ws-speech"):
                arguments = ["--target", target, "--sessions", "1", "--duration", str(duration), "--warmup", "3"]
                arguments += ["--corpus", str(TTFA_CORPUS), "--utterances-per-session", "5"]
                row = summarize(load_level(url, process, 1, *arguments), 1)
                row["load_average_1m_after"] = round(os.getloadavg()[0], 2)
                print(json.dumps({"engine": engine, "target": target, **row}), flush=True)
                runs.setdefault(target, []).append(row)
        out[engine] = runs
    return out


def encode(repeats: int = 7) -> dict[str, Any]:
    """Cost of Opus for one 20 ms frame: this gateway's path vs aiortc's own encoder path, and a thread hop.

    Medians over ``repeats`` interleaved runs, since the host is shared.
    """
    rate, chunk_ms, frames = 22_050, 100, 250
    t = np.arange(rate * frames * 20 // 1000) / rate
    pcm = (np.sin(2 * np.pi * 220 * t) * 8000).astype("<i2").tobytes()
    chunk = rate * chunk_ms // 1000 * 2
    tone48 = (np.sin(2 * np.pi * 220 * np.arange(48_000 * frames // 50) / 48_000) * 8000).astype("<i2").tobytes()
    av_frames = [pcm_to_frame(tone48[i : i + 1920], 48_000, i // 2) for i in range(0, len(tone48), 1920)]

    def ours() -> float:
        stream = RtcOpusStream(rate)
        start = time.perf_counter()
        for i in range(0, len(pcm), chunk):
            stream.encode(pcm[i : i + chunk])
        return (time.perf_counter() - start) / stream.packets_out * 1e6

    def aiortc_encoder() -> float:
        # aiortc's path for a track that returns frames: its encoder (own resampler to stereo, 96 kbit/s), run
        # in the default executor, after the audio level is computed on the loop.
        encoder = OpusEncoder()
        start = time.perf_counter()
        for frame in av_frames:
            encoder.encode(frame)
        return (time.perf_counter() - start) / len(av_frames) * 1e6

    def aiortc_level() -> float:
        start = time.perf_counter()
        for frame in av_frames:
            rtp.compute_audio_level_dbov(frame)
        return (time.perf_counter() - start) / len(av_frames) * 1e6

    async def hops(count: int) -> float:
        loop = asyncio.get_running_loop()
        start_cpu = time.thread_time()
        for _ in range(count):
            await loop.run_in_executor(None, int)
        return (time.thread_time() - start_cpu) / count * 1e6

    import uvloop

    runs: dict[str, list[float]] = {"ours": [], "aiortc_encode": [], "aiortc_level": [], "hop": []}
    for _ in range(repeats):
        runs["ours"].append(ours())
        runs["aiortc_encode"].append(aiortc_encoder())
        runs["aiortc_level"].append(aiortc_level())
        runs["hop"].append(uvloop.run(hops(1000)))
    median = {name: round(statistics.median(values), 1) for name, values in runs.items()}
    return {
        "ours_us_per_frame": median["ours"],
        "ours_note": "mono 32 kbit/s, resampled from 22.05 kHz, in a worker thread, one hop per engine chunk",
        "aiortc_encode_us_per_frame": median["aiortc_encode"],
        "aiortc_audio_level_us_per_frame_on_loop": median["aiortc_level"],
        "thread_hop_loop_cpu_us": median["hop"],
        "frames_per_hop_piper": chunk_ms // 20,
        "frames_per_hop_synthetic": 2,
        "repeats": repeats,
        "load_average_1m_after": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["all", "capacity", "ttfa", "encode"])
    parser.add_argument("--levels", default="5,10,20,30,40")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=OUTPUT)
    args = parser.parse_args()
    report: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    report["host"] = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_average_at_start": os.getloadavg(),
    }
    if args.what in ("all", "encode"):
        report["encode"] = encode()
        print(json.dumps(report["encode"]), flush=True)
    if args.what in ("all", "ttfa"):
        report["ttfa"] = ttfa(args.duration)
    if args.what in ("all", "capacity"):
        # Runs accumulate: on a shared host one run says little about the next.
        report.pop("capacity", None)
        report.setdefault("capacity_runs", []).append(capacity([int(n) for n in args.levels.split(",")], args.duration))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
