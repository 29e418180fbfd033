"""What a target records while a session runs: timestamps of text sent and audio received. Sans-I/O.

Targets call these recorders with ``time.perf_counter()`` readings; the report is computed from them afterwards, so
the measuring path does nothing but append to lists.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import Literal

from omnigate.loadtest.corpus import unit_end_offset
from omnigate.loadtest.player import JitterBufferPlayer, PlayerResult

UtteranceStatus = Literal["running", "completed", "failed", "cut_off"]
SessionStatus = Literal["running", "completed", "failed", "cut_off"]
_MAX_DETAIL_CHARS = 300


class UtteranceTrace:
    """Timeline of one utterance: text sent, units started, audio chunks received, completion."""

    def __init__(self, index: int, text: str, started_s: float) -> None:
        self.index = index
        self.text = text
        self.started_s = started_s
        self.sends: list[tuple[float, int]] = []
        """(time, characters of ``text`` sent so far)."""
        self.first_unit_text: str | None = None
        self.units = 0
        self.sample_rate = 24_000
        self.arrivals: list[tuple[float, float, int]] = []
        """(time, audio ms, bytes) of each audio chunk."""
        self.bytes = 0
        self.completed_s: float | None = None
        self.status: UtteranceStatus = "running"
        self.steps: dict[str, float] = {}
        """A conversational turn's steps, ms (the realtime target's talk mode: ``voice_to_voice``, ``transcription``,
        ``first_token``, ``first_audio``, ...)."""

    def text_sent(self, now_s: float, sent_chars: int) -> None:
        self.sends.append((now_s, sent_chars))

    def unit_started(self, sentence_text: str, sample_rate: int) -> None:
        if self.first_unit_text is None:
            self.first_unit_text = sentence_text
        self.units += 1
        self.sample_rate = sample_rate

    def audio(self, now_s: float, nbytes: int, audio_ms: float | None = None) -> None:
        """A chunk of ``nbytes`` arrived: mono s16le PCM at the current unit's sample rate, or, for an encoded
        format, ``audio_ms`` of audio (what decoding it gave)."""
        duration_ms = nbytes / 2 * 1000.0 / self.sample_rate if audio_ms is None else audio_ms
        self.arrivals.append((now_s, duration_ms, nbytes))
        self.bytes += nbytes

    def finish(self, now_s: float, status: UtteranceStatus) -> None:
        """The utterance ended (the terminal event arrived, or it failed). The first call wins."""
        if self.status == "running":
            self.completed_s = now_s
            self.status = status

    @property
    def audio_ms(self) -> float:
        return sum(ms for _, ms, _ in self.arrivals)

    def ttfa_reference_s(self) -> float | None:
        """When the last character of the first synthesis unit was sent.

        The unit's text comes from the server's first ``audio.start``; without it (a transport that does not
        report units) the reference is the moment the whole text had been sent.
        """
        if not self.sends:
            return None
        target = len(self.text)
        if self.first_unit_text is not None:
            target = unit_end_offset(self.text, self.first_unit_text) or target
        for sent_s, sent_chars in self.sends:
            if sent_chars >= target:
                return sent_s
        return self.sends[-1][0]

    def ttfa_ms(self) -> float | None:
        """From the end of the first unit sent to the first audio byte."""
        reference = self.ttfa_reference_s()
        if reference is None or not self.arrivals:
            return None
        return (self.arrivals[0][0] - reference) * 1000.0

    def gaps_ms(self) -> list[float]:
        """Time between consecutive audio chunks."""
        times = [t for t, _, _ in self.arrivals]
        return [(later - earlier) * 1000.0 for earlier, later in itertools.pairwise(times)]

    def rtf(self) -> float | None:
        """Wall time from the first text sent to the last audio byte, over the audio's duration."""
        audio_ms = self.audio_ms
        if not self.sends or not self.arrivals or audio_ms <= 0:
            return None
        return (self.arrivals[-1][0] - self.sends[0][0]) * 1000.0 / audio_ms

    def play(self, jitter_ms: float) -> PlayerResult:
        """Replay the arrivals through a jitter-buffer player."""
        player = JitterBufferPlayer(jitter_ms)
        for arrival_s, audio_ms, _ in self.arrivals:
            player.feed(arrival_s, audio_ms)
        end_s = self.completed_s
        if end_s is None:
            end_s = self.arrivals[-1][0] if self.arrivals else self.started_s
        return player.finish(end_s)


class SessionTrace:
    """Timeline of one session (one connection or one request) and the errors it met, by code."""

    def __init__(self, session_id: int, started_s: float) -> None:
        self.session_id = session_id
        self.started_s = started_s
        self.connected_s: float | None = None
        self.ended_s: float | None = None
        self.utterances: list[UtteranceTrace] = []
        self.errors: Counter[str] = Counter()
        self.error_details: dict[str, str] = {}
        """The first message seen for each error code."""
        self.status: SessionStatus = "running"
        self.negotiated: dict[str, str] = {}
        """What the server answered to what the client asked: WebSocket extensions, audio format, content type."""
        self.last_utterance_start_s = math.inf
        """The level stops at this time: no utterance should begin later (the runner sets it)."""

    def connected(self, now_s: float) -> None:
        self.connected_s = now_s

    def record_negotiated(self, key: str, value: str) -> None:
        """What was agreed for ``key`` on this session (the first answer is kept)."""
        self.negotiated.setdefault(key, value)

    def may_begin_utterance(self, now_s: float) -> bool:
        """Whether a new utterance may begin now; a session that may not should close (the level is over)."""
        return now_s < self.last_utterance_start_s

    def begin_utterance(self, now_s: float, text: str) -> UtteranceTrace:
        utterance = UtteranceTrace(len(self.utterances), text, now_s)
        self.utterances.append(utterance)
        return utterance

    def error(self, code: str, detail: str | None = None) -> None:
        self.errors[code] += 1
        if detail and code not in self.error_details:
            self.error_details[code] = detail[:_MAX_DETAIL_CHARS]

    def end(self, now_s: float) -> None:
        """The session ended on its own: failed if it met any error, completed otherwise."""
        if self.status != "running":
            return
        self.ended_s = now_s
        for utterance in self.utterances:
            if utterance.status == "running":
                self.error("utterance_incomplete")
                utterance.finish(now_s, "failed")
        self.status = "failed" if self.errors else "completed"

    def cut_off(self, now_s: float) -> None:
        """The run ended before the session did; its unfinished utterances are not measured."""
        if self.status != "running":
            return
        self.ended_s = now_s
        for utterance in self.utterances:
            utterance.finish(now_s, "cut_off")
        self.status = "cut_off"
