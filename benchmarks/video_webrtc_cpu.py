"""Time to first frame of generated video on the CPU (``tiny`` preset): WebRTC video track vs WebSocket fMP4.

Starts the real server (``omnigate serve --video-model preset:tiny``, uvloop, its own process group, one torch
thread) on a free loopback port and alternates the two transports, one generation at a time, same clip, same seed:

- **WebSocket** (``WS /v1/realtime/video``): from sending ``video.create`` to receiving the first fMP4 fragment
  (the binary message after the init segment), which holds the first frame;
- **WebRTC** (``POST /v1/realtime/video/calls``, an aiortc client peer): the call is set up first (not counted);
  from sending ``video.create`` on the data channel to the first frame of the requested size decoded from the
  track (the track's idle frame is flat black at the model's default size; generated frames are noise).

Both also report the server's own ``first_frame_sent_ms`` from ``video.done`` (admission to the first frame sent or
played). Writes ``docs/benchmarks/video_webrtc_cpu.json``. From the repository root:

    .venv/bin/python -m benchmarks.video_webrtc_cpu
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import httpx
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from websockets.asyncio.client import connect

from omnigate.loadtest.targets.webrtc import use_loopback_candidates

OUTPUT = Path("docs/benchmarks/video_webrtc_cpu.json")
# A generated (noise) frame has a luma standard deviation around 10-20; the idle black frame has 0.
FLAT_LUMA_STD = 2.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def server() -> Iterator[str]:
    """``omnigate serve`` with the tiny video model, in its own process group; yields its URL."""
    port = free_port()
    command = [sys.executable, "-m", "omnigate.gateway.cli", "serve", "--port", str(port), "--log-level", "warning"]
    command += ["--engine", "synthetic", "--video-model", "preset:tiny", "-V", "max_sessions=1"]
    command += ["--webrtc-host-address", "127.0.0.1"]
    process = subprocess.Popen(command, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
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
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)


async def websocket_run(url: str, create: dict[str, Any]) -> dict[str, Any]:
    """One generation over ``WS /v1/realtime/video``."""
    async with connect(url.replace("http", "ws", 1) + "/v1/realtime/video", max_size=None) as ws:
        began = time.perf_counter()
        await ws.send(json.dumps(create))
        binary = 0
        first_frame_s: float | None = None
        while True:
            message = await ws.recv()
            if isinstance(message, bytes):
                binary += 1
                if binary == 2:  # the init segment, then the first fragment
                    first_frame_s = time.perf_counter() - began
                continue
            event = json.loads(message)
            if event["type"] == "video.done":
                return result(event, first_frame_s)
            if event["type"] == "error":
                raise RuntimeError(f"the server refused: {event}")


class VideoCallClient:
    """An aiortc peer on ``POST /v1/realtime/video/calls``: the ``video`` channel's events, the track's frames."""

    def __init__(self, width: int, height: int) -> None:
        self.size = (width, height)
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.pc.addTransceiver("video", direction="recvonly")
        self.channel = self.pc.createDataChannel("video")
        self.opened = asyncio.Event()
        self.done: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.first_frame_at: float | None = None
        self._reader: asyncio.Task[None] | None = None
        self.channel.on("open", self.opened.set)
        self.channel.on("message", self._on_message)
        self.pc.on("track", self._on_track)

    async def connect(self, url: str) -> None:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        assert self.pc.localDescription is not None
        async with httpx.AsyncClient(trust_env=False) as client:
            response = await client.post(
                url + "/v1/realtime/video/calls",
                content=self.pc.localDescription.sdp,
                headers={"content-type": "application/sdp"},
            )
        response.raise_for_status()
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=response.text, type="answer"))
        await asyncio.wait_for(self.opened.wait(), 30)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        await self.pc.close()

    def _on_message(self, message: str | bytes) -> None:
        event = json.loads(message)
        if event["type"] in ("video.done", "error") and not self.done.done():
            self.done.set_result(event)

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "video" and self._reader is None:
            self._reader = asyncio.create_task(self._read(track))

    async def _read(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            assert isinstance(frame, av.VideoFrame)
            generated = (frame.width, frame.height) == self.size and frame.to_ndarray(
                format="gray"
            ).std() > FLAT_LUMA_STD
            if self.first_frame_at is None and generated:
                self.first_frame_at = time.perf_counter()


async def webrtc_run(url: str, create: dict[str, Any]) -> dict[str, Any]:
    """One generation over a video call (set up first, not counted)."""
    client = VideoCallClient(create["width"], create["height"])
    try:
        setup_began = time.perf_counter()
        await client.connect(url)
        setup_s = time.perf_counter() - setup_began
        began = time.perf_counter()
        client.channel.send(json.dumps(create))
        event = await asyncio.wait_for(client.done, 600)
        if event["type"] == "error":
            raise RuntimeError(f"the server refused: {event}")
        # The last frames may still be decoding on this side; the first one came long before video.done.
        first = None if client.first_frame_at is None else client.first_frame_at - began
        return {**result(event, first), "call_setup_s": setup_s}
    finally:
        await client.close()


def result(done: dict[str, Any], first_frame_s: float | None) -> dict[str, Any]:
    if done["status"] != "completed" or first_frame_s is None:
        raise RuntimeError(f"the generation did not complete with a frame: {done}")
    stats = done["stats"]
    return {
        "time_to_first_frame_s": round(first_frame_s, 4),
        "server_first_frame_sent_ms": stats["first_frame_sent_ms"],
        "server_total_ms": stats["total_ms"],
        "decoded_before_first_send": stats["decoded_before_first_send"],
        "frames": done["frames"],
    }


async def measure(url: str, create: dict[str, Any], repeats: int) -> dict[str, list[dict[str, Any]]]:
    use_loopback_candidates()
    await websocket_run(url, {**create, "seed": 0})  # warm-up: first use of the model and encoders
    await webrtc_run(url, {**create, "seed": 0})
    runs: dict[str, list[dict[str, Any]]] = {"websocket": [], "webrtc": []}
    for _ in range(repeats):  # alternated, so a change in the machine's load falls on both
        runs["websocket"].append(await websocket_run(url, create))
        runs["webrtc"].append(await webrtc_run(url, create))
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUTPUT)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--height", type=int, default=128)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--fps", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    create = {
        "type": "video.create",
        "prompt": "a red fox running through fresh snow",
        "width": args.width,
        "height": args.height,
        "num_frames": args.frames,
        "fps": args.fps,
        "steps": args.steps,
        "seed": 1,
    }
    with server() as url:
        runs = asyncio.run(measure(url, create, args.repeats))
    medians = {
        transport: {
            key: statistics.median(run[key] for run in transport_runs) for key in transport_runs[0] if key != "frames"
        }
        for transport, transport_runs in runs.items()
    }
    report = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "server_torch_threads": 1,
            "load_average_at_end": os.getloadavg(),
        },
        "clip": {key: value for key, value in create.items() if key not in ("type", "prompt")},
        "repeats": args.repeats,
        "median": medians,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    ws, rtc = medians["websocket"], medians["webrtc"]
    print(
        f"tiny {args.width}x{args.height} {args.frames} frames, {args.steps} steps: time to first frame "
        f"WebSocket {ws['time_to_first_frame_s']:.3f} s, WebRTC {rtc['time_to_first_frame_s']:.3f} s "
        f"(call setup {rtc['call_setup_s']:.3f} s, not counted)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
