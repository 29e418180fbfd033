"""Cut incremental text (LLM tokens, STT words, single characters) into units for a TTS engine.

Sans-I/O: the caller passes the time in; nothing here reads a clock or awaits.

Rules, in order of precedence:

* **Nothing is lost.** The units returned by :meth:`TextSegmenter.push`, :meth:`~TextSegmenter.poll` and
  :meth:`~TextSegmenter.flush`, followed by what :meth:`~TextSegmenter.clear` returns, concatenate to exactly the
  text pushed. Every unit holds a non-space character. Whitespace after a boundary stays with the unit before it
  ("Hello! " and "How are you?"), so units start at a word (except after a CJK mark or a cut inside a word). A
  whitespace-only remainder stays buffered and leads the next unit: after a CJK cut, say "你好。\\n" then end of
  input, ``buffered`` is "\\n" after :meth:`flush`, not a unit of its own.
* **Decisions wait for context, never for chunking.** A boundary is decided only once the text that settles it has
  arrived (normally the next non-space character), so the units do not depend on how the text was chunked: with
  the clock standing still, pushing a text in one piece or one character at a time gives the same units.
* **Sentence boundaries**: a run of ``. ! ? …`` (also ``‼ ⁇ ⁈ ⁉ ؟ ۔ । ॥``), then closing quotes/brackets, then
  whitespace, then a character that is not a lowercase letter. A plain ``!``/``?`` run, or one ``.`` after an
  ordinary word, followed by whitespace is a boundary at once, whatever comes next: TTFA does not wait for the next
  word. Only the ambiguous cases below (and closing quotes, where a dialogue tag may follow) wait for it.
  A lone ``.`` is also no boundary after an
  abbreviation (``Dr. Mr. Mrs. Ms. Prof. St. Jr. Sr. vs. etc. Inc. Ltd. Co. Fig. approx.`` and a few more;
  ``No. p. pp. vol.`` only before a digit, since "no." often ends a sentence), a single capital initial ("J. Smith"),
  dotted initials ("U.S. e.g. i.e. a.m."), or a list number at the start of a line ("1. First"). No whitespace after
  the mark means no boundary: "3.14", "1,000.5", "v2.0", "example.com", "a.b@c.io". An ellipsis followed by a
  lowercase word continues the sentence ("Wait... what?" is one unit; "Wait... What?" is two).
* **CJK** ``。！？．｡`` end a unit at once, with no whitespace needed (``．`` not after a digit:
  "３．１４"); whitespace or closing brackets that follow lead the next unit, since "at once" cannot wait for them.
* **Line breaks** are boundaries (a blank line, and also a single newline: LLM lists and headings use them).
* **Clause granularity** adds ``, ; :`` followed by whitespace (so "1,000" stays whole) and CJK ``，；：、`` at once.
* **A unit must be worth synthesizing**: a boundary is skipped, and its text carried into the next unit, while the
  unit has no letter or digit or fewer than ``min_chars`` non-space characters ("Hi." with ``min_chars=5``).
* **A short first unit.** The first unit of an utterance (the first after construction, :meth:`flush` or
  :meth:`clear`) also ends after a clause mark (``, ; :``) followed by whitespace once it holds
  ``first_unit_min_words`` words, or after ``first_unit_max_words``
  words followed by whitespace, when that comes before the sentence's end: the engine's first call is short, so
  first audio comes soon. The cut takes one whitespace character, like a definite sentence end, and is decided as
  soon as that character arrives. Later units are whole sentences again (better prosody). A word-budget cut can fall
  mid-phrase ("The weather in | Lisbon tomorrow"); text without spaces (CJK) has no word budget.
* **Forced cuts bound latency.** Once more than ``max_chars`` characters (not counting leading whitespace) wait
  without a boundary, the unit ends after the last whitespace within the limit, or mid-word at the limit when there is
  none. When the oldest buffered non-space character has waited ``max_wait_ms``, the buffer is released up to its
  last whitespace, keeping a trailing partial word, which then gets a fresh ``max_wait_ms`` of its own; a buffer that
  ends in whitespace or punctuation, or is one word, is released whole. :meth:`flush` releases everything.
"""

from __future__ import annotations

import re
from collections import deque
from enum import Enum
from typing import Literal, NamedTuple

import msgspec

