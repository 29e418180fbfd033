"""The server-sent events parser of the chat client: events split anywhere, every line ending, bounded lines."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnigate.engines.openai_compat.sse import SseError, SseParser

STREAM = (
    b": keep-alive\r\n"
    b"event: message\r\n"
    b'data: {"a": 1}\r\n\r\n'
    b"id: 7\n"
    b"data: first line\n"
    b"data:second line\n\n"
    b'data: {"b": "\xc3\xa9"}\r\r'
    b"data: [DONE]\n\n"
)
EVENTS = ['{"a": 1}', "first line\nsecond line", '{"b": "é"}', "[DONE]"]


def test_a_whole_stream_gives_every_events_data() -> None:
    parser = SseParser()
    assert parser.feed(STREAM) + parser.close() == EVENTS


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_events_come_out_the_same_however_the_bytes_are_split(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(STREAM)]
    parser = SseParser()
    events: list[str] = []
    for start, end in itertools.pairwise(bounds):
        events += parser.feed(STREAM[start:end])
    assert events + parser.close() == EVENTS


def test_an_event_the_stream_ends_without_a_blank_line_still_counts() -> None:
    parser = SseParser()
    assert parser.feed(b"data: tail") == []
    assert parser.close() == ["tail"]


def test_a_body_with_no_line_end_is_refused_once_past_the_line_limit() -> None:
    parser = SseParser(max_line_bytes=64)
    parser.feed(b"x" * 64)
    with pytest.raises(SseError):
        parser.feed(b"x")


def test_a_line_that_is_not_utf8_is_refused() -> None:
    with pytest.raises(SseError):
        SseParser().feed(b"data: \xff\xfe\n\n")
