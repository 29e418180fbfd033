"""``realtime``: voice sessions on ``WS /v1/realtime`` (OpenAI Realtime protocol), as a voice agent's client runs them.

Each session opens one connection and keeps a microphone open: audio is appended in real time (``append_ms``
pieces on a wall-clock schedule), silence between turns and, per utterance, a recorded user turn (a short WAV made
with the piper voice ``joe-us``: "Could you book a table for two at eight tonight?"). Then:

- against a text-to-speech engine the client waits for the server's ``speech_stopped`` (server VAD ends the turn),
  creates an assistant item with the utterance's text and asks for a response, as an agent with its own LLM does;
- against a natively duplex engine the model answers on its own: the turn's reply is the model audio that follows
  the end of the user's speech, until the response ends or ``reply_ms`` of it has arrived;
- against an engine that answers the conversation itself (the session's capabilities say ``answers_turns``:
  ``serve --engine qwen3-omni``) the client only speaks and listens: the server's VAD ends the turn and the model
  answers it, or with ``commit=1`` the client ends each turn itself, ``input_audio_buffer.commit`` and
  ``response.create`` right after the speech's last append (turn detection off), so the utterance's TTFA is from the
  end of the user's turn to the answer's first audio (``max_output_tokens=N`` caps each answer, as the session's
  setting; also in talk mode); the turns' timings are collected as in talk mode;
- in talk mode (``talk=1``, a server started with ``--llm-url``) the server answers on its own too: it transcribes
  the turn, asks its LLM and speaks the reply; the client only speaks and listens, at the server's default turn
  detection. The per-turn timings the server reports in ``response.done``'s metadata (``omnigate_*_ms``) are
  collected in :attr:`RealtimeTarget.turn_timings`, and each completed turn's split goes in the level's report
  (``turn_steps_ms``, printed as "turns step by step"):

  - ``voice_to_voice``: from the last append of the user's speech to the first reply audio received;
  - ``end_of_turn``: from that append to ``input_audio_buffer.speech_stopped`` received (the VAD's closing silence);
  - ``transcription``: from ``speech_stopped`` to ``conversation.item.input_audio_transcription.completed``
    received (the transcription delay after the end of the turn);
  - ``first_token`` and ``first_audio``: the LLM's first token and the first reply audio sent, from the server's
    end of the turn, as the server reports them (no event carries the first token: an audio reply's text comes
    with its audio);
  - ``turn_to_audio``: from ``speech_stopped`` to the first reply audio received.

An utterance's TTFA is the voice-to-voice latency: from the last append of the user's speech to the first audio of
the reply. Underruns come from replaying the reply's arrivals through the jitter-buffer player. With
``barge_in_ms`` set, the client sends ``response.cancel`` once that much reply audio has arrived and records the
barge-in reaction time: from sending the cancel to the last audio delta of that response received
(:attr:`RealtimeTarget.barge_in_ms`).

Client options go in the URL fragment, which never reaches the server:
``ws://host:8000/v1/realtime?duplex=1#append_ms=20&barge_in_ms=600&reply_ms=3000``, ``...#talk=1``,
``...#commit=1``.
"""

from __future__ import annotations

import asyncio
import base64
import time
import wave
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import msgspec
import numpy as np
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from omnigate.loadtest.report import TargetSpec, TtfaSlo
from omnigate.loadtest.targets.base import SessionSettings, Target, ws_url
from omnigate.loadtest.targets.ws_connect import CLOSE_WAIT_S, connect_traced
from omnigate.loadtest.traces import SessionTrace, UtteranceTrace

REALTIME_PATH = "/v1/realtime"
RATE = 24_000
SPEECH_FILE = Path(__file__).with_name("realtime_user_turn.wav")
_SPEECH_STOP_WAIT_S = 5.0
TALK_SLO = TtfaSlo(
    limit_ms=1500.0,
    basis="the realtime target's talk mode: voice to voice, from the end of the user's speech to the reply's audio",
)
"""Talk mode's default SLO. A voice-to-voice turn holds the server VAD's end-of-turn silence (500 ms, ~530 ms with
its windows), the transcription, the LLM up to the reply's first words and the voice's first audio: about 1.0 s on a
quiet machine with the stand-ins (150 ms transcription, 200 ms first token; docs/benchmarks/realtime_responder.md:
p95 1.02-1.03 s for one conversation, 1.08-1.44 s for 20 with a fast voice). 1.5 s leaves half a second for the
voice and load, about the longest pause a conversation bears, so a voice or server that has fallen behind (piper at
8+ conversations on 2 busy cores: p95 2.9 s) fails while a healthy one passes. The 100 ms default measures a speech
stream's first audio, which a turn that waits for 500 ms of silence can never meet."""


class RealtimeOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Client behaviour, from the URL fragment."""

    append_ms: int = 40
    barge_in_ms: float | None = None
    reply_ms: float = 3000.0
    speech: str | None = None  # a mono 16-bit WAV to speak instead of the built-in recording
    talk: bool = False  # the server answers the user itself (its LLM); the client only speaks and listens
    commit: bool = False  # against an engine that answers turns: the client commits each turn, no server VAD
    max_output_tokens: int | None = None  # against a server that answers: the session's cap on each answer

    def __post_init__(self) -> None:
        if not 20 <= self.append_ms <= 100:
            raise ValueError("append_ms must be within 20..100")
        if self.reply_ms <= 0 or (self.barge_in_ms is not None and self.barge_in_ms <= 0):
            raise ValueError("reply_ms and barge_in_ms must be positive")
        if self.max_output_tokens is not None and self.max_output_tokens <= 0:
            raise ValueError("max_output_tokens must be positive")


class RealtimeEvent(msgspec.Struct):
    """The fields of server events the client reads."""

    type: str
    response_id: str | None = None
    delta: str | None = None
    response: dict[str, Any] | None = None
    session: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


EVENT_DECODER = msgspec.json.Decoder(RealtimeEvent)


def load_speech(path: Path, rate: int = RATE) -> bytes:
    """A mono 16-bit WAV as s16le PCM at ``rate`` (linear interpolation is enough for a VAD and a speech model)."""
    with wave.open(str(path), "rb") as source:
        if source.getnchannels() != 1 or source.getsampwidth() != 2:
            raise ValueError(f"{path}: speech must be mono 16-bit PCM")
        source_rate = source.getframerate()
        samples = np.frombuffer(source.readframes(source.getnframes()), dtype="<i2").astype(np.float64)
    if source_rate != rate and samples.size:
        count = int(samples.size * rate / source_rate)
        samples = np.interp(np.linspace(0, samples.size - 1, count), np.arange(samples.size), samples)
    return samples.astype("<i2").tobytes()


def split_options(url: str) -> tuple[str, RealtimeOptions]:
    """The URL without its fragment, and the client options the fragment holds."""
    parts = urlsplit(url)
    raw = dict(parse_qsl(parts.fragment))
    try:
        options = msgspec.convert(raw, RealtimeOptions, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"realtime target options ({parts.fragment!r}): {exc}") from None
    return urlunsplit((parts.scheme, parts.netloc, parts.path, parts.query, "")), options


@dataclass(eq=False)
class _Turn:
    """What the reader needs to know about the reply in flight."""

    utterance: UtteranceTrace
    speech_end_s: float
    duplex: bool
    response_id: str | None = None
    reply_ms: float = 0.0
    cancel_sent_s: float | None = None
    speech_stopped_s: float | None = None  # when the server's VAD said the user's turn ended
    transcribed_s: float | None = None  # when the turn's transcript arrived
    cancelled: bool = False
    done_s: float | None = None
    last_delta_s: float | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False)
class _Session:
    duplex: bool = False
    answers: bool = False  # the engine answers the user's turns itself
    created: asyncio.Event = field(default_factory=asyncio.Event)
    speech_stopped: asyncio.Event = field(default_factory=asyncio.Event)
    turn: _Turn | None = None
    closing: bool = False


class RealtimeTarget(Target):
    kind = "realtime"

    def __init__(self, spec: TargetSpec, settings: SessionSettings) -> None:
        super().__init__(spec, settings)
        base, self.options = split_options(spec.url)
        url = ws_url(base, REALTIME_PATH)
        if spec.model is not None:
            parts = urlsplit(url)
            query = urlencode([*parse_qsl(parts.query), ("model", spec.model)])
            url = urlunsplit((parts.scheme, parts.netloc, parts.path, query, ""))
        self.url = url
        self.speech = load_speech(Path(self.options.speech) if self.options.speech else SPEECH_FILE)
        self.barge_in_ms: list[float] = []
        """Barge-in reaction times of every session so far: response.cancel sent to last audio delta, ms."""
        self.cancel_to_done_ms: list[float] = []
        """From response.cancel sent to that response's response.done received, ms."""
        self.turn_timings: list[dict[str, float]] = []
        """Talk mode, per completed response: its ``omnigate_<step>_ms`` metadata as ``{step: ms}``, and the client's
        own ``client_voice_to_voice`` (end of speech sent to first reply audio) and ``client_turn_to_audio``
        (``speech_stopped`` received to first reply audio)."""

    @classmethod
    def default_slo(cls, spec: TargetSpec) -> TtfaSlo | None:
        """Talk mode's TTFA is a whole voice-to-voice turn: it is judged by :data:`TALK_SLO`."""
        _, options = split_options(spec.url)
        return TALK_SLO if options.talk else None

    async def run_session(self, texts: Sequence[str], trace: SessionTrace) -> None:
        connection = await connect_traced(
            self.url,
            self.settings.connect_timeout_s,
            trace,
            self.auth_headers(),
            compression=self.settings.compression,
        )
        if connection is None:
            return
        async with connection:
            await self._converse(connection, texts, trace)

    async def _converse(self, connection: ClientConnection, texts: Sequence[str], trace: SessionTrace) -> None:
        state = _Session()
        sending = asyncio.Lock()
        reader = asyncio.create_task(self._read(connection, trace, state, sending))
        microphone: asyncio.Task[None] | None = None
        try:
            if not await self._wait(state.created, reader, self.settings.connect_timeout_s):
                trace.error("no_session_created")
                return
            listens = self.options.talk or state.answers  # the server answers: the client speaks and listens
            commits = state.answers and self.options.commit
            if listens:
                session: dict[str, Any] = {}
                if commits:
                    session["audio"] = {"input": {"turn_detection": None}}
                if self.options.max_output_tokens is not None:
                    session["max_output_tokens"] = self.options.max_output_tokens
                if session:
                    await self._send(connection, sending, {"type": "session.update", "session": session})
            elif not state.duplex and not listens:
                # The agent composes the replies: the server's VAD only ends the user's turns.
                turn_detection = {"type": "server_vad", "create_response": False, "interrupt_response": True}
                update = {"type": "session.update", "session": {"audio": {"input": {"turn_detection": turn_detection}}}}
                await self._send(connection, sending, update)
            mic = _Microphone(self.options.append_ms)
            microphone = asyncio.create_task(mic.run(lambda event: self._send(connection, sending, event)))
            for text in texts:
                if not trace.may_begin_utterance(time.perf_counter()):
                    break
                utterance = trace.begin_utterance(time.perf_counter(), text)
                utterance.unit_started(text, RATE)
                state.speech_stopped.clear()
                if commits:  # the turn is the speech alone, not the silence appended since the last one
                    await self._send(connection, sending, {"type": "input_audio_buffer.clear"})
                speech_end_s = await mic.say(self.speech)
                if commits:
                    await self._send(connection, sending, {"type": "input_audio_buffer.commit"})
                    await self._send(connection, sending, {"type": "response.create"})
                utterance.text_sent(speech_end_s, len(text))
                turn = _Turn(utterance, speech_end_s, state.duplex)
                state.turn = turn
                vad_ends_turn = not (state.duplex or commits)
                if vad_ends_turn and not await self._wait(state.speech_stopped, reader, _SPEECH_STOP_WAIT_S):
                    trace.error("no_speech_stopped")
                if not state.duplex and not listens:
                    item = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
                    await self._send(connection, sending, {"type": "conversation.item.create", "item": item})
                    await self._send(connection, sending, {"type": "response.create"})
                if not await self._wait(turn.done, reader, self.settings.utterance_timeout_s):
                    if not reader.done():
                        trace.error("utterance_timeout")
                    return
                if turn.cancel_sent_s is not None and turn.cancelled and turn.done_s is not None:
                    last = turn.last_delta_s if turn.last_delta_s is not None else turn.cancel_sent_s
                    self.barge_in_ms.append(max(0.0, last - turn.cancel_sent_s) * 1000.0)
                    self.cancel_to_done_ms.append((turn.done_s - turn.cancel_sent_s) * 1000.0)
            state.closing = True
        except ConnectionClosed:
            await asyncio.wait({reader}, timeout=CLOSE_WAIT_S)
        finally:
            if microphone is not None:
                microphone.cancel()
            reader.cancel()
            await asyncio.gather(*(t for t in (reader, microphone) if t is not None), return_exceptions=True)

    @staticmethod
    def _turn_timings(turn: _Turn, metadata: object) -> dict[str, float]:
        timings = reported_timings(metadata)
        voice_to_voice = turn.utterance.ttfa_ms()
        if voice_to_voice is not None:
            timings["client_voice_to_voice"] = voice_to_voice
        if turn.speech_stopped_s is not None and turn.utterance.arrivals:
            timings["client_turn_to_audio"] = (turn.utterance.arrivals[0][0] - turn.speech_stopped_s) * 1000.0
        return timings

    async def _wait(self, event: asyncio.Event, reader: asyncio.Task[None], timeout_s: float) -> bool:
        waiter = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait({waiter, reader}, timeout=timeout_s, return_when="FIRST_COMPLETED")
        finally:
            waiter.cancel()
        return event.is_set()

    @staticmethod
    async def _send(connection: ClientConnection, lock: asyncio.Lock, event: dict[str, Any]) -> None:
        async with lock:
            await connection.send(msgspec.json.encode(event).decode())

    async def _read(
        self, connection: ClientConnection, trace: SessionTrace, state: _Session, sending: asyncio.Lock
    ) -> None:
        try:
            async for message in connection:
                now_s = time.perf_counter()
                try:
                    event = EVENT_DECODER.decode(message)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    trace.error("protocol_unknown_event", f"{exc}: {str(message)[:200]}")
                    continue
                await self._on_event(event, now_s, trace, state, connection, sending)
        except ConnectionClosed:
            pass
        if not state.closing and connection.close_code not in (None, 1000):
            trace.error(f"ws_close_{connection.close_code}", connection.close_reason)
        elif not state.closing:
            trace.error("closed_by_server")

    async def _on_event(
        self,
        event: RealtimeEvent,
        now_s: float,
        trace: SessionTrace,
        state: _Session,
        connection: ClientConnection,
        sending: asyncio.Lock,
    ) -> None:
        kind = event.type
        turn = state.turn
        if kind == "session.created":
            session = event.session or {}
            capabilities = session.get("capabilities") or {}
            state.duplex = bool(capabilities.get("native_duplex"))
            state.answers = bool(capabilities.get("answers_turns"))
            trace.record_negotiated("format", output_format(session))
            state.created.set()
        elif kind == "input_audio_buffer.speech_stopped":
            if turn is not None and turn.speech_stopped_s is None and now_s >= turn.speech_end_s:
                turn.speech_stopped_s = now_s
            state.speech_stopped.set()
        elif kind == "conversation.item.input_audio_transcription.completed":
            if turn is not None and turn.speech_stopped_s is not None and turn.transcribed_s is None:
                turn.transcribed_s = now_s
        elif kind == "error":
            error = event.error or {}
            code = str(error.get("code") or "server_error")
            if code != "response_cancel_not_active":  # a barge-in after the response had finished: not a fault
                trace.error(code, str(error.get("message") or ""))
        elif kind == "response.created" and turn is not None and not turn.duplex and turn.response_id is None:
            turn.response_id = (event.response or {}).get("id")
        elif kind == "response.output_audio.delta" and turn is not None and event.delta is not None:
            if turn.done.is_set() or now_s < turn.speech_end_s:
                return
            if turn.response_id is None:
                turn.response_id = event.response_id
            if event.response_id != turn.response_id:
                return
            size = len(event.delta) * 3 // 4 - event.delta[-2:].count("=")
            turn.utterance.audio(now_s, size)
            turn.reply_ms += size / 2 * 1000.0 / RATE
            turn.last_delta_s = now_s
            barge_in = self.options.barge_in_ms
            if barge_in is not None and turn.cancel_sent_s is None and turn.reply_ms >= barge_in:
                turn.cancel_sent_s = time.perf_counter()
                await self._send(connection, sending, {"type": "response.cancel"})
            elif turn.duplex and barge_in is None and turn.reply_ms >= self.options.reply_ms:
                turn.utterance.finish(now_s, "completed")
                turn.done.set()
        elif kind == "response.done" and turn is not None and not turn.done.is_set():
            response = event.response or {}
            if response.get("id") != turn.response_id:
                return
            status = response.get("status")
            turn.cancelled = status == "cancelled"
            turn.done_s = now_s
            # A response the client cancelled (barge-in) or capped (max_output_tokens) ended as asked; any other end
            # short of completed was heard by the user as a cut-off reply.
            capped = status == "incomplete" and self.options.max_output_tokens is not None
            capped = capped and (response.get("status_details") or {}).get("reason") == "max_output_tokens"
            if status == "completed" or capped or (turn.cancelled and turn.cancel_sent_s is not None):
                turn.utterance.finish(now_s, "completed")
                if (self.options.talk or state.answers) and status != "cancelled":
                    timings = self._turn_timings(turn, response.get("metadata"))
                    self.turn_timings.append(timings)
                    turn.utterance.steps.update(turn_steps(turn, timings))
            else:
                trace.error(f"response_{status}", str(response.get("status_details")))
                turn.utterance.finish(now_s, "failed")
            turn.done.set()


