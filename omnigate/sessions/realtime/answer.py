"""How a realtime session answers the user with an LLM (sans-I/O): transcripts, the request, the streamed reply.

A user turn that ends (server VAD or a commit) is transcribed; a response starts at once (``create_response``) or on
``response.create``, and asks the LLM once the transcripts of the turns before it are in. The reply's text goes to
the TTS as it streams (the segmenter starts speaking at its first sentence or clause); its tool calls become
``function_call`` items with their argument deltas. A response that is cancelled (``response.cancel``, barge-in)
stops its LLM request at once, and its item keeps the transcript of the audio the user was sent: that is what the
LLM reads of it next time. A failure of the LLM or the recognizer is an ``error`` with a stable code and a failed
response; the session goes on. :class:`Answering` decides; the session's adapter runs the requests it makes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from omnigate.engines.openai_compat.messages import ChatDelta, ChatFinish, ToolCallDelta
from omnigate.engines.openai_compat.messages import TextDelta as ChatText
from omnigate.sessions.realtime.client_events import ResponseParams
from omnigate.sessions.realtime.config import RealtimeConfig, ResponseSettings, server_response_settings
from omnigate.sessions.realtime.conversation import Conversation, ConversationError, Item, Response, ResponseStatus
from omnigate.sessions.realtime.requests import (
    CancelChat,
    ForgetAudio,
    ServiceFailed,
    SessionRequest,
    StartChat,
    Transcribe,
    TurnMeasured,
)
from omnigate.sessions.realtime.responder import (
    HistoryItem,
    ResponderInputError,
    ToolCallAssembler,
    ToolCallError,
    TurnTiming,
    chat_request,
)
from omnigate.sessions.realtime.server_events import (
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    ServerEvent,
    TranscriptionCompleted,
    TranscriptionFailed,
    WireTranscriptionError,
    WireTranscriptionUsage,
)
from omnigate.sessions.realtime.turn_audio import BYTES_PER_MS


class ResponderPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """How a session answers the user with an LLM: the model named in requests (None: the server's own), the
    server's token cap per reply, the conversation's size in the request, whether user turns are transcribed and
    whether the recognizer streams (hears each turn's audio as it comes, :class:`HearAudio`)."""

    model: str | None = None
    max_tokens: int = 1024
    history_max_chars: int = 24_000
    transcription: bool = False
    streaming_transcription: bool = False
    max_pending_transcriptions: int = 4


class AnswerHost(Protocol):
    """What :class:`Answering` uses of its session: the conversation, the response lifecycle and the engine."""

    conversation: Conversation
    config: RealtimeConfig

    @property
    def active(self) -> Response | None: ...

    def new_id(self, prefix: str) -> str: ...

    def emit(self, event: ServerEvent) -> None: ...

    def server_error(self, code: str, message: str) -> None: ...

    def begin_response(self, settings: ResponseSettings) -> Response: ...

    def add_output_item(self, response: Response, item: Item) -> int:
        """Add ``item`` to ``response``'s output (and the conversation); returns its output index."""

    def output_item_done(self, response: Response, item: Item) -> None: ...

    def fail_response(self, response: Response, code: str, message: str) -> None:
        """Stop the engine, drop what is queued of ``response`` and end it failed."""

    def finish_response(self, response: Response, status: ResponseStatus) -> None: ...

    def open_speech(self, response: Response, settings: ResponseSettings) -> None: ...

    def add_speech(self, response: Response, text: str) -> None: ...

    def close_speech(self, response: Response) -> None: ...

    def response_text(self, response: Response, text: str, tokens: int) -> None: ...


@dataclass(eq=False)
class Answer:
    """The LLM side of one response."""

    response: Response
    settings: ResponseSettings
    timing: TurnTiming
    assembler: ToolCallAssembler
    instructions: str
    tools: tuple[object, ...]
    tool_choice: str | dict[str, object]
    temperature: float | None
    calls: dict[str, Item] = field(default_factory=dict)  # by call id
    waiting: bool = False  # the LLM request waits for the transcripts of the user's turns
    chatting: bool = False  # the LLM request is out and its stream not ended
    speaking: bool = False  # reply text went to the TTS
    completion_tokens: int | None = None
    cut_by_llm: bool = False  # the LLM stopped at its token limit


def history(items: Iterable[Item]) -> list[HistoryItem]:
    """The conversation as the LLM reads it: an item's text, or its audio's transcript (as truncated)."""
    out: list[HistoryItem] = []
    for item in items:
        if item.type == "function_call":
            out.append(
                HistoryItem(
                    kind="function_call",
                    call_id=item.call_id,
                    name=item.name,
                    arguments=item.arguments,
                    response_id=item.response_id,
                )
            )
        elif item.type == "function_call_output":
            out.append(HistoryItem(kind="function_call_output", call_id=item.call_id, output=item.output))
        else:
            text = " ".join(
                piece.strip() for part in item.content if (piece := part.text or part.transcript or "").strip()
            )
            out.append(HistoryItem(kind="message", role=item.role, text=text))
    return out


class Answering:
    """The responder of one session: its pending transcriptions and the response the LLM is writing."""

    def __init__(self, host: AnswerHost, policy: ResponderPolicy, request: Callable[[SessionRequest], None]) -> None:
        self.host = host
        self.policy = policy
        self.request = request
        self.answer: Answer | None = None
        self._transcribing: dict[str, tuple[Item, float]] = {}  # user items awaiting their transcript, audio s
        self._turn_timings: dict[str, TurnTiming] = {}  # of the items being transcribed
        self._next_timing: TurnTiming | None = None  # of the newest turn, for the response that answers it

    def of(self, response: Response) -> Answer | None:
        """The answer ``response`` is, if the LLM writes it."""
        answer = self.answer
        return answer if answer is not None and answer.response is response else None

    # ---- user turns ---------------------------------------------------------------------------------------------

    def turn_committed(self, item: Item, pcm: bytes, now: float, heard_bytes: int = 0) -> None:
        """A user audio turn ended: transcribe it and, under ``create_response``, answer it. ``pcm`` is its audio
        the recognizer has not heard yet; ``heard_bytes``, what it heard as the turn went (:class:`HearAudio`)."""
        if not self.policy.transcription or not (pcm or heard_bytes):
            return  # without a transcript the LLM cannot hear an audio turn
        if len(self._transcribing) >= self.policy.max_pending_transcriptions:
            if heard_bytes:
                self.request(ForgetAudio())
            message = f"more than {self.policy.max_pending_transcriptions} turns are waiting for transcription"
            self._transcription_error(item.id, "asr_backlog", message)
            return
        timing = TurnTiming(now)
        timing.mark("asr_sent", now)
        self._transcribing[item.id] = (item, (len(pcm) + heard_bytes) / BYTES_PER_MS / 1000.0)
        self._turn_timings[item.id] = timing
        self._next_timing = timing
        self.request(Transcribe(item.id, pcm))
        td = self.host.config.turn_detection
        if td is not None and td.create_response and self.host.active is None:
            self.answer_now(server_response_settings(self.host.config), None, now)

    def transcribed(self, item_id: str, transcript: str, now: float) -> None:
        pending = self._transcribing.pop(item_id, None)
        timing = self._turn_timings.pop(item_id, None)
        if pending is None:
            return
        item, seconds = pending
        if timing is not None:
            timing.mark("transcript_done", now)
        item.content[0].transcript = transcript
        self.host.emit(
            TranscriptionCompleted(
                event_id=self.host.new_id("event"),
                item_id=item_id,
                content_index=0,
                transcript=transcript,
                usage=WireTranscriptionUsage(seconds=round(seconds, 3)),
            )
        )
        answer = self.answer
        if answer is not None and answer.waiting and not self._transcribing:
            answer.waiting = False
            self._ask(answer, now)

    def transcription_failed(self, item_id: str, code: str, message: str) -> None:
        if self._transcribing.pop(item_id, None) is None:
            return
        self._turn_timings.pop(item_id, None)
        self._transcription_error(item_id, code, message)
        answer = self.answer
        if answer is not None and answer.waiting:
            self._fail(answer, code, message, reported=True)  # the error went out once, with the transcription

    def _transcription_error(self, item_id: str, code: str, message: str) -> None:
        self.host.emit(
            TranscriptionFailed(
                event_id=self.host.new_id("event"),
                item_id=item_id,
                content_index=0,
                error=WireTranscriptionError(type="server_error", code=code, message=message),
            )
        )
        self.host.server_error(code, message)
        self.request(ServiceFailed(code))

    # ---- the reply ----------------------------------------------------------------------------------------------

    def answer_now(self, settings: ResponseSettings, params: ResponseParams | None, now: float) -> None:
        """Start a response the LLM writes; it asks once the transcripts of the user's turns are in."""
        config = self.host.config
        timing = self._next_timing or TurnTiming(now)
        self._next_timing = None
        response = self.host.begin_response(settings)
        answer = Answer(
            response=response,
            settings=settings,
            timing=timing,
            assembler=ToolCallAssembler(lambda: self.host.new_id("call")),
            instructions=params.instructions if params and params.instructions is not None else config.instructions,
            tools=tuple(params.tools) if params and params.tools is not None else config.passthrough.tools,
            tool_choice=(
                params.tool_choice if params and params.tool_choice is not None else config.passthrough.tool_choice
            ),
            temperature=(
                params.temperature if params and params.temperature is not None else config.passthrough.temperature
            ),
        )
        self.answer = answer
        if self._transcribing:
            answer.waiting = True
        else:
            self._ask(answer, now)

    def _ask(self, answer: Answer, now: float) -> None:
        response = answer.response
        try:
            request = chat_request(
                instructions=answer.instructions,
                history=history(item for item in self.host.conversation if item.response_id != response.id),
                max_chars=self.policy.history_max_chars,
                max_tokens=self.policy.max_tokens,
                model=self.policy.model,
                tools=answer.tools,
                tool_choice=answer.tool_choice,
                max_output_tokens=response.max_output_tokens,
                temperature=answer.temperature,
            )
        except ResponderInputError as exc:
            self._fail(answer, "invalid_tools", f"{exc} ({exc.param})")
            return
        # Until the LLM reports its usage, the request's words stand for its tokens.
        response.input_text_tokens = sum(len((message.content or "").split()) for message in request.messages)
        answer.timing.mark("llm_sent", now)
        answer.chatting = True
        self.request(StartChat(response.id, request))

    def chat_delta(self, response_id: str, delta: ChatDelta, now: float) -> None:
        answer = self.answer
        if answer is None or answer.response.id != response_id or not answer.chatting:
            return  # a late piece of a request that was cancelled or failed
        if isinstance(delta, ChatText):
            answer.timing.mark("first_token", now)
            if delta.text:
                self._speak(answer, delta.text, now)
        elif isinstance(delta, ToolCallDelta):
            answer.timing.mark("first_token", now)
            self._tool_call_delta(answer, delta)
        elif isinstance(delta, ChatFinish):
            self._chat_finished(answer, delta)

    def chat_failed(self, response_id: str, code: str, message: str) -> None:
        answer = self.answer
        if answer is not None and answer.response.id == response_id and answer.chatting:
            answer.chatting = False
            self._fail(answer, code, message)

    def _speak(self, answer: Answer, text: str, now: float) -> None:
        if "audio" not in answer.response.output_modalities:
            self.host.response_text(answer.response, text, 0)  # a text reply: its tokens come with the usage
            return
        if not answer.speaking:
            answer.speaking = True
            self.host.open_speech(answer.response, answer.settings)
        self.host.add_speech(answer.response, text)

    def _tool_call_delta(self, answer: Answer, delta: ToolCallDelta) -> None:
        response = answer.response
        try:
            call_id = answer.assembler.add(delta)
        except ToolCallError as exc:
            self._fail(answer, "llm_bad_response", str(exc))
            return
        item = answer.calls.get(call_id)
        if item is None:
            item = Item(
                id=self.host.new_id("item"),
                role="assistant",
                status="in_progress",
                content=[],
                response_id=response.id,
                type="function_call",
                call_id=call_id,
                name=delta.name or "",
            )
            answer.calls[call_id] = item
            self.host.add_output_item(response, item)
        if delta.arguments:
            item.arguments += delta.arguments
            self.host.emit(
                FunctionCallArgumentsDelta(
                    event_id=self.host.new_id("event"),
                    response_id=response.id,
                    item_id=item.id,
                    output_index=response.outputs.index(item),
                    call_id=call_id,
                    delta=delta.arguments,
                )
            )

    def _chat_finished(self, answer: Answer, finish: ChatFinish) -> None:
        response = answer.response
        try:
            calls = answer.assembler.complete()
        except ToolCallError as exc:
            self._fail(answer, "llm_bad_response", str(exc))
            return
        answer.chatting = False
        if finish.usage is not None:
            response.input_text_tokens = finish.usage.prompt_tokens
            answer.completion_tokens = finish.usage.completion_tokens
        answer.cut_by_llm = finish.finish_reason == "length"
        for call in calls:
            item = answer.calls[call.id]
            item.name = call.function.name
            item.arguments = call.function.arguments
            item.status = "completed"
            self.host.emit(
                FunctionCallArgumentsDone(
                    event_id=self.host.new_id("event"),
                    response_id=response.id,
                    item_id=item.id,
                    output_index=response.outputs.index(item),
                    call_id=call.id,
                    name=item.name,
                    arguments=item.arguments,
                )
            )
            self.host.output_item_done(response, item)
        if answer.speaking:
            self.host.close_speech(response)  # the engine ends the response once the rest is spoken
        else:
            self.host.finish_response(response, "completed")

    def _fail(self, answer: Answer, code: str, message: str, *, reported: bool = False) -> None:
        """End ``answer``'s response failed with ``code``; unless ``reported`` already, an ``error`` says so."""
        if not reported:
            self.host.server_error(code, message)
            self.request(ServiceFailed(code))
        self._keep_heard(answer.response)  # its queued audio is dropped with it
        self.host.fail_response(answer.response, code, message)

    # ---- the end of a response ----------------------------------------------------------------------------------

    def cancelling(self, response: Response) -> None:
        """``response`` is being cancelled (the client, a barge-in): stop its request; its item keeps the
        transcript of the audio the user was sent, which is what the LLM is told it said next time."""
        if self.of(response) is not None:
            self.stop()
            self._keep_heard(response)

    def _keep_heard(self, response: Response) -> None:
        item = response.item
        if item is not None and response.in_conversation:
            with contextlib.suppress(ConversationError):  # (a text reply: there is no audio to cut)
                self.host.conversation.truncate(item.id, 0, int(item.sent_ms))

    def ending(
        self, response: Response, status: ResponseStatus, reason: str | None
    ) -> tuple[ResponseStatus, str | None]:
        """``response`` ends: its request stops, its usage and timings are final. Returns its status and reason."""
        answer = self.of(response)
        if answer is None:
            return status, reason
        self.stop()
        self.answer = None
        if status == "completed" and answer.cut_by_llm:
            status, reason = "incomplete", "max_output_tokens"
        if answer.completion_tokens is not None:
            response.output_text_tokens = answer.completion_tokens
        timings = answer.timing.timings()
        response.metadata = {**(response.metadata or {}), **timings.metadata()}
        if status == "completed":
            self.request(TurnMeasured(timings))
        return status, reason

    def audio_made(self, response: Response, now: float, engine_ms: float | None) -> None:
        """The engine made audio of ``response``; ``engine_ms`` before, it was given the text it starts with: the
        first segment, which went to it as soon as the segmenter had it whole (the LLM's part ends there)."""
        answer = self.of(response)
        if answer is not None and engine_ms is not None and answer.timing.tts_first_audio is None:
            given = now - engine_ms / 1000.0
            answer.timing.mark("first_segment", given)
            answer.timing.mark("tts_sent", given)
            answer.timing.mark("tts_first_audio", now)

    def audio_sent(self, response_id: str, now: float) -> None:
        """Audio of response ``response_id`` was handed to the transport."""
        answer = self.answer
        if answer is not None and answer.response.id == response_id:
            answer.timing.mark("first_audio_out", now)

    def stop(self) -> None:
        """Stop the LLM request in flight, if any."""
        answer = self.answer
        if answer is not None and answer.chatting:
            answer.chatting = False
            self.request(CancelChat(answer.response.id))

    def release(self) -> None:
        self.answer = None
        self._transcribing.clear()
        self._turn_timings.clear()
