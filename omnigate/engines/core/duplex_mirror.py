"""The gateway's mirror of its duplex sessions on an engine core: the :class:`DuplexEngineApi` answers, kept locally.

Admission is the core's: several gateway processes may share its slots, so :meth:`DuplexMirror.admit` sends the
open and waits for the core's answer (DUPLEX_OPENED, or DUPLEX_ENDED with the refusal) before the session is
announced. Every other call comes on the gateway's event loop and must answer at once, so the mirror keeps what the
engine would know of its sessions: each session's unconsumed input, from the bytes sent and the bytes the core says
it finished with (consumed by a tick or dropped by a clear). The core handles a session's messages in order, so the
input the mirror counts is never below what the core holds when the next audio arrives: the core never refuses
input the mirror accepted.
Grants, clears and closes are messages the mirror sends without waiting. Sans I/O: bytes go out through ``send``,
frames from the core come in through :meth:`DuplexMirror.receive`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields

from omnigate.engines.core.duplex_protocol import (
    ENCODER,
    DuplexEnded,
    DuplexGrant,
    DuplexInfo,
    DuplexOpen,
    DuplexTick,
)
from omnigate.engines.core.framing import MAX_FRAME_BYTES, Frame, FrameError, FrameKind, decode_body, encode_frame
from omnigate.engines.duplex.session import (
    DuplexClosed,
    DuplexFull,
    DuplexSession,
    DuplexUnavailable,
    FrameSink,
    SessionEnd,
)
from omnigate.engines.duplex.stats import ClockStats

log = logging.getLogger(__name__)

LOST_CODE = "engine_unavailable"
AUDIO_CHUNK_BYTES = min(MAX_FRAME_BYTES, 1024 * 1024)  # larger appends cross as several frames


@dataclass(eq=False)
class MirroredSession(DuplexSession):
    """A session as the gateway sees it; ``slot`` is unknown here (the core's) and stays -1."""

    input_sent: int = 0  # input bytes accepted and sent to the core
    input_done: int = 0  # of those, the bytes known consumed or dropped
    admitting: bool = True  # until its opener resumed: frames before that are dropped, their credit returned


class DuplexMirror:
    """Implements :class:`omnigate.gateway.realtime.duplex_backend.DuplexEngineApi` for sessions on an engine core."""

    def __init__(self, hello: DuplexInfo, send: Callable[[bytes], None]) -> None:
        self.info = hello.info
        self.sample_rate = hello.sample_rate
        self.frame_s = hello.frame_s
        self.retry_after_s = hello.retry_after_s
        self.stats = ClockStats()
        self._copy_stats(hello.stats)
        self._send = send
        self._sessions: dict[int, MirroredSession] = {}  # bounded by info.max_sessions
        self._answers: dict[int, asyncio.Future[None]] = {}  # the core's answer to each open not yet answered
        self._ids = itertools.count(1)
        self.connected = True
        self._lost_reason = ""
        self._closing = False

    @property
    def active_sessions(self) -> int:
        return len(self._sessions)

    # ---- DuplexEngineApi ----------------------------------------------------------------------------------------

    async def admit(
        self,
        sink: FrameSink,
        *,
        max_input_bytes: int,
        initial_credit_frames: int,
        seed: int | None = None,
        on_end: SessionEnd | None = None,
    ) -> DuplexSession:
        """Open a session on the core once the core says it holds a slot for it. Raises DuplexFull (the core's
        slots are taken, whichever gateway took them), DuplexClosed, or DuplexUnavailable while the core is
        unreachable."""
        if self._closing:
            raise DuplexClosed()
        if not self.connected:
            raise DuplexUnavailable(f"the duplex engine is not reachable: {self._lost_reason}", self.retry_after_s)
        if len(self._sessions) >= self.info.max_sessions:  # this gateway alone holds every slot
            raise DuplexFull(self.info.max_sessions, self.retry_after_s)
        loop = asyncio.get_running_loop()
        session = MirroredSession(
            id=next(self._ids),
            slot=-1,
            seed=-1 if seed is None else seed,
            sink=sink,
            loop=loop,
            max_input_bytes=max_input_bytes,
            credit_frames=initial_credit_frames,
            on_end=on_end,
        )
        answer: asyncio.Future[None] = loop.create_future()
        self._answers[session.id] = answer
        self._sessions[session.id] = session
        request = DuplexOpen(max_input_bytes, initial_credit_frames, seed)
        self._send(encode_frame(FrameKind.DUPLEX_OPEN, session.id, ENCODER.encode(request)))
        self.stats.sessions = len(self._sessions)
        try:
            await answer
        except BaseException:  # refused (forgotten already), or the opener was cancelled: the core frees the slot
            self._answers.pop(session.id, None)
            self.close_session(session)
            raise
        session.admitting = False
        return session

    def push_audio(self, session: DuplexSession, pcm: bytes) -> bool:
        """Send user audio; False, and nothing sent, when it would pass the session's input cap."""
        mirrored = self._mirrored(session)
        if mirrored is None:
            return True
        if self.pending_input_bytes(mirrored) + len(pcm) > mirrored.max_input_bytes:
            return False
        mirrored.input_sent += len(pcm)
        for start in range(0, len(pcm), AUDIO_CHUNK_BYTES):
            self._send(encode_frame(FrameKind.DUPLEX_AUDIO, session.id, pcm[start : start + AUDIO_CHUNK_BYTES]))
        return True

    def pending_input_bytes(self, session: DuplexSession) -> int:
        mirrored = self._mirrored(session)
        return 0 if mirrored is None else mirrored.input_sent - mirrored.input_done

    def clear_input(self, session: DuplexSession) -> int:
        """Drop the input not yet consumed; returns the bytes dropped (as far as the gateway knows)."""
        mirrored = self._mirrored(session)
        if mirrored is None:
            return 0
        dropped = mirrored.input_sent - mirrored.input_done
        mirrored.input_done = mirrored.input_sent
        self._send(encode_frame(FrameKind.DUPLEX_CLEAR, session.id))
        return dropped

    def grant(self, session: DuplexSession, frames: int) -> None:
        if self._mirrored(session) is not None and frames > 0:
            self._send(encode_frame(FrameKind.DUPLEX_GRANT, session.id, ENCODER.encode(DuplexGrant(frames))))

    def close_session(self, session: DuplexSession) -> None:
        """End the session now; the core frees its slot before it handles anything sent later. Idempotent."""
        if self._mirrored(session) is None:
            return
        self._forget(session)
        if self.connected:
            self._send(encode_frame(FrameKind.DUPLEX_CLOSE, session.id))

    def shutdown(self) -> None:
        """Admit nothing more and close every session."""
        self._closing = True
        self._refuse_waiting(DuplexClosed())
        for session in list(self._sessions.values()):
            self.close_session(session)

    # ---- from the core ------------------------------------------------------------------------------------------

    def receive(self, frame: Frame) -> None:
        """One frame from the core. Raises :class:`FrameError` for one the core may not send."""
        if frame.kind is FrameKind.DUPLEX_TICK:
            self._deliver(decode_body(frame.body, DuplexTick))
        elif frame.kind is FrameKind.DUPLEX_STATS:
            self._copy_stats(decode_body(frame.body, ClockStats))
        elif frame.kind is FrameKind.DUPLEX_OPENED:
            answer = self._answers.pop(frame.call, None)
            if answer is not None and not answer.done():
                answer.set_result(None)
        elif frame.kind is FrameKind.DUPLEX_ENDED:
            ended = decode_body(frame.body, DuplexEnded)
            session = self._sessions.get(frame.call)
            answer = self._answers.pop(frame.call, None)
            if answer is not None:
                if session is not None:
                    self._forget(session)
                if not answer.done():
                    answer.set_exception(self._refusal(ended))
            elif session is not None:
                self._end(session, ended.code, ended.message)
        else:
            raise FrameError(f"the engine core may not send {frame.kind.name} on a duplex connection")

    def lost(self, reason: str) -> None:
        """The connection to the core is gone: every session ends with ``engine_unavailable``, new ones are refused
        until :meth:`attached`."""
        self.connected = False
        self._lost_reason = reason
        self._refuse_waiting(DuplexUnavailable(f"the duplex engine stopped: {reason}", self.retry_after_s))
        for session in list(self._sessions.values()):
            self._end(session, LOST_CODE, f"the duplex engine stopped: {reason}")

    def attached(self, hello: DuplexInfo) -> None:
        """Connected again (to a restarted core): sessions are admitted again."""
        self.connected = True
        self._copy_stats(hello.stats)

    # ---- internals ----------------------------------------------------------------------------------------------

    def _mirrored(self, session: DuplexSession) -> MirroredSession | None:
        mirrored = self._sessions.get(session.id)
        return mirrored if mirrored is session and not mirrored.closed else None

    def _forget(self, session: DuplexSession) -> None:
        session.closed = True
        self._sessions.pop(session.id, None)
        self.stats.sessions = len(self._sessions)

    def _refuse_waiting(self, error: Exception) -> None:
        """Sessions whose open the core has not answered: their openers raise ``error`` (no end handler runs)."""
        answers, self._answers = self._answers, {}
        for call, answer in answers.items():
            session = self._sessions.get(call)
            if session is not None:
                self._forget(session)
            if not answer.done():
                answer.set_exception(error)

    def _refusal(self, ended: DuplexEnded) -> Exception:
        retry_after_s = ended.retry_after_s if ended.retry_after_s is not None else self.retry_after_s
        if ended.code == "resource_exhausted":
            return DuplexFull(self.info.max_sessions, retry_after_s)
        if ended.code == "shutting_down":
            return DuplexClosed()
        return DuplexUnavailable(ended.message, retry_after_s)

    def _end(self, session: MirroredSession, code: str, message: str) -> None:
        self._forget(session)
        if session.on_end is not None:
            try:
                session.on_end(code, message)
            except Exception:
                log.exception("a duplex session's end handler raised")

    def _deliver(self, tick: DuplexTick) -> None:
        for item in tick.frames:
            session = self._sessions.get(item.session)
            if session is None:
                continue  # closed here after the core made the frame
            session.input_done = max(session.input_done, item.input_done)
            if session.admitting:  # made before the session was announced: nobody hears it, its credit returns
                self.grant(session, 1)
                continue
            session.ticks += 1
            try:
                session.sink(item.frame)
            except Exception:  # one session's failure is its own: the others still get their frames
                log.exception("a duplex session's frame sink raised")

    def _copy_stats(self, stats: ClockStats) -> None:
        # In place: the gateway's metrics hold this object. The session count stays this gateway's own (the core's
        # counts every gateway's sessions; the rest of the counters are the engine's).
        sessions = self.stats.sessions
        for item in fields(ClockStats):
            setattr(self.stats, item.name, getattr(stats, item.name))
        self.stats.sessions = sessions
