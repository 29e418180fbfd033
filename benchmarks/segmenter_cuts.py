"""Where the speech segmenter cuts the shipped corpus when its text streams in word by word: the prosody cost.

    python -m benchmarks.segmenter_cuts [--words-per-second 20] [--first-min-words 3] [--first-max-words 5]

Each corpus entry is pushed one word at a time (each word with the whitespace after it, as the load-test client
sends it) on a virtual clock at the given pace, with the server's default limits, and every unit is classified by how
it ends: at a sentence end, at a clause mark (``, ; :``) or mid-phrase (a word budget or a forced release, where piper
says the words before the cut as a phrase of their own). The first unit of each entry is counted apart from the
rest, together with its words and its audio duration as the engine would speak it (with ``--audio``, which loads
the piper voice). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

from omnigate.loadtest.corpus import load_corpus, word_chunks
from omnigate.sessions.segmenter import SegmenterConfig, TextSegmenter

_SENTENCE_END = ".!?…\"'”’)"
_CLAUSE = ",;:"


def units_of(text: str, config: SegmenterConfig, words_per_second: float) -> list[str]:
    """The units the segmenter releases for ``text`` sent word by word at ``words_per_second``."""
    segmenter = TextSegmenter(config)
    units: list[str] = []
    for index, chunk in enumerate(word_chunks(text)):
        now_ms = index * 1000.0 / words_per_second
        deadline = segmenter.next_deadline_ms()
        if deadline is not None and deadline <= now_ms:
            units += segmenter.poll(deadline)
        units += segmenter.push(chunk, now_ms)
    return units + segmenter.flush()


def cut_kind(unit: str) -> str:
    """How a unit ends: ``sentence``, ``clause`` or ``mid_phrase``."""
    end = unit.rstrip()
    if end[-1:] in _CLAUSE:
        return "clause"
    if end[-1:] in _SENTENCE_END:
        return "sentence"
    return "mid_phrase"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--words-per-second", type=float, default=20.0)
    parser.add_argument("--first-min-words", type=int, default=SegmenterConfig().first_unit_min_words)
    parser.add_argument("--first-max-words", type=int, default=SegmenterConfig().first_unit_max_words)
    parser.add_argument("--audio", action="store_true", help="also give the first units' audio seconds (piper)")
    args = parser.parse_args()
    config = SegmenterConfig(first_unit_min_words=args.first_min_words, first_unit_max_words=args.first_max_words)
    corpus = load_corpus()
    first: Counter[str] = Counter()
    later: Counter[str] = Counter()
    first_words: list[int] = []
    examples: dict[str, list[str]] = {"mid_phrase": [], "clause": []}
    first_units: list[str] = []
    for text in corpus:
        units = units_of(text, config, args.words_per_second)
        head = units[0]
        kind = cut_kind(head) if len(units) > 1 else "sentence"
        first[kind] += 1
        first_words.append(len(head.split()))
        first_units.append(head)
        if kind in examples and len(examples[kind]) < 4:
            examples[kind].append(f"{head.strip()} | {units[1].strip()[:30]}")
        later.update(cut_kind(unit) for unit in units[1:-1])
        later["sentence"] += len(units) > 1  # the last unit ends the entry
    result: dict[str, Any] = {
        "words_per_second": args.words_per_second,
        "first_unit_min_words": config.first_unit_min_words,
        "first_unit_max_words": config.first_unit_max_words,
        "entries": len(corpus),
        "first_units": dict(first),
        "first_unit_words_mean": round(sum(first_words) / len(first_words), 2),
        "later_units": dict(later),
        "examples": examples,
    }
    if args.audio:
        from omnigate.engines.piper import PiperEngine

        engine = PiperEngine.load(None, workers=1)
        seconds = [len(engine.synthesize(u, speaker_id=None, speed=1.0)) / engine.info.sample_rate for u in first_units]
        seconds.sort()
        result["first_unit_audio_s"] = {
            "mean": round(sum(seconds) / len(seconds), 2),
            "p50": round(seconds[len(seconds) // 2], 2),
            "max": round(seconds[-1], 2),
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
