"""The embedded speech recognizer of ``/v1/realtime``: pocketsphinx decoders in recognizer processes, each turn decoded
as its audio comes.

pocketsphinx holds the GIL while it decodes, so the decoders run in worker processes
(:mod:`omnigate.engines.recognizer_worker`), by default one per core, each holding its share of ``max_decoders``.
A session hears its turn through a :class:`TurnListener`: the turn is pinned to the process with the fewest turns
for its life, and its audio is sent to it as it arrives, one message of the turn in flight at a time (what comes
meanwhile waits in the listener, at most ``max_audio_s`` of it), so the transcript is ready soon after the turn ends.

The processes start with the server and load their first decoder in the background (about 0.7 s and 95 MB each, the
next ones when turns need them). A turn that comes before its process has loaded is not refused: its audio waits in
the pipe and is decoded once the decoder is there. The processes take SIGKILL if the gateway dies (Linux), and end
with :meth:`EmbeddedRecognizer.aclose`.

Limits, each a typed failure of the turn: at most ``max_decoders`` turns are heard at once (the next is refused
``asr_busy``); a turn longer than ``max_audio_s`` fails ``asr_audio_limit``; a decoder that raises fails its turn
``asr_error`` and is dropped; a process that dies fails its turns ``asr_error`` at once and is started again (after a
backoff; one that keeps dying right after its start is given up, and its turns go to the others); a turn whose
transcript is not ready ``timeout_s`` after it ended fails ``asr_timeout``, and keeps its place until its process
answers or dies, so a hung decoder lowers capacity instead of adding work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time

from omnigate.engines.openai_compat.errors import ServiceError
from omnigate.engines.recognizer_wire import (
    HEADER,
    MAX_PIECE_BYTES,
    Drop,
    Failed,
    Fed,
    Hear,
    Heard,
    Loaded,
    ToWorker,
    body_length,
    frame,
    from_worker,
)
from omnigate.engines.recognizer_worker import INPUT_RATE, POCKETSPHINX
from omnigate.gateway.cli.restart_policy import GiveUp, RestartPolicy, RestartTracker
from omnigate.gateway.cli.supervisor import _die_with_parent

log = logging.getLogger("omnigate.engines.recognizer")

STOP_TIMEOUT_S = 5.0  # a process that has not ended this long after its stdin closed is killed


class RecognizerProcess:
    """One worker process and the turns pinned to it; started again when it dies. Used on the event loop only."""

    def __init__(self, recognizer: EmbeddedRecognizer, index: int) -> None:
        self.recognizer = recognizer
        self.index = index
        self.capacity = 0  # turns it hears at once (set by the recognizer)
        self.turns: dict[int, TurnListener] = {}  # the turns holding a place here
        self.loaded = asyncio.Event()
        self.given_up = False
        self._process: asyncio.subprocess.Process | None = None
        self._backlog: list[bytes] = []  # frames for a process being (re)started: at most one per turn
        self._restarts = RestartTracker(RestartPolicy())
        self._closing = False
        self._task: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        """The running process's id (None while it is being started)."""
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"omnigate-asr-{self.index}")

    def send(self, message: ToWorker) -> None:
        data = frame(message)
        if self._process is None or self._process.stdin is None:
            self._backlog.append(data)
        else:
            self._process.stdin.write(data)  # buffered: each turn has one message in flight, so this is bounded

    async def aclose(self) -> None:
        self._closing = True
        process = self._process
        if process is not None and process.stdin is not None:
            process.stdin.close()  # the worker ends at the end of its stdin
            try:
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await process.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._fail_turns(ServiceError("asr", "unavailable", "the speech recognizer has stopped"))

    async def _run(self) -> None:
        """Run the process, and start it again each time it dies, until closed or given up."""
        while not self._closing:
            self._restarts.started(time.monotonic())
            try:
                status = await self._run_once()
            except OSError as error:  # it could not be started (out of memory or processes): as if it died
                log.error("speech recognizer process %d could not start: %s", self.index, error)
                status = -1
            if self._closing:
                return
            self._fail_turns(ServiceError("asr", "error", f"the speech recognizer process ended (status {status})"))
            decision = self._restarts.exited(time.monotonic())
            if isinstance(decision, GiveUp):
                log.error("speech recognizer process %d keeps dying (status %d): given up", self.index, status)
                self.given_up = True
                return
            log.warning("speech recognizer process %d ended (status %d); starting it again", self.index, status)
            await asyncio.sleep(decision.after_s)

    async def _run_once(self) -> int:
        """Start the process, send it what waited, hand its answers to their turns until it ends; its status."""
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "omnigate.engines.recognizer_worker",
            "--decoder",
            self.recognizer.decoder,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,  # a terminal's Ctrl-C reaches the gateway, which stops its processes
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        assert process.stdin is not None and process.stdout is not None
        self._process = process
        for data in self._backlog:
            process.stdin.write(data)
        self._backlog.clear()
        try:
            await self._read(process.stdout)
        finally:
            self._process = None
            self.loaded.clear()
        return await process.wait()

    async def _read(self, stdout: asyncio.StreamReader) -> None:
        """Hand the process's answers to their turns until it closes its stdout (or says something that is not one:
        then it is killed)."""
        try:
            while True:
                header = await stdout.readexactly(HEADER.size)
                answer = from_worker.decode(await stdout.readexactly(body_length(header)))
                if isinstance(answer, Loaded):
                    self.loaded.set()
                    continue
                listener = self.turns.get(answer.turn)
                if listener is not None:
                    listener.answered(answer)
        except asyncio.IncompleteReadError:
            return
        except Exception as error:
            log.error("speech recognizer process %d said something else: %s", self.index, error)
            if self._process is not None:
                with contextlib.suppress(ProcessLookupError):
                    self._process.kill()

    def _fail_turns(self, error: ServiceError) -> None:
        self._backlog.clear()  # (every frame in it belongs to one of these turns)
        for listener in list(self.turns.values()):
            listener.lost(error)


