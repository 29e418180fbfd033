"""Realtime sessions on an engine that answers the conversation itself (``--engine qwen3-omni``), no LLM or ASR.

Each committed user turn's audio is kept (by item) and encoded into the model's audio tokens when a response needs
it, by the engine (with the other sessions' waiting turns: ``engine_busy`` fails the response when too many
wait). An engine that hears a turn as it comes (``turn_ahead``) is given the turn in progress, and encodes its whole
windows while the user still speaks; the turn's end then encodes only the rest. ``response.create`` (or a turn
server VAD ended) hands the conversation to the engine, whose text comes back as the response's transcript and whose
voice as its audio (at the engine's rate). The engine makes an answer faster than it plays: what the session's outbox
has no room for waits here, in order, and goes on as the transport takes audio, so a client that plays in real time
(a WebRTC track) is not overrun. The engine holds credit: an answer may make :data:`CREDIT_CHUNKS` audio chunks more
than this session has handed to its outbox, and pauses (its thinker and talker are not stepped) until the outbox takes
more, so what waits here is at most that much audio whatever the client's pace. Cancelling a response
(``response.cancel``, barge-in, a failed outbox) cancels the engine's turn at once and drops what waits; truncation is
the session core's, against the audio handed to the transport.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec

from omnigate.engines.answering import AnswerHandle, AnsweringEngine, PromptTurn, TurnHearing
from omnigate.engines.base import EngineError
from omnigate.gateway.realtime.backend import Backend, ResponseSink
from omnigate.sessions.realtime.capabilities import RealtimeCapabilities, capabilities_for
from omnigate.sessions.realtime.config import RealtimeConfig, ResponseSettings
from omnigate.sessions.realtime.conversation import Item, Response

log = logging.getLogger(__name__)

MAX_ANSWER_TOKENS = 512  # an answer's text tokens when the response sets no max_output_tokens
# Speech of a text token takes about 4 codec frames (12.5 frames, ~3 tokens a second): twice that bounds an answer's
# voice, so a voice that does not end (random weights) still ends with its response.
FRAMES_PER_TOKEN = 8
# Audio chunks (codec frames: 80 ms each for Qwen3-Omni, 320 ms in all) an answer may be ahead of the outbox.
CREDIT_CHUNKS = 4


@dataclass(frozen=True)
class _End:
    reason: str
    code: str | None
    message: str | None


_Output = str | bytes | _End  # transcript text, 24 kHz audio, the end


@dataclass
class _Heard:
    """A committed turn the engine heard as it came: the whole turn's audio, and its encoding once a response asks
    (one encoding, whichever responses await it; after a failure a retry encodes the PCM whole)."""

    ahead: TurnHearing
    pcm: bytes
    encoding: asyncio.Task[Any] | None = None


class ModelAnswerBackend(Backend):
    """One realtime session on an :class:`AnsweringEngine`: at most one answer in flight."""

    def __init__(self, engine: AnsweringEngine) -> None:
        self.engine = engine
        self.capabilities: RealtimeCapabilities = msgspec.structs.replace(
            capabilities_for(engine.info), create_response=True, answers_turns=True, instructions=True
        )
        self.sample_rate = engine.info.sample_rate
        self._sink: ResponseSink | None = None
        self._instructions = ""
        # by user item: its turn's PCM (or _Heard), then (once encoded) its audio tokens
        self._audio: dict[str, object] = {}
        self._pcm: set[str] = set()  # the items of _audio still holding PCM
        self._response: Response | None = None
        self._task: asyncio.Task[None] | None = None
        self._handle: AnswerHandle | None = None
        self._handed = 0  # audio chunks of the answer in flight handed to the session
        self._held: deque[tuple[Response, _Output]] = deque()  # the answer's outputs not yet handed to the session
        self._relay: asyncio.Task[None] | None = None
        self._ahead = engine.turn_ahead()  # the turn in progress, heard as it comes (None: encoded at its end)
        self._heard = bytearray()  # its audio so far
        self.hears_turns = self._ahead is not None

    def start(self, sink: ResponseSink, config: RealtimeConfig) -> None:
        self._sink = sink
        self._instructions = config.instructions

    def reconfigure(self, config: RealtimeConfig) -> None:
        self._instructions = config.instructions

    def open_speech(self, response: Response, settings: ResponseSettings) -> None:
        raise RuntimeError("the model answers the conversation; it does not speak given text")

    def add_speech(self, response: Response, text: str) -> None:
        raise RuntimeError("the model answers the conversation; it does not speak given text")

    def close_speech(self, response: Response) -> None:
        raise RuntimeError("the model answers the conversation; it does not speak given text")

    def turn_audio(self, item_id: str, pcm: bytes) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            self._audio[item_id] = pcm
        else:
            self._audio[item_id] = _Heard(ahead, bytes(self._heard) + pcm)
            self._heard.clear()
        self._pcm.add(item_id)

    def hear_turn_audio(self, pcm: bytes) -> None:
        if self._ahead is None:
            self._ahead = self.engine.turn_ahead()
        if self._ahead is not None:
            self._ahead.hear(pcm)
            self._heard += pcm

    def forget_turn_audio(self) -> None:
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None
        self._heard.clear()

    def answer(self, response: Response, settings: ResponseSettings, conversation: list[Item]) -> None:
        self._stop()
        kept = {item.id for item in conversation}
        for item_id in [i for i in self._audio if i not in kept]:  # items the conversation forgot or deleted
            _drop(self._audio.pop(item_id))
            self._pcm.discard(item_id)
        turns: list[tuple[str, str, str | None]] = []
        for item in conversation:
            if item.type != "message" or item.response_id == response.id:
                continue
            text = item.text() or item.transcript()
            audio = item.id if item.role == "user" and item.id in self._audio else None
            if text or audio is not None:
                turns.append((item.role, text, audio))
        self._response = response
        self._handed = 0
        limit = response.max_output_tokens
        task = asyncio.get_running_loop().create_task(
            self._submit(response, turns, settings.voice, min(limit or MAX_ANSWER_TOKENS, MAX_ANSWER_TOKENS)),
            name=f"realtime-answer-{response.id}",
        )
        task.add_done_callback(self._submitted)
        self._task = task

    async def _submit(
        self, response: Response, turns: list[tuple[str, str, str | None]], speaker: str, max_tokens: int
    ) -> None:
        prompt: list[PromptTurn] = []
        for role, text, audio_id in turns:
            tokens = None
            if audio_id is not None:
                if audio_id in self._pcm:
                    try:
                        encoded = await self._encoded(audio_id)
                    except EngineError as exc:
                        self._refused(response, exc)
                        return
                    if audio_id in self._pcm:  # (not released or forgotten meanwhile)
                        self._audio[audio_id] = encoded
                        self._pcm.discard(audio_id)
                    tokens = encoded
                else:
                    tokens = self._audio[audio_id]
            prompt.append((role, text, tokens))
        sink = self._sink
        if sink is None or response is not self._response:
            return  # released or cancelled while the audio was encoded
        try:
            self._handle = self.engine.answer(
                prompt,
                _Answer(self, response),
                instructions=self._instructions,
                speaker=speaker,
                max_tokens=max_tokens,
                max_frames=FRAMES_PER_TOKEN * max_tokens,
                credit=CREDIT_CHUNKS,
            )
        except EngineError as exc:
            self._refused(response, exc)

    def _refused(self, response: Response, error: EngineError) -> None:
        if self._sink is None or response is not self._response:
            return  # released or cancelled meanwhile
        self._response = None
        self._sink.finish_response(response, "failed", error=(error.code, error.message))

    def _submitted(self, task: asyncio.Task[None]) -> None:
        if task is self._task:
            self._task = None
        if task.cancelled() or (error := task.exception()) is None:
            return
        log.error("a realtime answer could not start", exc_info=error)
        response, self._response = self._response, None
        if self._sink is not None and response is not None:
            self._sink.finish_response(response, "failed", error=("server_error", "the answer failed in the server"))

    def hold(self, response: Response, output: _Output) -> None:
        """An output of ``response``'s answer, handed on in order as the outbox has room."""
        if response is not self._response:
            return
        self._held.append((response, output))
        if self._relay is None:
            self._relay = asyncio.get_running_loop().create_task(self._hand_on(), name=f"realtime-relay-{response.id}")
            self._relay.add_done_callback(self._relay_ended)

    async def _hand_on(self) -> None:
        while self._held:
            response, output = self._held[0]
            sink = self._sink
            if sink is None:
                return
            if isinstance(output, bytes):
                await sink.wait_for_room()
                if not self._held or self._held[0][1] is not output:  # cancelled while waiting
                    continue
            self._held.popleft()
            if response is not self._response:
                continue
            if isinstance(output, str):
                sink.response_text(response, output, 1)
            elif isinstance(output, bytes):
                sink.response_audio(response, output, self.sample_rate)
                self._handed += 1
                if self._handle is not None:
                    self._handle.grant(self._handed + CREDIT_CHUNKS)
            else:
                self._ended(response, output.reason, output.code, output.message)

    def _relay_ended(self, task: asyncio.Task[None]) -> None:
        if task is self._relay:
            self._relay = None
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("a realtime answer's relay failed", exc_info=error)
            if self._sink is not None:
                self._sink.fail("server_error", "the answer's delivery failed in the server")

    def _ended(self, response: Response, reason: str, code: str | None, message: str | None) -> None:
        self._response = None
        self._handle = None
        sink = self._sink
        if sink is None:
            return
        if code is not None:
            sink.finish_response(response, "failed", error=(code, message or code))
        elif reason == "stop":
            sink.finish_response(response, "completed")
        elif reason == "max_context":
            sink.finish_response(
                response, "failed", error=("context_length_exceeded", "the answer reached the model's context length")
            )
        else:
            sink.finish_response(response, "incomplete", "max_output_tokens")

    def cancel(self, response: Response) -> None:
        if response is self._response:
            self._stop()

    def _stop(self) -> None:
        self._response = None
        self._held.clear()
        if self._relay is not None:
            self._relay.cancel()
            self._relay = None
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    async def _encoded(self, audio_id: str) -> Any:
        """The audio tokens of a committed turn whose PCM is held; raises EngineError."""
        held = self._audio[audio_id]
        if isinstance(held, bytes):
            return await self.engine.encode_audio(held)
        assert isinstance(held, _Heard)
        if held.encoding is None:
            held.encoding = asyncio.get_running_loop().create_task(
                self.engine.finish_turn(held.ahead, held.pcm), name=f"realtime-turn-{audio_id}"
            )
        try:
            return await asyncio.shield(held.encoding)  # a cancelled response leaves it to the next one
        except EngineError:
            if self._audio.get(audio_id) is held:
                held.ahead.close()
                self._audio[audio_id] = held.pcm  # the next response encodes it whole
            raise

    def push_audio(self, pcm: bytes) -> bool:
        return True  # the session core keeps the turn's audio and commits it here (turn_audio)

    def clear_input(self) -> None:
        """The session core holds the uncommitted audio."""

    def released_audio(self, ms: float) -> None:
        """Credit returns as audio is handed to the outbox, which itself waits for room (:meth:`_hand_on`)."""

    def release(self) -> None:
        self._stop()
        for held in self._audio.values():
            _drop(held)
        self._audio.clear()
        self._pcm.clear()
        self.forget_turn_audio()
        self._sink = None  # the session refers to this backend: no cycle outlives the session


class _Answer:
    """The sink of one response's answer (:class:`~omnigate.engines.answering.AnswerSink`)."""

    def __init__(self, backend: ModelAnswerBackend, response: Response) -> None:
        self._backend = backend
        self._response = response

    def text(self, delta: str) -> None:
        self._backend.hold(self._response, delta)

    def audio(self, pcm: bytes, sample_rate: int) -> None:
        self._backend.hold(self._response, pcm)

    def end(self, reason: str, code: str | None, message: str | None) -> None:
        self._backend.hold(self._response, _End(reason, code, message))


def _drop(held: object) -> None:
    """A turn's audio is forgotten: what its engine still holds of it may go."""
    if isinstance(held, _Heard):
        held.ahead.close()
        if held.encoding is not None:
            held.encoding.cancel()
