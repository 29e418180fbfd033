"""The gateway side of answers on an engine core: an :class:`AnsweringEngine` whose engine runs in the core.

:func:`connect_answer_core` waits for the core to answer (it may still be loading the model), then a reader task hands
the core's ``ANSWER_OUTPUTS`` and ``ANSWER_ENDED`` to the answers' sinks on this loop. A user turn's speech is not
encoded here: :meth:`CoreAnswerClient.encode_audio` keeps the PCM (with an id), and the conversation's ``ANSWER_OPEN``
carries it to the core, which encodes it once and keeps the encoding by that id. A turn in progress goes to the core
as it is heard (``ANSWER_HEAR`` under the id its speech will carry), so the core encodes its whole windows meanwhile.
What the client sends goes out without waiting, bounded by the session's answers (one at a time) and their grants,
and by what the session's turn detection lets a turn hold. When the connection drops, every
answer in flight ends with ``engine_unavailable`` and new ones are refused with it, typed, while the client connects
again to the core the supervisor restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields

from omnigate.engines.answering import AnswerSink, PromptTurn, TurnHearing
from omnigate.engines.base import EngineError, EngineInfo
from omnigate.engines.core.answer_protocol import (
    ENCODER,
    ENGINE_UNAVAILABLE,
    AnswerEnded,
    AnswerGrant,
    AnswerInfo,
    AnswerOpen,
    AnswerOutputs,
    TextDelta,
    TurnIn,
)
from omnigate.engines.core.framing import (
    MAX_FRAME_BYTES,
    Frame,
    FrameError,
    FrameKind,
    decode_body,
    encode_frame,
)
from omnigate.engines.core.link import Connection, first_hello, hello_again, read_frames
from omnigate.engines.qwen3_omni.encoder_stats import EncoderStats

log = logging.getLogger(__name__)

UNAVAILABLE = "the engine core is unavailable; retry shortly"


@dataclass(frozen=True, eq=False)
class Speech:
    """A user turn's speech as the sessions' backend keeps it: the core encodes it (once, by ``id``)."""

    id: int
    pcm: bytes


class _Handle:
    """An answer in flight (:class:`~omnigate.engines.answering.AnswerHandle`)."""

    def __init__(self, client: CoreAnswerClient, call: int) -> None:
        self._client = client
        self._call = call

    def cancel(self) -> None:
        self._client._cancel(self._call)

    def grant(self, chunks: int) -> None:
        self._client._send(FrameKind.ANSWER_GRANT, self._call, ENCODER.encode(AnswerGrant(chunks)))


class _CoreHearing:
    """A user turn heard as it comes (:class:`~omnigate.engines.answering.TurnHearing`), sent on as it is heard."""

    def __init__(self, client: CoreAnswerClient, speech_id: int) -> None:
        self._client = client
        self.speech_id = speech_id
        self._sent = False  # the core holds something of this turn
        self._closed = False

    def hear(self, pcm: bytes) -> None:
        for start in range(0, len(pcm), MAX_FRAME_BYTES):
            self._client._send(FrameKind.ANSWER_HEAR, self.speech_id, pcm[start : start + MAX_FRAME_BYTES])
            self._sent = True

    def close(self) -> None:
        if self._sent and not self._closed:
            self._closed = True
            self._client._send(FrameKind.ANSWER_FORGET, self.speech_id)


class CoreAnswerClient:
    """The answering engine of an engine core, as the gateway's realtime sessions use it."""

    def __init__(self, socket_path: str, connection: Connection, hello: AnswerInfo, *, poll_interval_s: float) -> None:
        self.info: EngineInfo = hello.info
        self._path = socket_path
        self._poll_interval_s = poll_interval_s
        self._ids = itertools.count(1)
        self._speech_ids = itertools.count(1)
        self._sinks: dict[int, AnswerSink] = {}  # answers in flight; at most one per session
        self.encoder_stats = EncoderStats()  # the core's, as of its last ANSWER_STATS (the gateway's /metrics)
        self._writer: asyncio.StreamWriter | None = None
        self._task = asyncio.get_running_loop().create_task(self._run(connection), name="answer-core-client")

    async def encode_audio(self, pcm: bytes) -> Speech:
        """The core encodes a turn's speech: it is carried as it is, with an id of this connection's."""
        return Speech(next(self._speech_ids), pcm)

    def turn_ahead(self) -> TurnHearing:
        """A turn heard as it comes, sent to the core as it is heard (the core encodes its whole windows)."""
        return _CoreHearing(self, next(self._speech_ids))

    async def finish_turn(self, ahead: TurnHearing, pcm: bytes) -> Speech:
        """The turn's speech, whole, under the id the core heard it by: the answer carrying it encodes the rest."""
        assert isinstance(ahead, _CoreHearing)
        return Speech(ahead.speech_id, pcm)

    def answer(
        self,
        turns: Sequence[PromptTurn],
        sink: AnswerSink,
        *,
        instructions: str,
        speaker: str,
        max_tokens: int,
        max_frames: int,
        credit: int | None = None,
    ) -> _Handle:
        """Ask the core for the answer; raises EngineError ``engine_unavailable`` while it is unreachable, and
        ``input_backpressure`` for a conversation whose speech does not fit one frame to the core."""
        if self._writer is None:
            raise EngineError(ENGINE_UNAVAILABLE, UNAVAILABLE)
        request = AnswerOpen(
            turns=[
                TurnIn(role, text) if speech is None else TurnIn(role, text, speech.pcm, speech.id)
                for role, text, speech in turns
            ],
            instructions=instructions,
            speaker=speaker,
            max_tokens=max_tokens,
            max_frames=max_frames,
            credit=credit,
        )
        body = ENCODER.encode(request)
        if len(body) > MAX_FRAME_BYTES:
            raise EngineError(
                "input_backpressure",
                f"the conversation's speech is {len(body)} bytes; the engine core takes at most {MAX_FRAME_BYTES}",
            )
        call = next(self._ids)
        self._sinks[call] = sink
        self._send(FrameKind.ANSWER_OPEN, call, body)
        return _Handle(self, call)

    async def aclose(self) -> None:
        """Close the connection; answers in flight end with ``engine_unavailable``."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._lost("the gateway is closing")

    # ---- internals ----------------------------------------------------------------------------------------------

    def _cancel(self, call: int) -> None:
        if self._sinks.pop(call, None) is not None:
            self._send(FrameKind.ANSWER_CANCEL, call)

    def _send(self, kind: FrameKind, call: int, body: bytes = b"") -> None:
        if self._writer is not None:
            with contextlib.suppress(ConnectionError, OSError):  # the reader sees the loss
                self._writer.write(encode_frame(kind, call, body))

    def _receive(self, frame: Frame) -> None:
        if frame.kind is FrameKind.ANSWER_STATS:
            stats = decode_body(frame.body, EncoderStats)
            for item in fields(EncoderStats):  # in place: the gateway's metrics hold this object
                setattr(self.encoder_stats, item.name, getattr(stats, item.name))
            return
        sink = self._sinks.get(frame.call)
        if frame.kind is FrameKind.ANSWER_OUTPUTS:
            outputs = decode_body(frame.body, AnswerOutputs).outputs
            if sink is None:
                return  # cancelled: the rest of it is dropped
            for output in outputs:
                if isinstance(output, TextDelta):
                    sink.text(output.text)
                else:
                    sink.audio(output.pcm, output.sample_rate)
        elif frame.kind is FrameKind.ANSWER_ENDED:
            ended = decode_body(frame.body, AnswerEnded)
            if self._sinks.pop(frame.call, None) is not None and sink is not None:
                sink.end(ended.reason, ended.code, ended.message)
        else:
            raise FrameError(f"an engine core may not send {frame.kind.name} on an answer connection")

    def _lost(self, reason: str) -> None:
        self._writer = None
        sinks, self._sinks = list(self._sinks.values()), {}
        for sink in sinks:
            sink.end("error", ENGINE_UNAVAILABLE, f"{UNAVAILABLE} ({reason})")

    async def _run(self, connection: Connection) -> None:
        while True:
            self._writer = connection[1]
            reason = await read_frames(connection, self._receive)
            log.error("realtime answers lost their engine core: %s", reason)
            self._lost(reason)
            connection, hello = await hello_again(
                self._path,
                FrameKind.ANSWER_HELLO,
                FrameKind.ANSWER_INFO,
                AnswerInfo,
                poll_interval_s=self._poll_interval_s,
            )
            log.info("realtime answers attached to the engine core again")
            self.info = hello.info


async def connect_answer_core(
    socket_path: str, *, ready_timeout_s: float = 600.0, poll_interval_s: float = 0.5
) -> CoreAnswerClient:
    """The answering engine of the core at ``socket_path``, once it answers (within ``ready_timeout_s``: it may
    still be loading the model). Raises ``TimeoutError``."""
    connection, hello = await first_hello(
        socket_path,
        FrameKind.ANSWER_HELLO,
        FrameKind.ANSWER_INFO,
        AnswerInfo,
        ready_timeout_s=ready_timeout_s,
        poll_interval_s=poll_interval_s,
    )
    return CoreAnswerClient(socket_path, connection, hello, poll_interval_s=poll_interval_s)
