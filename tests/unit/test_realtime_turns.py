"""Turn detection from VAD windows, model turns of a duplex engine, and G.711."""

from __future__ import annotations

import numpy as np
import pytest

from omnigate.codecs.g711 import alaw_decode, alaw_encode, ulaw_decode, ulaw_encode
from omnigate.sessions.realtime.model_turns import ModelTurns
from omnigate.sessions.realtime.turns import SpeechStarted, SpeechStopped, TurnDetectionSettings, TurnDetector


def run(detector: TurnDetector, probabilities: list[float]) -> list[tuple[int, object]]:
    return [(i, event) for i, p in enumerate(probabilities) if (event := detector.feed(p)) is not None]


def test_speech_start_reaches_back_by_the_prefix_and_stop_waits_for_the_silence() -> None:
    detector = TurnDetector(TurnDetectionSettings(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=500), 32.0)
    # 15 quiet windows (480 ms) inside the speech are a pause, not the end of the turn.
    probabilities = [0.1] * 20 + [0.9] * 10 + [0.2] * 15 + [0.9] + [0.1] * 20
    events = run(detector, probabilities)
    # Window 20 starts at 640 ms; 16 quiet windows (512 ms) after window 45 end the turn at window 61's end.
    assert events == [(20, SpeechStarted(340)), (61, SpeechStopped(62 * 32))]
    assert not detector.speaking


def test_a_pause_shorter_than_the_silence_duration_keeps_the_turn() -> None:
    detector = TurnDetector(TurnDetectionSettings(silence_duration_ms=500), 32.0)
    events = run(detector, [0.9] * 5 + [0.1] * 10 + [0.9] * 5 + [0.1] * 16)
    assert [type(e) for _, e in events] == [SpeechStarted, SpeechStopped]
    assert events[1] == (35, SpeechStopped(round(36 * 32.0)))


def test_skipped_audio_moves_the_clock() -> None:
    detector = TurnDetector(TurnDetectionSettings(prefix_padding_ms=0), 32.0)
    detector.skip(1000.0)
    assert detector.feed(0.99) == SpeechStarted(1000)


def test_a_turn_that_never_pauses_ends_at_the_maximum_length_and_the_next_one_starts() -> None:
    detector = TurnDetector(TurnDetectionSettings(prefix_padding_ms=300), 32.0, max_turn_ms=640.0)
    events = run(detector, [0.1] * 20 + [0.9] * 25 + [0.1] * 16)
    # The turn starts at 340 ms (window 20 at 640 ms, padded back 300 ms); window 30 ends at 992 ms, 652 ms later.
    assert events[:2] == [(20, SpeechStarted(340)), (30, SpeechStopped(992, forced=True))]
    # Speech goes on: a new turn starts at once, its padding no earlier than the forced end; it ends in silence.
    assert events[2:] == [(31, SpeechStarted(992)), (60, SpeechStopped(61 * 32))]
    assert not detector.speaking


def test_model_turns_group_speaking_frames_and_mute_after_an_interruption() -> None:
    turns = ModelTurns(end_frames=3, max_mute_frames=4)
    roles = [turns.feed(listening) for listening in [True, False, False, True, False, True, True, True, True]]
    assert roles == ["listen", "start", "speak", "speak", "speak", "speak", "speak", "end", "listen"]
    assert turns.feed(False) == "start"
    turns.interrupt()
    assert [turns.feed(False) for _ in range(3)] == ["listen"] * 3  # still talking over the cancel: not heard
    assert turns.feed(True) == "listen"
    assert turns.feed(False) == "start"  # it listened once: a new turn
    turns.interrupt()
    assert [turns.feed(False) for _ in range(5)] == ["listen"] * 4 + ["start"]  # talking on for the whole mute
    with pytest.raises(ValueError, match="at least one"):
        ModelTurns(0, 1)


@pytest.mark.parametrize(
    ("encode", "decode", "step"), [(ulaw_encode, ulaw_decode, 0.07), (alaw_encode, alaw_decode, 0.07)]
)
def test_g711_round_trips_within_one_quantisation_step(encode: object, decode: object, step: float) -> None:
    pcm = (np.sin(np.linspace(0, 60, 8000)) * 20000).astype("<i2")
    coded = encode(pcm.tobytes())  # type: ignore[operator]
    assert len(coded) == pcm.size
    back = np.frombuffer(decode(coded), dtype="<i2").astype(np.int64)  # type: ignore[operator]
    error = np.abs(back - pcm.astype(np.int64))
    assert np.all(error <= np.maximum(step * np.abs(pcm.astype(np.int64)), 40))


def test_g711_matches_reference_code_points() -> None:
    samples = np.array([0, -1, 32767, -32768], dtype="<i2").tobytes()
    assert ulaw_encode(samples).hex() == "ff7e8000"
    assert alaw_encode(samples).hex() == "d555aa2a"
    assert np.frombuffer(ulaw_decode(bytes([0xFF, 0x00])), "<i2").tolist() == [0, -32124]
    assert np.frombuffer(alaw_decode(bytes([0xD5, 0x2A])), "<i2").tolist() == [8, -32256]
