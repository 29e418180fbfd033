"""The simulated jitter-buffer player, on crafted arrival timelines."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnigate.loadtest.player import JitterBufferPlayer, PlayerResult


def play(arrivals: list[tuple[float, float]], complete_s: float, jitter_ms: float = 100.0) -> PlayerResult:
    player = JitterBufferPlayer(jitter_ms)
    for arrival_s, audio_ms in arrivals:
        player.feed(arrival_s, audio_ms)
    return player.finish(complete_s)


def realtime(start_s: float, count: int, chunk_ms: float = 40.0) -> list[tuple[float, float]]:
    return [(start_s + i * chunk_ms / 1000.0, chunk_ms) for i in range(count)]


def test_realtime_delivery_never_underruns_and_starts_after_the_jitter_buffer() -> None:
    result = play(realtime(10.0, 50), complete_s=12.0)
    assert result.underruns == 0
    assert result.stall_ms == 0.0
    assert result.audio_ms == pytest.approx(2000.0)
    # 100 ms buffered once the third 40 ms chunk is in, 80 ms after the first byte.
    assert result.start_delay_ms == pytest.approx(80.0)


def test_a_gap_in_the_middle_is_one_underrun_with_its_stall_time() -> None:
    # Playback starts at 0.08 s with 120 ms buffered and runs dry at 0.20 s. Audio resumes at 1.00 s and the
    # jitter buffer is full again at 1.08 s: 880 ms stalled.
    arrivals = realtime(0.0, 3) + realtime(1.0, 3)
    result = play(arrivals, complete_s=1.3)
    assert result.underruns == 1
    assert result.stall_ms == pytest.approx(880.0)


def test_two_gaps_are_two_underruns() -> None:
    arrivals = realtime(0.0, 3) + realtime(1.0, 3) + realtime(3.0, 3)
    result = play(arrivals, complete_s=3.5)
    assert result.underruns == 2
    # Second gap: resumed at 1.08 with 120 ms, dry at 1.20, refilled at 3.08.
    assert result.stall_ms == pytest.approx(880.0 + 1880.0)


def test_running_dry_at_the_end_of_the_utterance_is_not_an_underrun() -> None:
    result = play(realtime(0.0, 10), complete_s=5.0)
    assert result.underruns == 0
    assert result.stall_ms == 0.0


def test_an_utterance_shorter_than_the_jitter_buffer_plays_when_complete() -> None:
    result = play(realtime(0.0, 2), complete_s=0.5)
    assert result.underruns == 0
    assert result.start_delay_ms == pytest.approx(500.0)


def test_a_tail_shorter_than_the_jitter_buffer_stalls_until_completion() -> None:
    # Dry at 0.20 s; one more chunk at 1.0 s (an underrun) never fills the buffer; completion at 1.5 s resumes.
    arrivals = [*realtime(0.0, 3), (1.0, 40.0)]
    result = play(arrivals, complete_s=1.5)
    assert result.underruns == 1
    assert result.stall_ms == pytest.approx(1300.0)


def test_zero_jitter_starts_on_the_first_byte() -> None:
    result = play([(2.0, 40.0), (2.2, 40.0)], complete_s=2.3, jitter_ms=0.0)
    assert result.start_delay_ms == 0.0
    assert result.underruns == 1
    assert result.stall_ms == pytest.approx(160.0)


def test_audio_delivered_at_once_never_underruns() -> None:
    result = play([(0.0, 40.0)] * 100, complete_s=0.0)
    assert result.underruns == 0
    assert result.audio_ms == pytest.approx(4000.0)


def test_empty_chunks_are_ignored_and_no_audio_gives_an_empty_result() -> None:
    result = play([(0.0, 0.0)], complete_s=1.0)
    assert result == PlayerResult(audio_ms=0.0, underruns=0, stall_ms=0.0, start_delay_ms=0.0)


def test_negative_jitter_is_refused() -> None:
    with pytest.raises(ValueError, match="jitter"):
        JitterBufferPlayer(-1.0)


@given(
    durations=st.lists(st.floats(min_value=1.0, max_value=100.0), min_size=1, max_size=60),
    slack=st.lists(st.floats(min_value=0.001, max_value=0.5), min_size=60, max_size=60),
)
def test_audio_that_always_arrives_before_it_is_needed_never_underruns(
    durations: list[float], slack: list[float]
) -> None:
    # With no jitter buffer, chunk i is needed at first byte + the audio before it; each arrives earlier than that.
    arrivals: list[tuple[float, float]] = [(0.0, durations[0])]
    needed_s = durations[0] / 1000.0
    for index, duration in enumerate(durations[1:]):
        arrival_s = max(arrivals[-1][0], needed_s - slack[index])
        arrivals.append((arrival_s, duration))
        needed_s += duration / 1000.0
    result = play(arrivals, complete_s=arrivals[-1][0], jitter_ms=0.0)
    assert result.underruns == 0
    assert result.stall_ms == 0.0


@given(
    arrivals=st.lists(
        st.tuples(st.floats(min_value=0.0, max_value=10.0), st.floats(min_value=0.0, max_value=200.0)),
        max_size=40,
    ),
    jitter_ms=st.floats(min_value=0.0, max_value=500.0),
)
def test_counts_stay_within_bounds_for_any_timeline(arrivals: list[tuple[float, float]], jitter_ms: float) -> None:
    ordered = sorted(arrivals)
    result = play(ordered, complete_s=11.0, jitter_ms=jitter_ms)
    chunks = sum(1 for _, ms in ordered if ms > 0)
    assert 0 <= result.underruns <= max(0, chunks - 1)
    assert result.stall_ms >= 0.0
    assert result.audio_ms == pytest.approx(sum(ms for _, ms in ordered if ms > 0))
    assert (result.stall_ms > 0) <= (result.underruns > 0)