def turn_steps(turn: _Turn, timings: dict[str, float]) -> dict[str, float]:
    """A completed talk-mode turn's split (see the module docstring), ms; steps that did not happen are left out."""
    steps: dict[str, float] = {}
    if "client_voice_to_voice" in timings:
        steps["voice_to_voice"] = timings["client_voice_to_voice"]
    if turn.speech_stopped_s is not None:
        steps["end_of_turn"] = (turn.speech_stopped_s - turn.speech_end_s) * 1000.0
        if turn.transcribed_s is not None:
            steps["transcription"] = (turn.transcribed_s - turn.speech_stopped_s) * 1000.0
    for step in ("first_token", "first_audio"):
        if step in timings:
            steps[step] = timings[step]
    if "client_turn_to_audio" in timings:
        steps["turn_to_audio"] = timings["client_turn_to_audio"]
    return steps


def reported_timings(metadata: object) -> dict[str, float]:
    """The ``omnigate_<step>_ms`` values of a response's metadata as ``{step: ms}``."""
    if not isinstance(metadata, dict):
        return {}
    out: dict[str, float] = {}
    for key, value in metadata.items():
        if isinstance(key, str) and key.startswith("omnigate_") and key.endswith("_ms"):
            try:
                out[key.removeprefix("omnigate_").removesuffix("_ms")] = float(value)
            except (TypeError, ValueError):
                continue
    return out