_LATIN_TERMINATORS = frozenset(".!?…‼⁇⁈⁉؟۔।॥")
_CJK_TERMINATORS = frozenset("。！？．｡")
_LATIN_CLAUSE_MARKS = frozenset(",;:")
_CJK_CLAUSE_MARKS = frozenset("，；：、､")
# Full-width marks that also appear inside full-width numbers ("３．１４", "１，０００", "１０：３０").
_DIGIT_GUARDED = frozenset("．，：")
_CLOSERS = frozenset("\"'”’»›)]}」』）】》〉〕］｝〗〙〛＂＇")
_OPENERS = "\"'“‘„«‹([{「『（【《〈〔［｛〖〘〚＂＇"
# The characters str.splitlines() breaks on.
_NEWLINES = frozenset("\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029")
# A buffer ending in one of these ends with a complete word even without trailing whitespace.
_FINAL_MARKS = _LATIN_TERMINATORS | _CJK_TERMINATORS | _LATIN_CLAUSE_MARKS | _CJK_CLAUSE_MARKS | _CLOSERS

_ABBREVIATIONS = frozenset(
    {
        "mr", "mrs", "ms", "messrs", "dr", "prof", "st", "jr", "sr", "vs", "etc", "inc", "ltd", "co", "corp",
        "fig", "figs", "approx", "capt", "sgt", "lt", "dept", "cf", "al", "ph.d",
    }
)  # fmt: skip
_NUMBER_ABBREVIATIONS = frozenset({"no", "nos", "vol", "p", "pp"})
_DOTTED_INITIALS = re.compile(r"[^\W\d_](?:\.[^\W\d_])+")
_WORD_CHAR = re.compile(r"[^\W_]")
_NONSPACE = re.compile(r"\S")
_NONSPACE_RUN = re.compile(r"\S+")
_WORD_END = re.compile(r"(?<=\S)\s")
_SPACE_RUN = re.compile(r"\s*")


def _char_class(chars: frozenset[str]) -> str:
    return "[" + "".join(re.escape(char) for char in sorted(chars)) + "]"


_SENTENCE_TRIGGERS = re.compile(_char_class(_LATIN_TERMINATORS | _CJK_TERMINATORS | _NEWLINES))
_CLAUSE_TRIGGERS = re.compile(
    _char_class(_LATIN_TERMINATORS | _CJK_TERMINATORS | _NEWLINES | _LATIN_CLAUSE_MARKS | _CJK_CLAUSE_MARKS)
)


class SegmenterConfig(msgspec.Struct, frozen=True):
    """How incremental text is cut into synthesis units."""

    granularity: Literal["sentence", "clause"] = "sentence"
    max_chars: int = 120
    """Forced cut when more than this many characters wait without a boundary."""
    max_wait_ms: float = 400.0
    """Forced release when the oldest buffered non-space character has waited this long."""
    min_chars: int = 1
    """No unit with fewer non-space characters than this, except from flush()."""
    max_buffer_chars: int = 100_000
    """A push that would buffer more than this raises SegmenterOverflow and changes nothing."""
    first_unit_clause: bool = True
    """The first unit of an utterance also ends at a clause mark followed by whitespace."""
    first_unit_max_words: int = 3
    """The first unit of an utterance ends after this many words at most (0: no word budget). Three words are about
    a second of audio: piper synthesizes them in under 0.1 s of CPU, and they play while the next unit's text
    arrives and is synthesized."""
    first_unit_min_words: int = 2
    """A clause mark ends the first unit only after this many words: a single word ("Sure, ") would play out before
    the next unit's text has arrived and been synthesized."""

    def __post_init__(self) -> None:
        if self.granularity not in ("sentence", "clause"):
            raise ValueError(f"granularity must be 'sentence' or 'clause', not {self.granularity!r}")
        if not 1 <= self.min_chars <= self.max_chars:
            raise ValueError("segmenter limits must satisfy 1 <= min_chars <= max_chars")
        if self.max_buffer_chars <= self.max_chars:
            raise ValueError("max_buffer_chars must exceed max_chars")
        if not self.max_wait_ms > 0:
            raise ValueError("max_wait_ms must be positive")
        if self.first_unit_max_words < 0 or self.first_unit_min_words < 1:
            raise ValueError("first_unit_max_words must be >= 0 and first_unit_min_words >= 1")


class SegmenterOverflow(Exception):
    """A push would exceed ``max_buffer_chars``; the buffer is unchanged."""

    def __init__(self, buffered_chars: int, pushed_chars: int, limit: int) -> None:
        super().__init__(f"text buffer would hold {buffered_chars + pushed_chars} characters; the limit is {limit}")
        self.buffered_chars = buffered_chars
        self.pushed_chars = pushed_chars
        self.limit = limit


class _Verdict(Enum):
    SPLIT = "split"
    KEEP = "keep"
    WAIT = "wait"


