"""What a speech recognizer hears in audio: pocketsphinx's bundled en-US model (acoustic model, language model and
dictionary ship in the ``pocketsphinx`` wheel), and the word error rate of what it heard against what was said."""

from __future__ import annotations

import re

from pocketsphinx import Decoder

from omnigate.codecs.resample import StreamResampler

RECOGNIZER_RATE = 16_000
_WORD = re.compile(r"[a-z']+")


def words(text: str) -> list[str]:
    """Lowercase words, punctuation dropped (the recognizer's vocabulary is lowercase words)."""
    return _WORD.findall(text.lower().replace("’", "'"))


def transcribe(pcm: bytes, rate: int) -> str:
    """What pocketsphinx hears in mono s16le ``pcm`` at ``rate``: one utterance, decoded whole."""
    if rate != RECOGNIZER_RATE:
        resampler = StreamResampler(rate, RECOGNIZER_RATE)
        pcm = resampler.process(pcm) + resampler.flush()
    decoder = Decoder(samprate=RECOGNIZER_RATE)
    decoder.start_utt()
    decoder.process_raw(pcm, full_utt=True)
    decoder.end_utt()
    hypothesis = decoder.hyp()
    return hypothesis.hypstr if hypothesis is not None else ""


def word_errors(reference: str, heard: str) -> int:
    """Substitutions, insertions and deletions that turn the words of ``reference`` into those of ``heard``."""
    ref, hyp = words(reference), words(heard)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        previous, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (r != h))
    return row[-1]