class EmbeddedRecognizer:
    """The recognizer processes of a gateway process and the places they hear turns in."""

    def __init__(
        self,
        *,
        max_decoders: int = 8,
        max_audio_s: float = 60.0,
        timeout_s: float = 15.0,
        processes: int | None = None,
        decoder: str = POCKETSPHINX,
    ) -> None:
        """``processes``: the worker processes (default: one per core, at most ``max_decoders``); ``decoder``: the
        decoder class the workers load, ``module:name``."""
        if max_decoders < 1 or max_audio_s <= 0 or timeout_s <= 0 or (processes is not None and processes < 1):
            raise ValueError("the recognizer's decoders, processes, audio and timeout must be positive")
        self.max_decoders = max_decoders
        self.max_audio_s = max_audio_s
        self.timeout_s = timeout_s
        self.decoder = decoder
        count = min(max_decoders, processes or os.cpu_count() or 1)
        self.processes = [RecognizerProcess(self, index) for index in range(count)]
        for index, process in enumerate(self.processes):
            # max_decoders shared out: the first processes take one more where it does not divide evenly
            process.capacity = max_decoders // count + (index < max_decoders % count)
        self._next_turn = 0
        self._started = False

    @property
    def listening(self) -> int:
        """Turns holding a place."""
        return sum(len(process.turns) for process in self.processes)

    def start(self) -> None:
        """Start the processes (each loads its first decoder in the background)."""
        if not self._started:
            self._started = True
            for process in self.processes:
                process.start()

    async def loaded(self) -> None:
        """Until every process has loaded its first decoder."""
        await asyncio.gather(*(process.loaded.wait() for process in self.processes))

    def pids(self) -> list[int]:
        """The ids of the processes running now."""
        return [process.pid for process in self.processes if process.pid is not None]

    def listen(self) -> TurnListener:
        """A listener for a new turn (on the event loop). Raises ServiceError ``asr_busy`` when all are taken."""
        usable = [process for process in self.processes if not process.given_up]
        if not self._started or not usable:
            raise ServiceError("asr", "unavailable", "the speech recognizer is not running")
        free = [process for process in usable if len(process.turns) < process.capacity]
        if not free:
            raise ServiceError("asr", "busy", f"all {self.max_decoders} speech decoders are hearing other turns")
        process = min(free, key=lambda p: len(p.turns))
        self._next_turn += 1
        return TurnListener(self, process, self._next_turn)

    async def aclose(self) -> None:
        """End the processes (their turns fail ``asr_unavailable``)."""
        await asyncio.gather(*(process.aclose() for process in self.processes))


