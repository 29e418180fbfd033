from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnigate.sessions.segmenter import SegmenterConfig, SegmenterOverflow, TextSegmenter

PROPERTY_SETTINGS = settings(max_examples=500, deadline=None, derandomize=True, database=None)

# Pieces that exercise every rule, mixed with arbitrary unicode below.
TOKENS = [
    "Dr.", "Mr.", "Mrs.", "U.S.", "e.g.", "etc.", "No.", "no.", "J.", "3.14", "1,000", "1,000.5", "v2.0",
    "example.com", "a.b@c.io", "Hello", "world", "hi", "I", "1.", "12", "Wait", "what", "...", "…", ".", "!",
    "?", "?!", ",", ";", ":", '"', "'", ")", "(", "“", "”", "「", "」", " ", "  ", "    ", "\n \n", "\n",
    "\n\n", "\t", "\r\n", "\u2028", "\u00a0", "你好", "世界", "。", "！", "？", "，", "、", "．", "３",
    "😀", "👍🏽", "ß", "É", "a", "Z", "9",
]  # fmt: skip

texts = st.one_of(
    st.lists(st.sampled_from(TOKENS), max_size=60).map("".join),
    st.text(max_size=120),
    st.lists(st.one_of(st.sampled_from(TOKENS), st.text(max_size=4)), max_size=40).map("".join),
)


@st.composite
def configs(draw: st.DrawFn) -> SegmenterConfig:
    max_chars = draw(st.integers(1, 60))
    return SegmenterConfig(
        granularity=draw(st.sampled_from(["sentence", "clause"])),
        max_chars=max_chars,
        max_wait_ms=draw(st.floats(1.0, 1000.0)),
        min_chars=draw(st.integers(1, min(max_chars, 8))),
        first_unit_clause=draw(st.booleans()),
        first_unit_max_words=draw(st.integers(0, 6)),
        first_unit_min_words=draw(st.integers(1, 4)),
    )


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def chunkings(text: str) -> st.SearchStrategy[list[str]]:
    return st.lists(st.integers(0, len(text)), max_size=30).map(lambda cuts: split_at(text, cuts))


def segment(chunks: list[str], config: SegmenterConfig) -> tuple[list[str], str]:
    """Push every chunk at one instant (no timed release), flush; return the units and what stays buffered."""
    segmenter = TextSegmenter(config)
    units: list[str] = []
    for chunk in chunks:
        units += segmenter.push(chunk, 0.0)
    units += segmenter.flush()
    return units, segmenter.buffered


def segment_text(text: str, config: SegmenterConfig) -> list[str]:
    units, rest = segment([text], config)
    assert (units, rest) == segment(list(text), config), "chunking changed the units"
    assert "".join(units) + rest == text
    return units


# ---- properties ----------------------------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(data=st.data(), config=configs(), text=texts)
def test_nothing_is_lost_and_every_unit_is_well_formed(data: st.DataObject, config: SegmenterConfig, text: str) -> None:
    chunks = data.draw(chunkings(text))
    times = st.floats(-1e6, 1e6, allow_nan=False)
    segmenter = TextSegmenter(config)
    released: list[str] = []
    for chunk in chunks:
        now = data.draw(times)
        units = segmenter.push(chunk, now)
        if data.draw(st.booleans()):
            now = data.draw(times)
            units += segmenter.poll(now)
        deadline = segmenter.next_deadline_ms()
        assert deadline is None or deadline > now
        for unit in units:
            assert unit.strip(), f"blank unit {unit!r}"
            assert sum(not c.isspace() for c in unit) >= config.min_chars
        released += units
    flushed = segmenter.flush()
    assert len(flushed) <= 1
    released += flushed
    assert all(unit.strip() for unit in released)
    if config.min_chars == 1:
        assert all(len(unit.strip()) <= config.max_chars for unit in released)
    assert not segmenter.buffered.strip()
    assert "".join(released) + segmenter.clear() == text
    assert segmenter.buffered == ""
    assert segmenter.next_deadline_ms() is None


