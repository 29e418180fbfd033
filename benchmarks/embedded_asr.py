"""The embedded speech recognizer of ``/v1/realtime`` (pocketsphinx, no ``--asr-url``): what it hears, how soon the
transcript is ready after a turn ends, what it costs.

The user's turns are the piper voice saying a fixed set of sentences, each followed by the 500 ms of silence that
server VAD includes in a turn (``silence_duration_ms``). Measured in this process, on the recognizer the server runs
(:class:`omnigate.engines.recognizer.EmbeddedRecognizer`):

- accuracy: each sentence's transcript, and the word error rate over the set;
- CPU per audio second: one decoder decoding the turns as fast as it can (the thread's CPU time over the audio's
  length), and from it the streams one core decodes in real time;
- transcription delay after the end of the turn: ``--streams`` conversations at once, each feeding its turns in real
  time (``--append-ms`` pieces on a wall-clock schedule, as a microphone does), from the last piece of a turn to its
  transcript, p50 / p95.

The whole conversation, voice to voice, is measured through the server by the load test's ``realtime`` target in
talk mode (``omnigate-loadtest run ... --out talk.json``, see docs/benchmarks/embedded_agent.md); ``--talk-report``
adds each of those reports' turn split to this one. Run from the repository root::

    .venv/bin/python benchmarks/embedded_asr.py --out docs/benchmarks/embedded_asr.json \
        --talk-report talk_1.json --talk-report talk_4.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import time
from pathlib import Path
from typing import Any

from omnigate.codecs.resample import StreamResampler
from omnigate.engines.piper import PiperEngine
from omnigate.engines.recognizer import EmbeddedRecognizer
from omnigate.engines.recognizer_worker import DECODER_RATE, INPUT_RATE, PocketsphinxDecoder
from omnigate.loadtest.stats import distribution

SENTENCES = (
    "What is the capital of France?",
    "Could you book a table for two at eight tonight?",
    "The weather is nice today.",
    "Please call me back tomorrow morning.",
    "How long does the train take to get to the airport?",
    "I would like to order a large pizza with mushrooms.",
    "Turn off the lights in the kitchen.",
    "What time does the museum open on Sunday?",
)
CLOSING_SILENCE_S = 0.5
LAG_TICK_S = 0.01


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--streams", default="1,4", help="conversations at once, one level each")
    parser.add_argument("--append-ms", type=int, default=40)
    parser.add_argument(
        "--talk-report", type=Path, action="append", default=[], help="a load-test report of talk mode to summarize"
    )
    return parser.parse_args(argv)


def turn_audio(piper: PiperEngine, text: str) -> bytes:
    """``text`` in the piper voice and the closing silence, 24 kHz mono s16le as a session hears it."""
    samples = piper.synthesize(text, speaker_id=None, speed=1.0)
    resampler = StreamResampler(piper.info.sample_rate, INPUT_RATE)
    return (
        resampler.process(samples.astype("<i2").tobytes())
        + resampler.flush()
        + bytes(int(INPUT_RATE * CLOSING_SILENCE_S) * 2)
    )


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def word_errors(reference: list[str], hypothesis: list[str]) -> int:
    """Substitutions, insertions and deletions (Levenshtein distance over words)."""
    row = list(range(len(hypothesis) + 1))
    for i, ref in enumerate(reference, 1):
        previous, row[0] = row[0], i
        for j, hyp in enumerate(hypothesis, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (ref != hyp))
    return row[-1]


def cpu_per_audio_second(turns: list[bytes]) -> tuple[float, list[str]]:
    """One decoder, as fast as it goes: its thread's CPU seconds per second of audio, and the transcripts."""
    decoder = PocketsphinxDecoder()
    pieces = []
    for pcm in turns:
        resampler = StreamResampler(INPUT_RATE, DECODER_RATE)
        pieces.append(resampler.process(pcm) + resampler.flush())
    transcripts = []
    cpu_s = 0.0
    for pcm in pieces:
        started = time.thread_time()
        decoder.start()
        for offset in range(0, len(pcm), 3200):
            decoder.feed(pcm[offset : offset + 3200])
        transcripts.append(decoder.finish())
        cpu_s += time.thread_time() - started
    audio_s = sum(len(pcm) for pcm in pieces) / 2 / DECODER_RATE
    return cpu_s / audio_s, transcripts


async def conversation(recognizer: EmbeddedRecognizer, turns: list[bytes], append_ms: int) -> list[float]:
    """The turns fed in real time, one after another; the delay from each turn's last piece to its transcript."""
    piece = INPUT_RATE * 2 * append_ms // 1000
    delays = []
    for pcm in turns:
        listener = recognizer.listen()
        start = time.perf_counter()
        count = (len(pcm) + piece - 1) // piece
        for index in range(count - 1):
            listener.hear(pcm[index * piece : (index + 1) * piece])
            await asyncio.sleep(max(0.0, start + (index + 1) * append_ms / 1000.0 - time.perf_counter()))
        ended = time.perf_counter()
        await listener.transcript(pcm[(count - 1) * piece :])
        delays.append((time.perf_counter() - ended) * 1000.0)
    return delays