class _Judgement(NamedTuple):
    verdict: _Verdict
    content_end: int  # end of the unit's text before its trailing whitespace (SPLIT only)
    cut: int  # where the unit ends (SPLIT only)
    resume: int  # where the search for the next boundary continues (KEEP only)


_WAIT = _Judgement(_Verdict.WAIT, 0, 0, 0)


def _keep(resume: int) -> _Judgement:
    return _Judgement(_Verdict.KEEP, 0, 0, resume)


def _split(content_end: int, cut: int) -> _Judgement:
    return _Judgement(_Verdict.SPLIT, content_end, cut, 0)


def _count_nonspace(text: str, end: int) -> int:
    return len(_NONSPACE.findall(text, 0, end))


_DEFAULT_CONFIG = SegmenterConfig()


class TextSegmenter:
    """Buffers incremental text and releases units for synthesis (see the module docstring for the rules)."""

    def __init__(self, config: SegmenterConfig = _DEFAULT_CONFIG) -> None:
        self._config = config
        self._triggers = _CLAUSE_TRIGGERS if config.granularity == "clause" else _SENTENCE_TRIGGERS
        self._buffer = ""
        # Kept up to date on every change so that each push costs time in its own length, not the buffer's.
        self._content_start: int | None = None  # index of the first non-space character
        self._content_end = 0  # index after the last non-space character
        self._nonspace = 0  # non-space characters buffered
        self._base = 0  # offset of the buffer's first character in everything ever pushed
        self._arrivals: deque[tuple[int, float]] = deque()  # (end offset of a pushed chunk, its push time)
        self._scan_from = 0  # boundary candidates before this index are settled as no boundary
        self._at_line_start = True  # the buffer starts a line (start of input, after a newline or a flush)
        self._clock_floor_ms: float | None = None  # set by a timed release: the kept partial word waits anew
        self._deadline_ms: float | None = None
        self._first_unit = True  # the next unit is the first of an utterance

    @property
    def buffered(self) -> str:
        """The text not yet released."""
        return self._buffer

    def push(self, text: str, now_ms: float) -> list[str]:
        """Append ``text`` received at ``now_ms``; return the units now complete (forced ones included)."""
        limit = self._config.max_buffer_chars
        if len(self._buffer) + len(text) > limit:
            raise SegmenterOverflow(len(self._buffer), len(text), limit)
        if text:
            offset = len(self._buffer)
            self._buffer += text
            self._arrivals.append((self._base + len(self._buffer), now_ms))
            content_length = len(text.rstrip())
            if content_length:
                self._content_end = offset + content_length
                self._nonspace += len(_NONSPACE.findall(text, 0, content_length))
                if self._content_start is None:
                    first = _NONSPACE.search(text)
                    assert first is not None
                    self._content_start = offset + first.start()
            if self._deadline_ms is None:  # appending never moves a deadline that is already set
                self._refresh_deadline()
        return self._drain(now_ms)

    def poll(self, now_ms: float) -> list[str]:
        """Time has passed: return a forced unit if buffered text has waited ``max_wait_ms``."""
        return self._drain(now_ms)

    def next_deadline_ms(self) -> float | None:
        """When :meth:`poll` would next release a unit; None while nothing would be released without more text."""
        return self._deadline_ms

    def flush(self) -> list[str]:
        """End of input: release everything buffered as one unit (nothing when it is only whitespace)."""
        units = [self._take(len(self._buffer), None)] if self._content_start is not None else []
        self._at_line_start = True
        self._first_unit = True
        return units

    def clear(self) -> str:
        """Cancel: drop the buffer and return it."""
        dropped = self._buffer
        self._base += len(dropped)
        self._buffer = ""
        self._content_start = None
        self._content_end = 0
        self._nonspace = 0
        self._arrivals.clear()
        self._scan_from = 0
        self._at_line_start = True
        self._clock_floor_ms = None
        self._deadline_ms = None
        self._first_unit = True
        return dropped

    # ---- cutting ----------------------------------------------------------------------------------------------

    def _drain(self, now_ms: float) -> list[str]:
        units: list[str] = []
        while True:
            cut = self._next_cut()
            if cut is not None:
                units.append(self._take(cut, None))
                continue
            if self._deadline_ms is not None and now_ms >= self._deadline_ms:
                units.append(self._take(self._timed_cut(), now_ms))
                continue
            return units

    def _take(self, cut: int, restart_clock_ms: float | None) -> str:
        unit = self._buffer[:cut]
        self._buffer = self._buffer[cut:]
        self._base += cut
        if self._content_end > cut:
            self._content_end -= cut
            self._nonspace -= len(_NONSPACE.findall(unit))
            first = _NONSPACE.search(self._buffer)
            assert first is not None
            self._content_start = first.start()
        else:
            self._content_start = None
            self._content_end = 0
            self._nonspace = 0
        while self._arrivals and self._arrivals[0][0] <= self._base:
            self._arrivals.popleft()
        self._scan_from = 0
        trailing_space = unit[len(unit.rstrip()) :]
        self._at_line_start = any(char in _NEWLINES for char in trailing_space)
        self._clock_floor_ms = restart_clock_ms
        self._first_unit = False
        self._refresh_deadline()
        return unit

    def _refresh_deadline(self) -> None:
        if self._content_start is None or self._nonspace < self._config.min_chars:
            self._deadline_ms = None
            return
        offset = self._base + self._content_start
        started = next(at for end, at in self._arrivals if end > offset)
        if self._clock_floor_ms is not None:
            started = max(started, self._clock_floor_ms)
        self._deadline_ms = started + self._config.max_wait_ms

    def _skip_space(self, text: str, start: int) -> int:
        """The end of the whitespace run at ``start``."""
        if start >= self._content_end:
            return len(text)
        match = _SPACE_RUN.match(text, start)
        assert match is not None
        return match.end()

    def _next_cut(self) -> int | None:
        """The end of the first unit the buffered text settles, or None while undecided."""
        if self._content_start is None:
            return None
        cut = self._sentence_cut()
        if self._first_unit:
            early = self._first_unit_cut(cut)
            if early is not None:
                return early
        return cut

    def _first_unit_cut(self, sentence_cut: int | None) -> int | None:
        """A clause or word-budget cut of the first unit that comes before ``sentence_cut`` (None: not settled)."""
        config = self._config
        if not config.first_unit_clause and config.first_unit_max_words == 0:
            return None
        text = self._buffer
        end = len(text) if sentence_cut is None else sentence_cut
        for words, match in enumerate(_NONSPACE_RUN.finditer(text, self._content_start or 0, end), start=1):
            if match.end() >= len(text):
                return None  # the word may go on: undecided
            word = match.group().rstrip("".join(_CLOSERS))
            clause = (
                config.first_unit_clause
                and words >= config.first_unit_min_words
                and word[-1:] in _LATIN_CLAUSE_MARKS
                and len(word) > 1
            )
            if clause or words == config.first_unit_max_words:
                cut = match.end() + 1
                # A cut at the buffer's end is decided at once unless a sentence boundary before it is still
                # undecided (the scan stopped short of the end): first audio does not wait for the next word.
                settled = cut < end or (sentence_cut is None and self._scan_from >= len(text))
                if settled and self._acceptable(text, cut):
                    return cut
        return None

    def _sentence_cut(self) -> int | None:
        """The end of the first sentence (or clause, by granularity) unit the buffer settles, or None."""
        assert self._content_start is not None
        text = self._buffer
        # Scans stop near the limit: past it a forced cut decides, so nothing is rescanned without bound.
        limit = self._content_start + self._config.max_chars
        position = max(self._scan_from, self._content_start)
        while True:
            match = self._triggers.search(text, position)
            if match is None:
                self._scan_from = len(text)
                break
            start = match.start()
            if start >= limit:
                self._scan_from = start
                break
            judgement = self._judge(text, start, limit)
            if judgement.verdict is _Verdict.WAIT:
                self._scan_from = start
                break
            if judgement.verdict is _Verdict.SPLIT:
                if judgement.content_end > limit:
                    self._scan_from = start
                    break
                if self._acceptable(text, judgement.cut):
                    return judgement.cut
                position = judgement.cut
            else:
                position = judgement.resume
        return self._forced_cut(text, limit) if len(text) > limit else None

    def _judge(self, text: str, start: int, limit: int) -> _Judgement:
        """Whether the boundary candidate at ``start`` ends a unit, given the text so far.

        WAIT also stands for "the candidate reaches past ``limit``": the caller then cuts by force either way.
        """
        char = text[start]
        if char in _NEWLINES:
            content_end = start
            while content_end > 0 and text[content_end - 1].isspace():
                content_end -= 1
            cut = self._skip_space(text, start)
            return _WAIT if cut == len(text) else _split(content_end, cut)
        if char in _CJK_TERMINATORS or char in _CJK_CLAUSE_MARKS:
            if char in _DIGIT_GUARDED and start > 0 and text[start - 1].isdecimal():
                return _keep(start + 1)
            return _split(start + 1, start + 1)
        end = min(len(text), limit + 1)
        mark_end = start + 1
        if char in _LATIN_TERMINATORS:
            while mark_end < end and text[mark_end] in _LATIN_TERMINATORS:
                mark_end += 1
        content_end = mark_end
        while content_end < end and text[content_end] in _CLOSERS:
            content_end += 1
        if content_end == end:
            return _WAIT
        if not text[content_end].isspace():
            return _keep(content_end)
        if char in _LATIN_TERMINATORS and self._definite(text, start, mark_end, content_end):
            # Nothing that follows can undo this boundary: release it now rather than after the next word arrives.
            return _split(content_end, content_end + 1)
        cut = self._skip_space(text, content_end)
        if cut == len(text):
            return _WAIT
        if char in _LATIN_CLAUSE_MARKS:
            return _split(content_end, cut)
        line_break = any(text[i] in _NEWLINES for i in range(content_end, cut))
        if not line_break and self._continues(text, start, mark_end, text[cut]):
            return _keep(cut)
        return _split(content_end, cut)

    def _definite(self, text: str, start: int, mark_end: int, content_end: int) -> bool:
        """Whether the marks ``text[start:mark_end]`` end a sentence whatever the next word is: a plain ``!``/``?``
        run, or one ``.`` after an ordinary word. Ellipses, closing quotes (a dialogue tag may follow) and a period
        after an abbreviation, an initial or a list number wait for the next word."""
        if content_end != mark_end:
            return False
        marks = text[start:mark_end]
        if set(marks) <= {"!", "?"}:
            return True
        if marks != ".":
            return False
        word_start = start
        while word_start > 0 and not text[word_start - 1].isspace():
            word_start -= 1
        word = text[word_start:start].lstrip(_OPENERS)
        key = word.casefold()
        if not word or key in _ABBREVIATIONS or key in _NUMBER_ABBREVIATIONS:
            return False
        if (len(word) == 1 and word.isupper()) or _DOTTED_INITIALS.fullmatch(word):
            return False
        return not (word.isdecimal() and len(word) <= 3 and self._starts_line(text, word_start))

    def _continues(self, text: str, start: int, mark_end: int, follower: str) -> bool:
        """Whether the sentence goes on past the marks ``text[start:mark_end]`` given the next word's first char."""
        if follower.islower():
            return True
        if mark_end - start != 1 or text[start] != ".":
            return False
        word_start = start
        while word_start > 0 and not text[word_start - 1].isspace():
            word_start -= 1
        word = text[word_start:start].lstrip(_OPENERS)
        key = word.casefold()
        if key in _ABBREVIATIONS or (key in _NUMBER_ABBREVIATIONS and follower.isdecimal()):
            return True
        if (len(word) == 1 and word.isupper()) or _DOTTED_INITIALS.fullmatch(word):
            return True
        return word.isdecimal() and len(word) <= 3 and self._starts_line(text, word_start)

    def _starts_line(self, text: str, index: int) -> bool:
        while index > 0 and text[index - 1].isspace() and text[index - 1] not in _NEWLINES:
            index -= 1
        return text[index - 1] in _NEWLINES if index > 0 else self._at_line_start

    def _acceptable(self, text: str, cut: int) -> bool:
        if _WORD_CHAR.search(text, 0, cut) is None:
            return False
        min_chars = self._config.min_chars
        return min_chars <= 1 or _count_nonspace(text, cut) >= min_chars

    def _forced_cut(self, text: str, limit: int) -> int | None:
        """Too much text without a boundary: end the unit after the last whitespace within ``limit``."""
        min_chars = self._config.min_chars
        last_word_end = None
        for match in _WORD_END.finditer(text, 0, limit + 1):
            last_word_end = match.start()
        # Counts only grow along the text, so if the last word end is too short, every earlier one is too.
        if last_word_end is not None and _count_nonspace(text, last_word_end) >= min_chars:
            cut = self._skip_space(text, last_word_end)
            return cut if cut < len(text) else None
        if self._nonspace < min_chars:
            return None
        # One long word: cut inside it at the limit, or as soon after as min_chars allows.
        missing = min_chars - _count_nonspace(text, limit)
        if missing <= 0:
            return limit
        return [match.end() for match in _NONSPACE.finditer(text, limit)][missing - 1]

    def _timed_cut(self) -> int:
        """Text waited too long: release up to the last whitespace, keeping a trailing partial word.

        Only called with a deadline set, so the buffer holds at least ``min_chars`` non-space characters.
        """
        text = self._buffer
        min_chars = self._config.min_chars
        if not (text[-1].isspace() or text[-1] in _FINAL_MARKS):
            word_start = len(text)
            while word_start > 0 and not text[word_start - 1].isspace():
                word_start -= 1
            if _count_nonspace(text, word_start) >= min_chars:
                return word_start
        return len(text)
