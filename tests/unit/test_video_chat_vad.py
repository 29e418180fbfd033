"""Server VAD of a video-chat call ends a spoken question (a scripted detector: one probability per piece)."""

from __future__ import annotations

from omnigate.gateway.video_chat.call import END_WINDOWS, SpokenQuestions


class ScriptedVad:
    def __init__(self) -> None:
        self.next: list[float] = []

    def process(self, pcm: bytes) -> list[float]:
        out, self.next = self.next, []
        return out


PIECE = b"\x10\x00" * 1536  # 32 ms at 48 kHz


def test_speech_then_silence_is_one_question_with_its_lead_in() -> None:
    vad = ScriptedVad()
    questions = SpokenQuestions(vad, max_bytes=1 << 20)  # type: ignore[arg-type]
    for _ in range(3):
        vad.next = [0.1]
        assert questions.push(PIECE) is None
    vad.next = [0.9]
    assert questions.push(PIECE) is None
    results = []
    for _ in range(END_WINDOWS + 2):
        vad.next = [0.1]
        result = questions.push(PIECE)
        if result is not None:
            results.append(result)
    assert len(results) == 1
    # 16 kHz: lead-in (3 quiet pieces + the speech piece) and the quiet tail up to the end, never more
    assert 0 < len(results[0]) <= (4 + END_WINDOWS + 2) * 1024 + 64


def test_silence_alone_asks_nothing() -> None:
    vad = ScriptedVad()
    questions = SpokenQuestions(vad, max_bytes=1 << 20)  # type: ignore[arg-type]
    for _ in range(100):
        vad.next = [0.2]
        assert questions.push(PIECE) is None
