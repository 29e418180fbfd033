"""The threads of ``omnigate serve`` over rounds of WebRTC calls, by OS thread name.

Starts ``omnigate serve`` with the given engine arguments (default: the duplex ``tiny`` preset) in its own process,
with ICE on loopback, then serves rounds of concurrent calls: each an aiortc peer that sends a microphone track (paced
silence), opens the call's data channel and hangs up once the server's reply has been heard on the track (on the
``speech`` channel it first asks for a sentence; on ``video-chat`` it also sends a camera and asks a question). The
server's threads (``/proc/PID/task``) are counted while a round's calls are all live and heard, and once they ended.

Run from the repository root:

    .venv/bin/python benchmarks/webrtc_call_threads.py --rounds 4 --calls 5 --out docs/benchmarks/webrtc_threads.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import av
import httpx
import numpy as np
from aiortc.mediastreams import AudioStreamTrack, VideoStreamTrack

from benchmarks.realtime_threads_cpu import free_port, thread_cpu
from omnigate.loadtest.targets.webrtc import CALLS_PATH, SpeechPeer, is_silent, use_loopback_candidates

VIDEO_CHAT_CALLS = "/v1/video/chat/calls"
LIMIT_S = 60.0
LOOPBACK_ICE = ("--webrtc-host-address", "127.0.0.1")


class Camera(VideoStreamTrack):
    """A bright square moving over a gradient, 160x120."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    async def recv(self) -> av.VideoFrame:
        pts, time_base = await self.next_timestamp()
        picture = np.tile(np.linspace(0, 200, 160, dtype=np.uint8), (120, 1))[..., None].repeat(3, axis=2)
        x = (self.count * 9) % 120
        picture[40:80, x : x + 40] = 255
        self.count += 1
        frame = av.VideoFrame.from_ndarray(picture, format="rgb24")
        frame.pts, frame.time_base = pts, time_base
        return frame


def threads_by_name(pid: int) -> dict[str, int]:
    return dict(collections.Counter(name for name, _ in thread_cpu(pid).values()).most_common())


async def one_call(base_url: str, channel: str, all_heard: asyncio.Barrier) -> None:
    """One call, until the server's reply is heard and every call of the round has heard its own."""
    heard = asyncio.Event()

    def on_audio(frame: av.AudioFrame, _now_s: float) -> None:
        if not is_silent(frame):
            heard.set()

    # On oai-events the duplex model speaks on its own clock: nothing to ask.
    peer = SpeechPeer(lambda _m, _t: None, on_audio, AudioStreamTrack(), channel)
    if channel == "video-chat":
        peer.pc.addTrack(Camera())
    try:
        async with httpx.AsyncClient(trust_env=False) as client:
            path = VIDEO_CHAT_CALLS if channel == "video-chat" else CALLS_PATH
            await asyncio.wait_for(peer.connect(client, base_url + path), LIMIT_S)
        if channel == "speech":
            peer.send_json({"type": "session.config"})
            peer.send_json({"type": "input.text", "text": "A reply to hear."})
            peer.send_json({"type": "input.done"})
        elif channel == "video-chat":
            peer.send_json({"type": "session.config", "num_frames": 2, "max_new_tokens": 8})
            peer.send_json({"type": "video.query", "text": "What is moving?"})
        await asyncio.wait_for(heard.wait(), LIMIT_S)
        await asyncio.wait_for(all_heard.wait(), LIMIT_S)
    finally:
        await peer.close()


async def measure(base_url: str, pid: int, channel: str, rounds: int, calls: int) -> list[dict[str, Any]]:
    use_loopback_candidates()
    results: list[dict[str, Any]] = [{"round": 0, "after": threads_by_name(pid)}]
    for n in range(1, rounds + 1):
        all_heard = asyncio.Barrier(calls + 1)
        running = asyncio.gather(*(one_call(base_url, channel, all_heard) for _ in range(calls)))
        await asyncio.wait_for(all_heard.wait(), LIMIT_S)
        live = threads_by_name(pid)
        await running
        await asyncio.sleep(1.0)  # the server's side of the hang-up (a measurement, not a test)
        after = threads_by_name(pid)
        results.append({"round": n, "live": live, "after": after})
        print(f"round {n}: {sum(live.values())} threads live, {sum(after.values())} after", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=5, help="concurrent calls per round")
    parser.add_argument("--channel", choices=["oai-events", "speech", "video-chat"], default="oai-events")
    parser.add_argument("serve_args", nargs="*", default=["--engine", "duplex", "--model", "preset:tiny"])
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "omnigate.gateway.cli", "serve", *args.serve_args, "--port", str(port), *LOOPBACK_ICE],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(base_url + "/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the server did not become ready")
            time.sleep(0.2)
        load_start = os.getloadavg()
        rounds = asyncio.run(measure(base_url, server.pid, args.channel, args.rounds, args.calls))
    finally:
        server.terminate()
        server.wait(30)
    report = {
        "serve_args": args.serve_args,
        "channel": args.channel,
        "calls_per_round": args.calls,
        "cores": os.cpu_count(),
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "threads_live": [sum(r["live"].values()) for r in rounds[1:]],
        "threads_after": [sum(r["after"].values()) for r in rounds],
        "rounds": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}))


if __name__ == "__main__":
    main()