async def loop_lag(lags: list[float], stop: asyncio.Event) -> None:
    """How late the event loop wakes a 10 ms timer (ms), until ``stop``: what every session's I/O waits at worst."""
    while not stop.is_set():
        due = time.perf_counter() + LAG_TICK_S
        await asyncio.sleep(LAG_TICK_S)
        lags.append(max(0.0, time.perf_counter() - due) * 1000.0)


async def delays_at(streams: int, turns: list[bytes], append_ms: int) -> dict[str, Any]:
    recognizer = EmbeddedRecognizer(max_decoders=streams)
    lags: list[float] = []
    stop = asyncio.Event()
    try:
        recognizer.start()
        await recognizer.loaded()
        cpu_before = time.process_time()
        wall_before = time.perf_counter()
        probe = asyncio.create_task(loop_lag(lags, stop))
        # Each conversation starts at another sentence, so the turns do not end at the same moment.
        results = await asyncio.gather(
            *(conversation(recognizer, turns[i:] + turns[:i], append_ms) for i in range(streams))
        )
        stop.set()
        await probe
        cpu = time.process_time() - cpu_before
        wall = time.perf_counter() - wall_before
    finally:
        await recognizer.aclose()
    delays = [ms for result in results for ms in result]
    return {
        "streams": streams,
        "turns": len(delays),
        "transcription_delay_ms": as_dict(distribution(delays)),
        "event_loop_lag_ms": as_dict(distribution(lags)),
        "gateway_process_cpu_per_wall_s": round(cpu / wall, 3),
    }


def talk_levels(path: Path) -> list[dict[str, Any]]:
    """The talk-mode levels of a load-test report: sessions, turns, voice to voice and the turn split (ms)."""
    report = json.loads(path.read_text())

    def brief(distribution: dict[str, Any]) -> dict[str, Any]:
        return {key: distribution[key] for key in ("count", "p50", "p95", "max")}

    return [
        {
            "label": level["target"]["label"],
            "sessions_at_once": level["arrival"].get("sessions"),
            "duration_s": level["duration_s"],
            "turns": level["utterances"],
            "errors": level["errors"],
            "error_examples": level["error_examples"],
            "turn_steps_ms": {step: brief(d) for step, d in level["turn_steps_ms"].items()},
        }
        for level in report["levels"]
    ]


def as_dict(value: Any) -> dict[str, Any]:
    return {name: getattr(value, name) for name in value.__struct_fields__}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    load_idle = os.getloadavg()
    piper = PiperEngine.load(None, workers=1)
    turns = [turn_audio(piper, text) for text in SENTENCES]
    cpu_per_s, transcripts = cpu_per_audio_second(turns)
    errors = sum(word_errors(words(ref), words(hyp)) for ref, hyp in zip(SENTENCES, transcripts, strict=True))
    reference_words = sum(len(words(ref)) for ref in SENTENCES)
    print(f"CPU {cpu_per_s:.3f} s per audio s; WER {errors / reference_words:.1%}", flush=True)
    levels = []
    for streams in (int(n) for n in args.streams.split(",")):
        level = await delays_at(streams, turns, args.append_ms)
        delay = level["transcription_delay_ms"]
        lag = level["event_loop_lag_ms"]
        print(
            f"{streams} streams: transcription delay p50 {delay['p50']:.0f} ms p95 {delay['p95']:.0f} ms; "
            f"event loop lag p50 {lag['p50']:.1f} ms p99 {lag['p99']:.1f} ms max {lag['max']:.0f} ms",
            flush=True,
        )
        levels.append(level)
    return {
        "benchmark": "embedded_asr",
        "recognizer": "pocketsphinx 5.1.1, en-US acoustic model, language model and dictionary of its wheel",
        "speech": "the piper voice (joe-us), each sentence then 500 ms of silence (the server VAD's closing silence)",
        "sentences": [
            {"text": ref, "transcript": hyp, "word_errors": word_errors(words(ref), words(hyp))}
            for ref, hyp in zip(SENTENCES, transcripts, strict=True)
        ],
        "word_error_rate": round(errors / reference_words, 4),
        "cpu_s_per_audio_s": round(cpu_per_s, 4),
        "streams_per_core_real_time": round(1.0 / cpu_per_s, 1),
        "realtime_feed": {"append_ms": args.append_ms, "levels": levels},
        "talk_mode": [level for path in args.talk_report for level in talk_levels(path)],
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_at_start": [round(x, 2) for x in load_idle],
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        },
    }


if __name__ == "__main__":
    arguments = parse_args()
    report = asyncio.run(main(arguments))
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    arguments.out.write_text(json.dumps(report, indent=2) + "\n")
