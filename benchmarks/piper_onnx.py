"""Piper's onnxruntime call on one core: cost per second of audio by unit length, batch 1 against 2-4 units of
similar length padded into one call, and the CPU memory arena on and off.

    python -m benchmarks.piper_onnx [--repeats 3] [--units 32] [--out docs/benchmarks/piper_onnx.json]

Each configuration builds its own single-threaded session (as the engine's workers run them) and times the same
sentences of the shipped load-test corpus; the minimum of the repeats is reported, since other work on the machine
only adds time.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime
from piper import PiperVoice
from piper.config import PiperConfig

from omnigate.engines.piper import _resolve_voice
from omnigate.loadtest.corpus import load_corpus


def _session(arena: bool) -> onnxruntime.InferenceSession:
    model, _, _ = _resolve_voice(None)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.enable_cpu_mem_arena = arena
    return onnxruntime.InferenceSession(str(model), sess_options=options, providers=["CPUExecutionProvider"])


def _voice(session: onnxruntime.InferenceSession) -> PiperVoice:
    _, config_path, _ = _resolve_voice(None)
    with config_path.open(encoding="utf-8") as f:
        return PiperVoice(session=session, config=PiperConfig.from_dict(json.load(f)))


def _run(voice: PiperVoice, batch: list[list[int]]) -> tuple[float, int]:
    """Seconds of one call over the padded batch, and the samples of real (unpadded) audio it made."""
    longest = max(len(ids) for ids in batch)
    ids = np.zeros((len(batch), longest), dtype=np.int64)
    for row, unit in enumerate(batch):
        ids[row, : len(unit)] = unit
    lengths = np.array([len(unit) for unit in batch], dtype=np.int64)
    config = voice.config
    scales = np.array([config.noise_scale, config.length_scale, config.noise_w_scale], dtype=np.float32)
    t0 = time.perf_counter()
    audio = voice.session.run(None, {"input": ids, "input_lengths": lengths, "scales": scales})[0]
    seconds = time.perf_counter() - t0
    # Padded rows come out as long as the longest one; count each unit's own length by its share of phonemes.
    samples = int(audio.shape[-1] * sum(lengths) / longest)
    return seconds, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--units", type=int, default=32, help="sentences timed, spread over the corpus's lengths")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    corpus = load_corpus(None)
    voice = _voice(_session(arena=False))
    units = [ids for text in corpus for ids in (voice.phonemes_to_ids(p) for p in voice.phonemize(text)) if ids]
    units.sort(key=len)
    units = units[:: max(1, len(units) // args.units)]  # a spread of lengths, short to long
    rate = voice.config.sample_rate
    report: dict[str, Any] = {"load_average": os.getloadavg(), "units": len(units), "sample_rate": rate}

    def cost(voice: PiperVoice, groups: list[list[list[int]]]) -> float:
        best = float("inf")
        for _ in range(args.repeats):
            seconds = samples = 0.0
            for group in groups:
                s, n = _run(voice, group)
                seconds += s
                samples += n
            best = min(best, seconds / (samples / rate))
        return best

    for arena in (False, True):
        v = _voice(_session(arena))
        _run(v, [units[0]])  # first call allocates and optimizes
        by_batch = {}
        for batch in (1, 2, 3, 4):
            # neighbours in length order: units of similar length, as a batching scheduler would group them
            groups = [units[i : i + batch] for i in range(0, len(units) - batch + 1, batch)]
            by_batch[str(batch)] = round(cost(v, groups), 4)
        report[f"arena_{'on' if arena else 'off'}_cost_by_batch"] = by_batch
    short = [u for u in units if len(u) < 40]
    long = [u for u in units if len(u) >= 120]
    report["cost_short_units_lt40_ids"] = round(cost(voice, [[u] for u in short]), 4)
    report["cost_long_units_ge120_ids"] = round(cost(voice, [[u] for u in long]), 4)
    total_ids = sum(len(u) for u in units)
    total_samples = sum(_run(voice, [u])[1] for u in units)
    report["audio_ms_per_phoneme_id"] = round(total_samples / rate * 1000 / total_ids, 2)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