@PROPERTY_SETTINGS
@given(data=st.data(), config=configs(), text=texts)
def test_units_do_not_depend_on_chunking(data: st.DataObject, config: SegmenterConfig, text: str) -> None:
    whole = segment([text], config)
    assert segment(data.draw(chunkings(text)), config) == whole
    assert segment(list(text), config) == whole


@PROPERTY_SETTINGS
@given(data=st.data(), config=configs(), text=texts)
def test_poll_releases_exactly_at_the_deadline(data: st.DataObject, config: SegmenterConfig, text: str) -> None:
    segmenter = TextSegmenter(config)
    now = 0.0
    for chunk in data.draw(chunkings(text)):
        now += data.draw(st.floats(0.0, 500.0))
        segmenter.push(chunk, now)
        deadline = segmenter.next_deadline_ms()
        if deadline is not None and data.draw(st.booleans()):
            assert segmenter.poll(math.nextafter(deadline, -math.inf)) == []
            assert segmenter.poll(deadline) != []
            now = deadline
    while (deadline := segmenter.next_deadline_ms()) is not None:
        assert segmenter.poll(deadline) != []
    # What time never releases is too short to be a unit on its own; flush() takes it.
    assert sum(not c.isspace() for c in segmenter.buffered) < config.min_chars


# ---- rules ---------------------------------------------------------------------------------------------------------

# The sentence rules, without the short first unit of an utterance (it has tests of its own below).
WHOLE: dict[str, Any] = {"first_unit_clause": False, "first_unit_max_words": 0}
SENTENCE = SegmenterConfig(**WHOLE)
CLAUSE = SegmenterConfig(granularity="clause", **WHOLE)


