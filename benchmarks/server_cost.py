"""One load-test level against a running server, with what the server spent on it: CPU seconds per second of audio.

    python -m benchmarks.server_cost http://127.0.0.1:8000 --sessions 8 --words-per-second 20 --out FILE

Runs ``omnigate-loadtest run`` at its defaults (closed loop, the shipped corpus, ``--duration 15 --warmup 3
--drain 12 --slo-ttfa-ms 500``) as a child process and reads the server's ``/metrics`` before and after:
``process_cpu_seconds_total`` (the server process, every thread), ``omnigate_engine_generated_audio_seconds_total``
and ``omnigate_engine_step_seconds_total``. On a machine shared with other work, CPU seconds per second of audio is
the figure that other work changes least (wall-clock capacity and TTFA move with the machine's load, which is
printed with each result). The client's own CPU time is measured apart. Prints one JSON object and writes it to
``FILE.summary.json`` beside the load-test report.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

_COUNTERS = {
    "process_cpu_seconds_total": "cpu_s",
    "omnigate_engine_step_seconds_total": "step_s",
    "omnigate_engine_generated_audio_seconds_total": "audio_s",
}


def scrape(url: str) -> dict[str, float]:
    """The server's counters that this benchmark reads (summed over label sets)."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as response:
        text = response.read().decode()
    values = dict.fromkeys(_COUNTERS.values(), 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _COUNTERS:
            values[_COUNTERS[name]] += float(line.rsplit(" ", 1)[1])
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--words-per-second", type=float, default=20.0)
    parser.add_argument("--out", type=Path, required=True)
    args, extra = parser.parse_known_args()
    before = scrape(args.url)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    command = [
        sys.executable, "-m", "omnigate.loadtest.cli", "run", args.url, "--sessions", str(args.sessions),
        "--duration", "15", "--warmup", "3", "--drain", "12", "--slo-ttfa-ms", "500",
        "--words-per-second", str(args.words_per_second), "--out", str(args.out), "--quiet", *extra,
    ]  # fmt: skip
    subprocess.run(command, check=False)
    wall = time.perf_counter() - started
    after = scrape(args.url)
    done = resource.getrusage(resource.RUSAGE_CHILDREN)
    client_cpu = (done.ru_utime + done.ru_stime) - (children.ru_utime + children.ru_stime)
    level = json.loads(args.out.read_text())["levels"][0]
    cpu, audio, step = (after[key] - before[key] for key in ("cpu_s", "audio_s", "step_s"))
    ttfa = level["ttfa_ms"]
    result: dict[str, Any] = {
        "sessions": args.sessions,
        "words_per_second": args.words_per_second,
        "ttfa_p50_ms": round(ttfa["p50"]) if ttfa["p50"] is not None else None,
        "ttfa_p99_ms": round(ttfa["p99"]) if ttfa["p99"] is not None else None,
        "utterances_completed": level["utterances"]["completed"],
        "utterances_with_underruns": level["utterances"]["with_underruns"],
        "errors": level["errors"],
        "slo_passed": level["slo"]["passed"],
        "server_cpu_s": round(cpu, 2),
        "server_audio_s": round(audio, 1),
        "server_cpu_s_per_audio_s": round(cpu / audio, 4) if audio else None,
        "step_s_per_audio_s": round(step / audio, 4) if audio else None,
        "server_cores": round(cpu / wall, 2),
        "client_cores": round(client_cpu / wall, 2),
        "wall_s": round(wall, 1),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(result))
    Path(str(args.out) + ".summary.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
