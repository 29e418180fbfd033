"""How soon the embedded LLM answers after a start: its load alone, then the server's start to its first answer.

``load``: each round loads SmolLM2-135M-Instruct in a fresh Python process (imports included, as a server start pays
them), first with an empty cache folder (``cold``: the GGUF file parsed and dequantized, then cached), then again
with that folder (``cached``). ``serve``: ``omnigate serve`` (what ``scripts/serve`` runs once its install is in
place) started twice over one empty cache folder; for each start, the time to ``/ready`` and, asking as soon as it
is ready, the first realtime text turn's first transcript delta and its end (status ``completed``, or the error the
client got). The results are merged under ``"start"`` into the JSON file given by ``--out``.

Command::

    python -m benchmarks.embedded_llm_start --rounds 3 --out docs/benchmarks/embedded_llm.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import websockets

LOAD_CHILD = """
import json, sys, time
started = time.perf_counter()
import torch
torch.set_num_threads(1)
from pathlib import Path
from omnigate.engines.llm.model import load_smollm2
imported = time.perf_counter()
load_smollm2(slots=8, max_context=2048, cache_root=Path(sys.argv[1]))
print(json.dumps({"import_s": imported - started, "load_s": time.perf_counter() - imported}))
"""
MAX_ATTEMPTS = 30
QUESTION = "What is the capital of France? Answer in one short sentence."


def load_once(cache: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", LOAD_CHILD, str(cache)], check=True, capture_output=True, text=True, timeout=600
    )
    times: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return {name: round(value, 2) for name, value in times.items()}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def first_answer(base: str) -> dict[str, Any]:
    started = time.perf_counter()
    url = base.replace("http://", "ws://") + "/v1/realtime?model=gpt-realtime"
    first_text: float | None = None
    async with websockets.connect(url, max_size=None) as ws:
        await ws.recv()  # session.created
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}
        await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        await ws.send(json.dumps({"type": "response.create"}))
        while True:
            event = json.loads(await ws.recv())
            if event["type"] == "response.output_audio_transcript.delta" and first_text is None:
                first_text = time.perf_counter() - started
            if event["type"] == "response.done":
                response = event["response"]
                return {
                    "first_text_s": None if first_text is None else round(first_text, 2),
                    "done_s": round(time.perf_counter() - started, 2),
                    "status": response["status"],
                    "error": (response.get("status_details") or {}).get("error"),
                }


async def serve_once(cache: Path) -> dict[str, Any]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMNIGATE_CACHE_DIR": str(cache)}
    command = [sys.executable, "-m", "omnigate.gateway.cli", "serve", "--port", str(port)]
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        *command, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                if process.returncode is not None:
                    raise SystemExit(f"the server exited ({process.returncode})")
                try:
                    if (await client.get(f"{base}/ready")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)  # polling the server's own readiness
        ready = time.perf_counter() - started
        # Asked again, as the error says, while the model is still loading (each ask waits up to the server's
        # --llm-first-token-timeout, 10 s by default).
        attempts = [await first_answer(base)]
        while attempts[-1]["status"] != "completed" and len(attempts) < MAX_ATTEMPTS:
            attempts.append(await first_answer(base))
        answered = time.perf_counter() - started
        return {"ready_s": round(ready, 2), "answered_s": round(answered, 2), "attempts": attempts}
    finally:
        process.terminate()
        await process.wait()


def median(rows: list[dict[str, float]], name: str) -> float:
    return round(statistics.median(r[name] for r in rows), 2)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    load_avg_at_start = round(os.getloadavg()[0], 2)
    loads: dict[str, list[dict[str, float]]] = {"cold": [], "cached": []}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as folder:
            loads["cold"].append(load_once(Path(folder)))
            loads["cached"].append(load_once(Path(folder)))
    with tempfile.TemporaryDirectory() as folder:
        starts = {"first": await serve_once(Path(folder)), "second": await serve_once(Path(folder))}
    report = {
        "load_avg_1min_at_start": load_avg_at_start,
        "load_avg_1min_at_end": round(os.getloadavg()[0], 2),
        "load": {
            kind: {"rounds": rows, "load_s_median": median(rows, "load_s"), "import_s_median": median(rows, "import_s")}
            for kind, rows in loads.items()
        },
        "serve": starts,
    }
    print(json.dumps(report, indent=2))
    if args.out is not None:
        existing = json.loads(args.out.read_text()) if args.out.exists() else {}
        existing["start"] = report
        args.out.write_text(json.dumps(existing, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