@pytest.mark.parametrize(
    ("text", "config", "expected"),
    [
        ("Dr. Smith is here. He left.", SENTENCE, ["Dr. Smith is here. ", "He left."]),
        ("Pi is 3.14 today.", SENTENCE, ["Pi is 3.14 today."]),
        ("Hello world! How are you?", SENTENCE, ["Hello world! ", "How are you?"]),
        ("Really?! Yes.", SENTENCE, ["Really?! ", "Yes."]),
        ("I went to the U.S. last year.", SENTENCE, ["I went to the U.S. last year."]),
        ("We met Mr. and Mrs. Lee, e.g. Tom. Bye.", SENTENCE, ["We met Mr. and Mrs. Lee, e.g. Tom. ", "Bye."]),
        ("Ask J. Smith. Now.", SENTENCE, ["Ask J. Smith. ", "Now."]),
        ("At 5 p.m. Tom came. Fine.", SENTENCE, ["At 5 p.m. Tom came. ", "Fine."]),
        ("See Fig. 3 and No. 5 here.", SENTENCE, ["See Fig. 3 and No. 5 here."]),
        ("I said no. Then I left.", SENTENCE, ["I said no. ", "Then I left."]),
        ("It cost 1,000.5 dollars in v2.0 here.", SENTENCE, ["It cost 1,000.5 dollars in v2.0 here."]),
        (
            "Visit example.com today. Mail a.b@c.io now.",
            SENTENCE,
            ["Visit example.com today. ", "Mail a.b@c.io now."],
        ),
        ("It works. then it stops.", SENTENCE, ["It works. ", "then it stops."]),
        ('He said "Stop!" and left.', SENTENCE, ['He said "Stop!" and left.']),
        ("Wait... what? Ok.", SENTENCE, ["Wait... what? ", "Ok."]),
        ("Wait... What?", SENTENCE, ["Wait... ", "What?"]),
        ('He said "Stop." Then he left.', SENTENCE, ['He said "Stop." ', "Then he left."]),
        ('"Stop!" he said. (Fine.) Go.', SENTENCE, ['"Stop!" he said. ', "(Fine.) ", "Go."]),
        ("你好。世界！", SENTENCE, ["你好。", "世界！"]),
        ("３．１４です。", SENTENCE, ["３．１４です。"]),
        ("Title\nBody text\n\nNext one", SENTENCE, ["Title\n", "Body text\n\n", "Next one"]),
        ("Dr.\nSmith", SENTENCE, ["Dr.\n", "Smith"]),
        ("Tips:\n1. Drink water.\n2. Sleep.", SENTENCE, ["Tips:\n", "1. Drink water.\n", "2. Sleep."]),
        ("He scored 3. Then he left.", SENTENCE, ["He scored 3. ", "Then he left."]),
        ("... Hello. 😀! Bye.", SENTENCE, ["... Hello. ", "😀! Bye."]),
        ("Hi. Ok. Hello there.", SegmenterConfig(min_chars=5, **WHOLE), ["Hi. Ok. ", "Hello there."]),
        ("Hello, world; ok", SENTENCE, ["Hello, world; ok"]),
        ("Hello, world; ok: yes", CLAUSE, ["Hello, ", "world; ", "ok: ", "yes"]),
        ("1,000 apples at 10:30", CLAUSE, ["1,000 apples at 10:30"]),
        ("你好，世界、好", CLAUSE, ["你好，", "世界、", "好"]),
        (
            "the quick brown fox jumps over",
            SegmenterConfig(max_chars=20, **WHOLE),
            ["the quick brown fox ", "jumps over"],
        ),
        ("abcdefghijklmnopqrstuvwxyz", SegmenterConfig(max_chars=10, **WHOLE), ["abcdefghij", "klmnopqrst", "uvwxyz"]),
        ("aaaa    bbb", SegmenterConfig(max_chars=5, **WHOLE), ["aaaa    ", "bbb"]),
        ("Hello!!!!!!!!!! Bye", SegmenterConfig(max_chars=8, **WHOLE), ["Hello!!!", "!!!!!!! ", "Bye"]),
    ],
)
def test_boundaries(text: str, config: SegmenterConfig, expected: list[str]) -> None:
    assert segment_text(text, config) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Sure, I can help with that. It shipped.", ["Sure, I can help with ", "that. ", "It shipped."]),
        ("Yes, of course, I can help. Fine.", ["Yes, of course, ", "I can help. ", "Fine."]),
        (
            "The weather in Lisbon tomorrow looks mild today. Rain later.",
            ["The weather in Lisbon tomorrow ", "looks mild today. ", "Rain later."],
        ),
        ("Hello world! How are you doing today, my friend?", ["Hello world! ", "How are you doing today, my friend?"]),
        ("It cost 1,000 dollars in all. Fine.", ["It cost 1,000 dollars in ", "all. ", "Fine."]),
        ('"Well," she said, "we could go."', ['"Well," she said, ', '"we could go."']),
        ("Okay, thanks.", ["Okay, thanks."]),
        ("Yes", ["Yes"]),
    ],
)
def test_the_first_unit_of_an_utterance_ends_at_a_clause_or_a_word_budget(text: str, expected: list[str]) -> None:
    config = SegmenterConfig(first_unit_max_words=5)
    assert segment_text(text, config) == expected
    # One character at a time gives the same units: the cut is decided by the whitespace after the word.
    units, _ = segment(list(text), config)
    assert units == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Sure, I can help with that. Bye.", ["Sure, I can ", "help with that. ", "Bye."]),
        ("Yes please, send it now.", ["Yes please, ", "send it now."]),
        ("Yes, of course, I can help.", ["Yes, of course, ", "I can help."]),
        ("Hi there! How can I help?", ["Hi there! ", "How can I help?"]),
        ("Okay, thanks.", ["Okay, thanks."]),
    ],
)
def test_the_default_first_unit_is_three_words_or_a_clause_after_two(text: str, expected: list[str]) -> None:
    assert segment_text(text, SegmenterConfig()) == expected
    units, _ = segment(list(text), SegmenterConfig())
    assert units == expected