class TurnListener:
    """One turn's decoding: :meth:`hear` its audio (24 kHz mono s16le) as it comes, then await :meth:`transcript`
    with the rest; or :meth:`cancel`. Used on the event loop only."""

    def __init__(self, recognizer: EmbeddedRecognizer, process: RecognizerProcess, turn: int) -> None:
        self._recognizer = recognizer
        self._process = process
        self._turn = turn
        self._max_bytes = int(recognizer.max_audio_s * INPUT_RATE) * 2
        self._bytes = 0
        self._pending = bytearray()  # heard, not yet sent
        self._in_flight = False  # a Hear the process has not answered
        self._sent = False  # the process has (or had) this turn open
        self._ending = False
        self._abandoned = False  # cancelled, failed or timed out: the place goes back once nothing is in flight
        self._done = asyncio.Event()
        self._text = ""
        self._error: ServiceError | None = None
        process.turns[turn] = self

    def hear(self, pcm: bytes) -> None:
        """More of the turn's audio."""
        if self._ending or self._abandoned:
            return
        self._bytes += len(pcm)
        if self._bytes > self._max_bytes:
            self._fail(
                ServiceError("asr", "audio_limit", f"a turn longer than {self._recognizer.max_audio_s:g} s of speech")
            )
            return
        self._pending += pcm
        if not self._in_flight:
            self._send_next()

    async def transcript(self, pcm: bytes = b"") -> str:
        """The rest of the turn's audio, then its words. Raises ServiceError; cancels the listener when the caller
        is cancelled."""
        self.hear(pcm)
        if not self._abandoned:
            self._ending = True
            if not self._in_flight:
                self._send_next()
        try:
            async with asyncio.timeout(self._recognizer.timeout_s):
                await self._done.wait()
        except TimeoutError:
            self._fail(
                ServiceError("asr", "timeout", f"no transcript {self._recognizer.timeout_s:g} s after the turn ended")
            )
        finally:
            self.cancel()  # (a listener whose turn ended gave its place back already)
        if self._error is not None:
            raise self._error
        return self._text

    def cancel(self) -> None:
        """Nothing more of this turn is wanted; its place goes back once its process answered what is in flight."""
        self._abandoned = True
        self._pending.clear()
        if not self._in_flight:
            self._give_back()

    # ---- the process's side -------------------------------------------------------------------------------------

    def answered(self, answer: Fed | Heard | Failed) -> None:
        """The process's answer to this turn's message in flight."""
        self._in_flight = False
        if isinstance(answer, Failed):
            self._sent = False  # the worker dropped the turn with its decoder
            self._fail(ServiceError("asr", "error", f"the speech recognizer failed: {answer.message}"))
        elif isinstance(answer, Heard):
            self._sent = False
            if not self._done.is_set():
                self._text = answer.text
                self._abandoned = True
                self._done.set()
            self._give_back()
        elif self._abandoned:
            self._give_back()
        else:
            self._send_next()

    def lost(self, error: ServiceError) -> None:
        """The process is gone, and this turn with it."""
        self._in_flight = False
        self._sent = False
        self._fail(error)
        self._give_back()

    def _send_next(self) -> None:
        if not self._pending and not self._ending:
            return
        pcm = bytes(self._pending[:MAX_PIECE_BYTES])
        del self._pending[:MAX_PIECE_BYTES]
        self._process.send(Hear(self._turn, pcm, end=self._ending and not self._pending))
        self._in_flight = True
        self._sent = True

    def _fail(self, error: ServiceError) -> None:
        if self._done.is_set():
            return
        self._error = error
        self._abandoned = True
        self._pending.clear()
        self._done.set()
        if not self._in_flight:
            self._give_back()

    def _give_back(self) -> None:
        if self._process.turns.pop(self._turn, None) is None:
            return
        if self._sent:  # the process holds the turn open: its decoder goes back to the process's idle ones
            self._process.send(Drop(self._turn))
            self._sent = False
