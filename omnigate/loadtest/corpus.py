"""Texts the load test speaks, and how they are cut into the pieces an LLM or STT would stream.

The shipped corpus (``corpus/*.txt``) holds short replies, narrative paragraphs and conversational turns; entries
are separated by blank lines. ``--corpus`` points at a file or a folder of ``.txt`` files in the same format.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

_ENTRY_SEPARATOR = re.compile(r"\n\s*\n")
_WORD_WITH_TRAILING_SPACE = re.compile(r"\S+\s*")


def parse_corpus(text: str) -> list[str]:
    """Entries of one corpus file: paragraphs separated by blank lines, inner line breaks kept as spaces."""
    entries = (" ".join(chunk.split()) for chunk in _ENTRY_SEPARATOR.split(text))
    return [entry for entry in entries if entry]


def load_corpus(path: Path | None = None) -> list[str]:
    """Entries of the shipped corpus, or of ``path`` (a ``.txt`` file or a folder of them), in a stable order."""
    if path is None:
        folder = resources.files("omnigate.loadtest").joinpath("corpus")
        files = sorted((item for item in folder.iterdir() if item.name.endswith(".txt")), key=lambda f: f.name)
        texts = [item.read_text(encoding="utf-8") for item in files]
    elif path.is_dir():
        texts = [item.read_text(encoding="utf-8") for item in sorted(path.glob("*.txt"))]
    else:
        texts = [path.read_text(encoding="utf-8")]
    entries = [entry for text in texts for entry in parse_corpus(text)]
    if not entries:
        raise ValueError(f"corpus {path or 'shipped'} has no entries")
    return entries


def pick_texts(corpus: Sequence[str], count: int, seed: int, session_id: int) -> list[str]:
    """The utterances of one session: the same seed and session id always give the same texts."""
    rng = random.Random(f"{seed}:{session_id}")
    return [rng.choice(corpus) for _ in range(count)]


def word_chunks(text: str) -> list[str]:
    """The text as streamed pieces: each word with the whitespace after it, so the pieces join back exactly."""
    chunks = _WORD_WITH_TRAILING_SPACE.findall(text)
    leading = len(text) - len(text.lstrip())
    if chunks and leading:
        chunks[0] = text[:leading] + chunks[0]
    return chunks


def unit_end_offset(text: str, unit_text: str) -> int | None:
    """Where the first synthesis unit ends in ``text``, given the unit's text as the server reported it.

    Servers normalize whitespace in what they report, so this counts non-space characters: the unit ends after as
    many non-space characters of ``text`` as ``unit_text`` has. ``None`` if ``text`` is shorter than that.
    """
    wanted = sum(1 for char in unit_text if not char.isspace())
    if wanted == 0:
        return None
    seen = 0
    for offset, char in enumerate(text):
        if not char.isspace():
            seen += 1
            if seen == wanted:
                return offset + 1
    return None