def output_format(session: dict[str, Any]) -> str:
    """The output audio format a ``session.created`` announces (``audio/pcm 24000 Hz``), or ``unannounced``."""
    fmt = ((session.get("audio") or {}).get("output") or {}).get("format")
    if not isinstance(fmt, dict) or "type" not in fmt:
        return "unannounced"
    return f"{fmt['type']} {fmt['rate']} Hz" if "rate" in fmt else str(fmt["type"])


class _Microphone:
    """Appends audio in real time: queued speech first, silence otherwise, ``append_ms`` per append."""

    def __init__(self, append_ms: int) -> None:
        self.append_ms = append_ms
        self.piece_bytes = RATE * 2 * append_ms // 1000
        self._speech = bytearray()
        self._spoken: asyncio.Future[float] | None = None

    def say(self, pcm: bytes) -> asyncio.Future[float]:
        """Queue ``pcm``; the future resolves to the time its last piece was sent."""
        self._speech.extend(pcm)
        self._spoken = asyncio.get_running_loop().create_future()
        return self._spoken

    async def run(self, send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        silence = base64.b64encode(bytes(self.piece_bytes)).decode()
        start_s = time.perf_counter()
        index = 0
        while True:
            # A fixed schedule from the start, so a slow send does not stretch the clock.
            await asyncio.sleep(max(0.0, start_s + index * self.append_ms / 1000.0 - time.perf_counter()))
            index += 1
            if self._speech:
                piece = bytes(self._speech[: self.piece_bytes])
                del self._speech[: self.piece_bytes]
                await send({"type": "input_audio_buffer.append", "audio": base64.b64encode(piece).decode()})
                if not self._speech and self._spoken is not None and not self._spoken.done():
                    self._spoken.set_result(time.perf_counter())
            else:
                await send({"type": "input_audio_buffer.append", "audio": silence})