def test_the_first_unit_is_released_by_its_whitespace_without_waiting_for_the_next_word() -> None:
    segmenter = TextSegmenter()
    assert segmenter.push("Sure, ", 0.0) == []
    assert segmenter.push("I ", 0.0) == []
    assert segmenter.push("can ", 0.0) == ["Sure, I can "]
    assert segmenter.push("help with that. ", 0.0) == ["help with that. "]


def test_the_first_unit_waits_while_a_boundary_before_its_cut_is_undecided() -> None:
    # After 'no."' a dialogue tag may follow: the boundary waits for the next word, and so does the first unit.
    segmenter = TextSegmenter()
    assert segmenter.push('He said "no." ', 0.0) == []
    assert segmenter.push(" Then", 0.0) == ['He said "no." ']
    assert segmenter.flush() == [" Then"]


@pytest.mark.parametrize(
    ("words", "unit"),
    [
        (["Sure, ", "I ", "can ", "help ", "with ", "that. "], "Sure, I can help with "),
        (["To ", "reset ", "your ", "password, ", "open ", "the "], "To reset your password, "),
    ],
)
def test_the_first_unit_is_released_by_the_whitespace_after_its_last_word(words: list[str], unit: str) -> None:
    """Text streamed a word at a time (each with its trailing space, as LLM tokens come): the first unit leaves with
    the push that completes it, not one word later."""
    segmenter = TextSegmenter(SegmenterConfig(first_unit_max_words=5))
    released = [segmenter.push(word, 50.0 * index) for index, word in enumerate(words)]
    last = len(unit.split()) - 1
    assert released[last] == [unit]
    assert all(units == [] for units in released[:last])


def test_every_utterance_starts_with_a_short_first_unit() -> None:
    segmenter = TextSegmenter(SegmenterConfig(first_unit_max_words=3, first_unit_min_words=1))
    assert segmenter.push("Well, that was fun. Bye now.", 0.0) == ["Well, ", "that was fun. "]
    assert segmenter.flush() == ["Bye now."]
    assert segmenter.push("One two three four five. Six.", 0.0) == ["One two three ", "four five. "]
    segmenter.clear()
    assert segmenter.push("Again, please", 0.0) == ["Again, "]


def test_the_first_unit_respects_min_chars() -> None:
    segmenter = TextSegmenter(SegmenterConfig(min_chars=8, first_unit_max_words=0, first_unit_min_words=1))
    assert segmenter.push("Ok, so we go now, right? ", 0.0) == ["Ok, so we go now, "]


def test_cjk_marks_split_at_once_without_flush() -> None:
    segmenter = TextSegmenter()
    assert segmenter.push("你好。世界！", 0.0) == ["你好。", "世界！"]
    assert segmenter.buffered == ""


def test_a_plain_sentence_is_released_by_its_whitespace_an_ambiguous_one_by_the_next_word() -> None:
    segmenter = TextSegmenter()
    assert segmenter.push("Hello world.", 0.0) == []
    assert segmenter.push(" ", 0.0) == ["Hello world. "]
    assert segmenter.push("Dr", 0.0) == []
    assert segmenter.push(". ", 0.0) == []  # "Dr." may go on ("Dr. Smith"): wait for the next word
    assert segmenter.push("Smith left! ", 0.0) == ["Dr. Smith left! "]
    assert segmenter.push("Ask Mr. ", 0.0) == []
    assert segmenter.push("Brown.", 0.0) == []
    assert segmenter.flush() == ["Ask Mr. Brown."]


