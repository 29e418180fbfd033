"""The embedded LLM as the chat client a realtime session streams its answer from (no ``--llm-url``).

:meth:`EmbeddedChat.stream` takes the :class:`~omnigate.engines.openai_compat.messages.ChatRequest` the session
would send to an OpenAI-compatible server and yields the same deltas as
:class:`~omnigate.engines.openai_compat.chat.ChatClient`: text pieces, then one ``ChatFinish`` with the usage. The
conversation is rendered in the model's chat markup (ChatML); tools are not offered to this model, so it only ever
answers in text. Failures are :class:`~omnigate.engines.openai_compat.errors.ServiceError` whose ``code`` the
client sees: ``engine_busy`` (every conversation place is answering), ``context_length_exceeded``, and
``llm_unavailable`` while the model is still loading after ``load_wait_s`` or if it failed to load.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncGenerator

from omnigate.engines.base import EngineError
from omnigate.engines.llm.engine import (
    DEFAULT_MAX_CONTEXT,
    DEFAULT_SESSIONS,
    LlmDone,
    LlmEngine,
    LlmOutput,
    LlmRequest,
    LlmText,
)
from omnigate.engines.llm.model import load_smollm2
from omnigate.engines.openai_compat.chat import ChatStream
from omnigate.engines.openai_compat.errors import ServiceError
from omnigate.engines.openai_compat.messages import ChatDelta, ChatFinish, ChatMessage, ChatRequest, TextDelta, Usage

# SmolLM2's own chat template puts this system turn first when the conversation brings none.
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# A request that names no temperature: OpenAI realtime's default, which keeps a small model's answers coherent.
DEFAULT_TEMPERATURE = 0.8


class EmbeddedLlmError(ServiceError):
    """A request the embedded LLM refused or could not finish, with the engine's own code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__("llm", "error", message)
        self.code = code


def render_chat(messages: list[ChatMessage]) -> str:
    """The conversation in ChatML, ending with the opened assistant turn the answer continues."""
    parts: list[str] = []
    if not messages or messages[0].role != "system":
        parts.append(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n")
    for message in messages:
        if message.content is not None:  # an assistant turn that only called tools says nothing to this model
            parts.append(f"<|im_start|>{message.role}\n{message.content}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


class EmbeddedChat:
    """Streams answers from ``engine``. ``seed``: the first request's sampling seed, counting up (None: random)."""

    def __init__(self, engine: LlmEngine, *, load_wait_s: float, seed: int | None = None) -> None:
        self.engine = engine
        self.load_wait_s = load_wait_s
        self._seed = seed

    def stream(self, request: ChatRequest) -> ChatStream:
        """Start nothing yet: the request is submitted when the deltas are first read."""
        return ChatStream(self._deltas(request))

    def _next_seed(self) -> int:
        if self._seed is None:
            return secrets.randbits(63)
        seed, self._seed = self._seed, self._seed + 1
        return seed

    async def _deltas(self, request: ChatRequest) -> AsyncGenerator[ChatDelta, None]:
        engine = self.engine
        if engine.loading and not await asyncio.to_thread(engine.wait_loaded, self.load_wait_s):
            raise ServiceError("llm", "unavailable", "the embedded LLM is still loading; retry in a few seconds")
        temperature = request.temperature if isinstance(request.temperature, float | int) else DEFAULT_TEMPERATURE
        top_p = request.top_p if isinstance(request.top_p, float | int) else 1.0
        max_tokens = request.max_tokens if isinstance(request.max_tokens, int) else engine.max_answer_tokens
        llm_request = LlmRequest(
            render_chat(request.messages), max_tokens, float(temperature), float(top_p), self._next_seed()
        )
        outputs: list[LlmOutput] = []  # bounded: an answer's tokens at most, plus its end
        arrived = asyncio.Event()

        def sink(batch: list[LlmOutput]) -> None:
            outputs.extend(batch)
            arrived.set()

        try:
            job = engine.submit(llm_request, sink)
        except EngineError as exc:
            if exc.code == "model_unavailable":
                raise ServiceError("llm", "unavailable", exc.message) from exc
            raise EmbeddedLlmError(exc.code, exc.message) from exc
        try:
            while True:
                await arrived.wait()
                arrived.clear()
                batch, outputs[:] = list(outputs), []
                text = "".join(o.text for o in batch if isinstance(o, LlmText))
                if text:
                    yield TextDelta(text)
                done = next((o for o in batch if isinstance(o, LlmDone)), None)
                if done is not None:
                    if done.reason == "error":
                        raise EmbeddedLlmError(done.code or "llm_error", done.error or "the embedded LLM failed")
                    usage = Usage(
                        done.prompt_tokens, done.completion_tokens, done.prompt_tokens + done.completion_tokens
                    )
                    yield ChatFinish(done.reason, usage)
                    return
        finally:
            job.cancel()  # a barge-in or a closed session: the slot is freed at the worker's next loop


def start_embedded_chat(*, load_wait_s: float, seed: int | None = None) -> EmbeddedChat:
    """The chat of SmolLM2-135M-Instruct, whose engine starts now and loads the model on its worker thread.
    ``seed``: the first answer's sampling seed, counting up by one per answer (None: each answer's is random)."""
    engine = LlmEngine(lambda: load_smollm2(slots=DEFAULT_SESSIONS, max_context=DEFAULT_MAX_CONTEXT))
    engine.start()
    return EmbeddedChat(engine, load_wait_s=load_wait_s, seed=seed)
