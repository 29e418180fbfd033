"""The default voice against the piper voice, side by side: intelligibility, CPU per second of audio, first audio and
capacity, each voice served by its own server started here.

    python -m benchmarks.voice_compare --engines hibari,piper --levels 1,16,32,64,96 \
        --out docs/benchmarks/voice_compare.json

For each engine: ``omnigate serve --engine E --port P`` in a subprocess, then

* **intelligibility**: every sentence of ``voice_compare_sentences.txt`` fetched from the server's
  ``POST /v1/audio/speech`` (voice ``alloy``, 24 kHz PCM) and transcribed by pocketsphinx's bundled en-US model; the
  word error rate is the word errors over all sentences divided by their words. The same recognizer judges both
  voices, so its own errors weigh on both;
* **CPU seconds per second of audio**: the engine alone (loaded in this process, each sentence streamed through its
  ``open``/``step`` as the pool does, the thread's CPU time), and the whole server during the sentences above
  (``process_cpu_seconds_total`` over ``omnigate_engine_generated_audio_seconds_total`` from ``/metrics``);
* **load levels**: ``benchmarks.server_cost`` at each of ``--levels`` sessions (``omnigate-loadtest run`` at its
  defaults, closed loop, the shipped corpus, ``--duration 15 --warmup 3 --drain 12 --slo-ttfa-ms 500``) at
  ``--words-per-second``: TTFA p50/p99 at one session and, per level, underruns, refusals and the SLO. The capacity
  is the largest level that met the SLO (zero underruns, no failed session, TTFA p99 < 500 ms).

Writes one JSON object to ``--out``, keeping the entries of engines not measured in this run (the load-test
reports go under ``--reports``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.server_cost import scrape
from omnigate.engines.base import AudioChunk, StreamDone, SynthesisParams
from omnigate.engines.registry import load_engine
from tests.transcription import transcribe, word_errors, words

SENTENCES = Path(__file__).with_name("voice_compare_sentences.txt")
SPEECH_RATE = 24_000  # POST /v1/audio/speech's PCM, as OpenAI's
READY_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_server(engine: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "omnigate.gateway.cli", "serve", "--engine", engine, "--port", str(port)]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + READY_S
    with httpx.Client(timeout=5.0) as client:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the {engine} server exited: {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"the {engine} server was not ready after {READY_S} s")
            try:
                if client.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                    return process
            except httpx.TransportError:
                pass
            time.sleep(0.2)  # a poll of the server's own readiness


def intelligibility(url: str, sentences: list[str]) -> dict[str, Any]:
    """Each sentence through the server's speech route and the recognizer; the server's CPU per audio second."""
    before = scrape(url)
    rows = []
    with httpx.Client(timeout=60.0) as client:
        for sentence in sentences:
            body = {"model": "tts-1", "voice": "alloy", "input": sentence, "response_format": "pcm"}
            response = client.post(f"{url}/v1/audio/speech", json=body)
            response.raise_for_status()
            rows.append((sentence, response.content))
    after = scrape(url)
    results = []
    for sentence, pcm in rows:
        heard = transcribe(pcm, SPEECH_RATE)
        results.append({"said": sentence, "heard": heard, "errors": word_errors(sentence, heard)})
    errors = sum(r["errors"] for r in results)
    total = sum(len(words(r["said"])) for r in results)
    cpu, audio = after["cpu_s"] - before["cpu_s"], after["audio_s"] - before["audio_s"]
    return {
        "sentences": len(results),
        "words": total,
        "word_errors": errors,
        "wer": round(errors / total, 4),
        "exact_sentences": sum(r["errors"] == 0 for r in results),
        "server_cpu_s_per_audio_s": round(cpu / audio, 4) if audio else None,
        "transcripts": results,
    }


def engine_cpu(engine_name: str, sentences: list[str]) -> dict[str, Any]:
    """The engine alone: each sentence streamed through open/step/close on this thread; its CPU time per audio s."""
    engine = load_engine(engine_name, None, workers=1)
    voice = engine.info.default_voice
    cpu = audio = 0.0
    try:
        for _ in range(2):  # the first round warms what the engine's own warm-up did not
            cpu = audio = 0.0
            for sentence in sentences:
                started = time.thread_time()
                stream = engine.open(SynthesisParams(voice=voice))
                stream.pending_text.append(sentence)
                stream.input_done = True
                done = False
                while not done:
                    for out in engine.step([stream], [60_000.0])[0]:
                        if isinstance(out, AudioChunk):
                            audio += out.duration_ms / 1000.0
                        done = done or isinstance(out, StreamDone)
                engine.close(stream)
                cpu += time.thread_time() - started
    finally:
        engine.shutdown()
    return {
        "model": engine.info.model,
        "sample_rate": engine.info.sample_rate,
        "cpu_s_per_audio_s": round(cpu / audio, 4),
    }


def load_level(url: str, sessions: int, words_per_second: float, out: Path) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "benchmarks.server_cost", url, "--sessions", str(sessions),
        "--words-per-second", str(words_per_second), "--out", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=False, stdout=subprocess.DEVNULL)
    summary: dict[str, Any] = json.loads(Path(str(out) + ".summary.json").read_text())
    return summary


def compare(engine: str, levels: list[int], words_per_second: float, reports: Path) -> dict[str, Any]:
    sentences = [line.strip() for line in SENTENCES.read_text().splitlines() if line.strip()]
    result: dict[str, Any] = {"engine": engine, "engine_only": engine_cpu(engine, sentences)}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(engine, port, reports / f"{engine}.serve.log")
    try:
        result["intelligibility"] = intelligibility(url, sentences)
        result["levels"] = [
            load_level(url, n, words_per_second, reports / f"{engine}_{n}_sessions.json") for n in levels
        ]
    finally:
        server.terminate()
        server.wait(60)
    passed = [lv["sessions"] for lv in result["levels"] if lv["slo_passed"] and lv["utterances_with_underruns"] == 0]
    result["capacity_sessions"] = max(passed, default=0)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="hibari,piper")
    parser.add_argument("--levels", default="1,16,32,64,96", help="closed-loop sessions, comma separated")
    parser.add_argument("--words-per-second", type=float, default=20.0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reports", type=Path, default=Path("/tmp/voice_compare"))
    args = parser.parse_args()
    args.reports.mkdir(parents=True, exist_ok=True)
    levels = [int(n) for n in args.levels.split(",")]
    # Engines run one command each keep each other's results: an engine's entry is replaced, the others stay.
    results: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {"engines": []}
    for engine in args.engines.split(","):
        load_at_start = [round(x, 2) for x in os.getloadavg()]
        measured = compare(engine, levels, args.words_per_second, args.reports)
        measured["machine"] = {
            "cpus": os.cpu_count(),
            "load_average_at_start": load_at_start,
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
            "command": " ".join(["python -m benchmarks.voice_compare", *sys.argv[1:]]),
        }
        results["engines"] = [r for r in results["engines"] if r["engine"] != engine] + [measured]
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    for r in results["engines"]:
        one = r["levels"][0] if r["levels"] else {}
        print(
            f"{r['engine']}: WER {r['intelligibility']['wer']:.3f}, engine CPU s/audio s "
            f"{r['engine_only']['cpu_s_per_audio_s']}, server {r['intelligibility']['server_cpu_s_per_audio_s']}, "
            f"TTFA p50/p99 at {one.get('sessions')} {one.get('ttfa_p50_ms')}/{one.get('ttfa_p99_ms')} ms, "
            f"capacity {r['capacity_sessions']}"
        )


if __name__ == "__main__":
    main()