def test_whitespace_only_remainder_stays_buffered_after_flush() -> None:
    segmenter = TextSegmenter()
    assert segmenter.push("你好。\n", 0.0) == ["你好。"]
    assert segmenter.flush() == []
    assert segmenter.buffered == "\n"
    assert segmenter.next_deadline_ms() is None
    assert segmenter.push("再见", 0.0) == []
    assert segmenter.flush() == ["\n再见"]


def test_max_wait_releases_up_to_the_last_whitespace() -> None:
    segmenter = TextSegmenter(SegmenterConfig(max_wait_ms=400.0))
    assert segmenter.next_deadline_ms() is None
    assert segmenter.push("Hello wor", 100.0) == []
    assert segmenter.next_deadline_ms() == 500.0
    assert segmenter.poll(499.9) == []
    assert segmenter.poll(500.0) == ["Hello "]
    assert segmenter.buffered == "wor"
    # The kept partial word gets its own max_wait from the release.
    assert segmenter.next_deadline_ms() == 900.0
    assert segmenter.push("ld", 600.0) == []
    assert segmenter.poll(900.0) == ["world"]
    assert segmenter.next_deadline_ms() is None


def test_max_wait_releases_a_finished_sentence_whole() -> None:
    segmenter = TextSegmenter()
    assert segmenter.push("Hello world.", 0.0) == []
    assert segmenter.poll(400.0) == ["Hello world."]


def test_push_releases_text_whose_deadline_has_passed() -> None:
    segmenter = TextSegmenter()
    assert segmenter.push("Hello wor", 0.0) == []
    assert segmenter.push("ld and", 450.0) == ["Hello world "]
    assert segmenter.buffered == "and"
    assert segmenter.next_deadline_ms() == 850.0


def test_max_wait_counts_from_the_first_non_space_character() -> None:
    segmenter = TextSegmenter()
    assert segmenter.push("你好。 ", 0.0) == ["你好。"]
    assert segmenter.next_deadline_ms() is None
    assert segmenter.push("世界", 1000.0) == []
    assert segmenter.next_deadline_ms() == 1400.0


def test_max_wait_respects_min_chars() -> None:
    segmenter = TextSegmenter(SegmenterConfig(min_chars=5))
    assert segmenter.push("Hi", 0.0) == []
    assert segmenter.next_deadline_ms() is None
    assert segmenter.poll(10_000.0) == []
    assert segmenter.push(" wonderf", 100.0) == []
    assert segmenter.next_deadline_ms() == 400.0
    # "Hi " alone is too short, so the partial word goes with it.
    assert segmenter.poll(400.0) == ["Hi wonderf"]


def test_overflow_raises_and_leaves_the_buffer_unchanged() -> None:
    segmenter = TextSegmenter(SegmenterConfig(max_chars=5, max_buffer_chars=10))
    assert segmenter.push("abcd", 0.0) == []
    with pytest.raises(SegmenterOverflow) as raised:
        segmenter.push("efghijk", 0.0)
    assert (raised.value.buffered_chars, raised.value.pushed_chars, raised.value.limit) == (4, 7, 10)
    assert segmenter.buffered == "abcd"
    assert segmenter.push("ef", 0.0) == ["abcde"]
    assert segmenter.flush() == ["f"]


def test_clear_returns_and_drops_the_buffer() -> None:
    segmenter = TextSegmenter()
    assert segmenter.push("Hello. Wor", 0.0) == ["Hello. "]
    assert segmenter.clear() == "Wor"
    assert segmenter.buffered == ""
    assert segmenter.next_deadline_ms() is None
    assert segmenter.poll(1e9) == []
    assert segmenter.push("1. New start. Yes", 2e9) == ["1. New start. "]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_chars": 0},
        {"min_chars": 10, "max_chars": 5},
        {"max_chars": 0},
        {"max_wait_ms": 0.0},
        {"max_chars": 100, "max_buffer_chars": 100},
        {"granularity": "word"},
    ],
)
def test_invalid_config_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - every invalid field raises the same type
        SegmenterConfig(**kwargs)  # type: ignore[arg-type]
