"""The realtime session core with a streaming recognizer: each turn's audio goes out as it comes (``HearAudio``),
the turn's ``Transcribe`` carries the rest, and a turn that is no turn is dropped (``ForgetAudio``)."""

from __future__ import annotations

import random

from omnigate.engines.vad import WINDOW_MS
from omnigate.sessions.realtime.answer import ResponderPolicy
from omnigate.sessions.realtime.requests import ForgetAudio, HearAudio, Transcribe
from tests.unit.test_realtime_session import Harness, append, event

STREAMING = ResponderPolicy(transcription=True, streaming_transcription=True)
BATCH = ResponderPolicy(transcription=True)
NO_VAD = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}


def noise_ms(rng: random.Random, ms: float) -> bytes:
    """Distinct bytes, so that a misplaced piece of audio shows."""
    return rng.randbytes(int(48 * ms) // 2 * 2)


def vad_turn_in_two_scorings(h: Harness) -> None:
    """Silence, then speech scored while it is heard, then the pause that ends the turn."""
    rng = random.Random(7)
    h.send(append(noise_ms(rng, WINDOW_MS * 20)))
    h.session.speech_scored([0.0] * 20, h.now)
    h.send(append(noise_ms(rng, WINDOW_MS * 12)))
    h.session.speech_scored([0.9] * 12, h.now)
    h.send(append(noise_ms(rng, WINDOW_MS * 20)))
    h.session.speech_scored([0.0] * 20, h.now)


def heard(h: Harness) -> list[bytes]:
    return [request.pcm for request in h.requests if isinstance(request, HearAudio)]


def test_a_detected_turn_streams_as_it_is_scored_and_adds_up_to_the_whole_turn() -> None:
    streaming, batch = Harness(STREAMING), Harness(BATCH)
    for h in (streaming, batch):
        vad_turn_in_two_scorings(h)
    [whole] = [request for request in batch.requests if isinstance(request, Transcribe)]
    pieces = heard(streaming)
    [end] = [request for request in streaming.requests if isinstance(request, Transcribe)]
    # The speech went out while it was scored, before the turn ended; the end carries only the rest.
    assert pieces and streaming.requests.index(end) > max(
        i for i, request in enumerate(streaming.requests) if isinstance(request, HearAudio)
    )
    assert b"".join(pieces) + end.pcm == whole.pcm
    assert end.item_id == whole.item_id
    streaming.session.transcribed(end.item_id, "hello", streaming.now)
    [completed] = [e for e in streaming.drain() if e["type"] == "conversation.item.input_audio_transcription.completed"]
    # The usage counts the whole turn, not only what the end carried.
    assert completed["usage"]["seconds"] == round(len(whole.pcm) / 48 / 1000, 3)


def test_without_a_detector_every_append_is_heard_at_once_and_the_commit_ends_the_turn() -> None:
    h = Harness(STREAMING)
    h.send(event("session.update", session=NO_VAD))
    rng = random.Random(3)
    appended = [noise_ms(rng, 100) for _ in range(3)]
    for pcm in appended:
        h.send(append(pcm))
    assert heard(h) == appended
    h.send(event("input_audio_buffer.commit"))
    end = h.requests[-1]
    assert isinstance(end, Transcribe) and end.pcm == b""
    h.send(append(appended[0]))
    assert heard(h)[-1] == appended[0]  # the next turn's audio goes out as its own


def test_a_cleared_buffer_forgets_what_was_heard() -> None:
    h = Harness(STREAMING)
    h.send(event("session.update", session=NO_VAD))
    h.send(append(bytes(4800)))
    h.send(event("input_audio_buffer.clear"))
    assert isinstance(h.requests[-1], ForgetAudio)
    h.send(event("input_audio_buffer.clear"))  # nothing heard since: nothing to forget
    assert sum(isinstance(request, ForgetAudio) for request in h.requests) == 1


def test_a_turn_refused_for_the_backlog_forgets_what_was_heard() -> None:
    h = Harness(ResponderPolicy(transcription=True, streaming_transcription=True, max_pending_transcriptions=1))
    h.send(event("session.update", session=NO_VAD))
    for _ in range(2):
        h.send(append(bytes(4800)))
        h.send(event("input_audio_buffer.commit"))
    assert sum(isinstance(request, Transcribe) for request in h.requests) == 1
    assert isinstance(h.requests[-2], ForgetAudio)  # (then the failure, for the metrics)
    failed = [e for e in h.drain() if e["type"] == "conversation.item.input_audio_transcription.failed"]
    assert [e["error"]["code"] for e in failed] == ["asr_backlog"]


def test_a_batch_recognizer_gets_no_streamed_audio() -> None:
    h = Harness(BATCH)
    vad_turn_in_two_scorings(h)
    assert not heard(h)
    assert not any(isinstance(request, ForgetAudio) for request in h.requests)
