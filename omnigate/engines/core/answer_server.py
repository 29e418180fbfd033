"""The core side of answers: one gateway connection's answers on the core's :class:`AnsweringEngine`.

An ``ANSWER_OPEN`` encodes the conversation's speech off the loop (each speech once: later answers of the
connection reuse its encoding), then submits the answer. A turn the gateway sent as it was heard (``ANSWER_HEAR``,
under the speech id its answer carries) was encoded window by window meanwhile, and only its rest is encoded then.
The engine's admission (every slot answering: ``engine_busy``) is the core's, shared by every gateway connection, so
several gateway workers admit exactly the engine's room. What the engine delivers for an answer in one turn of the
core's loop leaves as one ``ANSWER_OUTPUTS``, its end as ``ANSWER_ENDED``; writes never wait (an answer makes no more
audio than its session's credit). The engine's input encoder counters go to the gateway as ``ANSWER_STATS`` (for its
``/metrics``). A connection that drops cancels its answers at once, freeing their slots.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omnigate.engines.answering import AnswerHandle, AnsweringEngine, PromptTurn, TurnHearing
from omnigate.engines.base import EngineError
from omnigate.engines.core.answer_protocol import (
    ENCODER,
    AnswerEnded,
    AnswerGrant,
    AnswerInfo,
    AnswerOpen,
    AnswerOutputs,
    AudioChunk,
    TextDelta,
)
from omnigate.engines.core.framing import Frame, FrameError, FrameKind, decode_body, encode_frame
from omnigate.engines.core.stats_push import push_stats
from omnigate.engines.qwen3_omni.encoder_stats import EncoderStats

log = logging.getLogger(__name__)

# The encoded speech a connection's answers reuse (by the gateway's speech id), least recently used dropped first:
# at most this many audio-token rows (about 87 minutes of speech at 12.5 rows a second).
ENCODED_ROWS = 65_536
# Turns a connection is hearing (in progress, or committed and not yet answered), the oldest forgotten past it: a turn
# forgotten early is encoded whole when its answer comes.
MAX_HEARINGS = 512

Send = Callable[[bytes], None]
"""Writes bytes on the connection without waiting."""


@dataclass(eq=False)
class _Answer:
    call: int
    starting: asyncio.Task[None] | None = None  # encoding the speech, then submitting
    handle: AnswerHandle | None = None
    granted: int = 0  # a grant that came while the answer was starting
    outputs: list[TextDelta | AudioChunk] = field(default_factory=list)


class AnswerLink:
    """The answers of one gateway connection. Runs on the core's event loop."""

    def __init__(self, engine: AnsweringEngine, send: Send, backlog: Callable[[], int]) -> None:
        self._engine = engine
        self._send = send
        self._backlog = backlog
        self._stats: asyncio.Task[None] | None = None
        self._answers: dict[int, _Answer] = {}  # by the gateway's answer id; bounded by the engine's slots
        self._pending: list[_Answer] = []  # answers with outputs to flush this loop turn
        self._encoded: OrderedDict[int, Any] = OrderedDict()  # speech id -> audio tokens; ENCODED_ROWS at most
        self._encoded_rows = 0
        self._hearings: OrderedDict[int, TurnHearing] = OrderedDict()  # by speech id; MAX_HEARINGS at most
        self._flush_scheduled = False

    def handle(self, frame: Frame) -> None:
        """One ANSWER_* frame from the gateway. Raises :class:`FrameError` for one that breaks the protocol."""
        kind, call = frame.kind, frame.call
        if kind is FrameKind.ANSWER_HELLO:
            self._send(encode_frame(FrameKind.ANSWER_INFO, 0, ENCODER.encode(AnswerInfo(self._engine.info))))
            stats = getattr(self._engine, "encoder_stats", None)
            if isinstance(stats, EncoderStats) and self._stats is None:
                pushing = push_stats(stats, FrameKind.ANSWER_STATS, self._send, self._backlog)
                self._stats = asyncio.get_running_loop().create_task(pushing, name="answer-core-stats")
        elif kind is FrameKind.ANSWER_OPEN:
            if call in self._answers:
                raise FrameError(f"answer {call} is already open")
            request = decode_body(frame.body, AnswerOpen)
            opened = self._answers[call] = _Answer(call)
            opened.starting = asyncio.get_running_loop().create_task(self._start(opened, request), name="core-answer")
        elif kind is FrameKind.ANSWER_CANCEL:
            cancelled = self._answers.pop(call, None)
            if cancelled is not None:
                self._stop(cancelled)
        elif kind is FrameKind.ANSWER_HEAR:
            self._hear(call, frame.body)
        elif kind is FrameKind.ANSWER_FORGET:
            forgotten = self._hearings.pop(call, None)
            if forgotten is not None:
                forgotten.close()
        elif kind is FrameKind.ANSWER_GRANT:
            chunks = decode_body(frame.body, AnswerGrant).chunks
            granted = self._answers.get(call)
            if granted is not None:
                granted.granted = max(granted.granted, chunks)
                if granted.handle is not None:
                    granted.handle.grant(chunks)
        else:
            raise FrameError(f"a gateway may not send {kind.name}")

    def close(self) -> None:
        """The connection is gone: stop every answer it held now."""
        if self._stats is not None:
            self._stats.cancel()
        answers, self._answers = list(self._answers.values()), {}
        for answer in answers:
            self._stop(answer)
        hearings, self._hearings = list(self._hearings.values()), OrderedDict()
        for hearing in hearings:
            hearing.close()

    # ---- internals --------------------------------------------------------------------------------------------

    @staticmethod
    def _stop(answer: _Answer) -> None:
        if answer.starting is not None:
            answer.starting.cancel()
        if answer.handle is not None:
            answer.handle.cancel()

    async def _start(self, answer: _Answer, request: AnswerOpen) -> None:
        try:
            turns: list[PromptTurn] = []
            for turn in request.turns:
                tokens = None
                if turn.speech is not None:
                    tokens = await self._encode(turn.speech, turn.speech_id)
                turns.append((turn.role, turn.text, tokens))
            answer.handle = self._engine.answer(
                turns,
                _Sink(self, answer),
                instructions=request.instructions,
                speaker=request.speaker,
                max_tokens=request.max_tokens,
                max_frames=request.max_frames,
                credit=request.credit,
            )
            if answer.granted:
                answer.handle.grant(answer.granted)
        except EngineError as exc:
            self.finish(answer, AnswerEnded("error", exc.code, exc.message))
        except Exception as exc:  # the gateway's session hears it, typed
            log.exception("an answer could not start in the engine core")
            self.finish(answer, AnswerEnded("error", "internal_error", f"{type(exc).__name__}: {exc}"))
        finally:
            answer.starting = None

    def _hear(self, speech_id: int, pcm: bytes) -> None:
        hearing = self._hearings.get(speech_id)
        if hearing is None:
            hearing = self._engine.turn_ahead()
            if hearing is None:
                return  # the engine encodes a turn at its end only
            self._hearings[speech_id] = hearing
            if len(self._hearings) > MAX_HEARINGS:
                self._hearings.popitem(last=False)[1].close()
        hearing.hear(pcm)

    async def _encode(self, speech: bytes, speech_id: int) -> Any:
        cached = self._encoded.get(speech_id)
        if cached is not None:
            self._encoded.move_to_end(speech_id)
            return cached
        hearing = self._hearings.pop(speech_id, None)
        tokens: Any = await (
            self._engine.encode_audio(speech) if hearing is None else self._engine.finish_turn(hearing, speech)
        )
        rows = len(tokens)
        if speech_id in self._encoded or rows > ENCODED_ROWS:
            return tokens  # (encoded meanwhile by another answer, or too long to keep)
        self._encoded[speech_id] = tokens
        self._encoded_rows += rows
        while self._encoded_rows > ENCODED_ROWS:
            _, dropped = self._encoded.popitem(last=False)
            self._encoded_rows -= len(dropped)
        return tokens

    def output(self, answer: _Answer, output: TextDelta | AudioChunk) -> None:
        if self._answers.get(answer.call) is not answer:
            return  # cancelled
        if not answer.outputs:
            self._pending.append(answer)
        answer.outputs.append(output)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def finish(self, answer: _Answer, ended: AnswerEnded) -> None:
        if self._answers.get(answer.call) is not answer:
            return
        self._flush_answer(answer)
        del self._answers[answer.call]
        self._send(encode_frame(FrameKind.ANSWER_ENDED, answer.call, ENCODER.encode(ended)))

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, []
        for answer in pending:
            self._flush_answer(answer)

    def _flush_answer(self, answer: _Answer) -> None:
        outputs, answer.outputs = answer.outputs, []
        if outputs:
            body = ENCODER.encode(AnswerOutputs(outputs))
            self._send(encode_frame(FrameKind.ANSWER_OUTPUTS, answer.call, body))


class _Sink:
    """Where the engine delivers one answer (:class:`~omnigate.engines.answering.AnswerSink`), on the core's loop."""

    def __init__(self, link: AnswerLink, answer: _Answer) -> None:
        self._link = link
        self._answer = answer

    def text(self, delta: str) -> None:
        self._link.output(self._answer, TextDelta(delta))

    def audio(self, pcm: bytes, sample_rate: int) -> None:
        self._link.output(self._answer, AudioChunk(pcm, sample_rate))

    def end(self, reason: str, code: str | None, message: str | None) -> None:
        self._link.finish(self._answer, AnswerEnded(reason, code, message))
