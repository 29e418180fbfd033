"""The chat and transcription clients against the OpenAI-compatible stand-ins over real HTTP: deltas, usage, keys,
every failure typed with its code, and cancellation closing the HTTP stream (the server sees the disconnect)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator

import httpx
import pytest

from omnigate.engines.openai_compat.chat import ChatClient, coalesce
from omnigate.engines.openai_compat.errors import ServiceError
from omnigate.engines.openai_compat.http_calls import ServiceTimeouts, http_client
from omnigate.engines.openai_compat.messages import (
    ChatDelta,
    ChatFinish,
    ChatMessage,
    ChatRequest,
    ChatTool,
    FunctionSpec,
    TextDelta,
    ToolCallDelta,
)
from omnigate.engines.openai_compat.transcription import TranscriptionClient
from omnigate.loadtest.openai_standins import ScriptedReply, ScriptedToolCall, StandinConfig, StandinServer

SHORT = ServiceTimeouts(connect_s=2.0, first_byte_s=0.3, idle_s=0.3, total_s=5.0)
HELLO = ChatRequest(messages=[ChatMessage("system", "Be brief."), ChatMessage("user", "Hello there")], model="m")


@pytest.fixture
async def standins() -> AsyncIterator[StandinServer]:
    async with StandinServer(StandinConfig(replies=[ScriptedReply(text="Hi! How are you today?")])) as server:
        yield server


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with http_client(2.0) as client:
        yield client


async def collect(chat: ChatClient, request: ChatRequest = HELLO) -> list[ChatDelta]:
    async with chat.stream(request) as deltas:
        return [delta async for delta in deltas]


async def test_a_streamed_reply_comes_as_text_deltas_then_the_finish_with_usage(
    standins: StandinServer, http: httpx.AsyncClient
) -> None:
    chat = ChatClient(http, standins.base_url, api_key="sk-test", timeouts=SHORT)
    deltas = await collect(chat)
    texts = [d.text for d in deltas if isinstance(d, TextDelta)]
    assert "".join(texts) == "Hi! How are you today?" and len(texts) == 5
    finish = deltas[-1]
    assert isinstance(finish, ChatFinish) and finish.finish_reason == "stop"
    assert finish.usage is not None and finish.usage.completion_tokens == 5
    stats = standins.state.stats
    assert stats.last_authorization == "Bearer sk-test"
    assert stats.last_chat_request is not None
    assert stats.last_chat_request["stream"] is True and stats.last_chat_request["model"] == "m"
    assert stats.last_chat_request["messages"][0] == {"role": "system", "content": "Be brief."}


async def test_a_tool_call_streams_as_pieces_and_finishes_with_tool_calls(
    standins: StandinServer, http: httpx.AsyncClient
) -> None:
    standins.state.config.replies = []  # the default reply calls a tool the user's words name
    chat = ChatClient(http, standins.base_url, timeouts=SHORT, include_usage=False)
    request = ChatRequest(
        messages=[ChatMessage("user", "What is the weather in Oslo?")], tools=[ChatTool(FunctionSpec("get_weather"))]
    )
    deltas = await collect(chat, request)
    pieces = [d for d in deltas if isinstance(d, ToolCallDelta)]
    assert pieces[0].name == "get_weather" and pieces[0].id is not None
    assert "".join(p.arguments for p in pieces) == '{"request": "What is the weather in Oslo?"}'
    assert deltas[-1] == ChatFinish("tool_calls", None)
    assert "stream_options" not in (standins.state.stats.last_chat_request or {})


@pytest.mark.parametrize(
    ("mode", "code", "words"),
    [
        ("error", "llm_error", "HTTP 500: the llm stand-in is failing on purpose"),
        ("garbage", "llm_bad_response", "no server-sent events (Content-Type: text/html)"),
        ("hang", "llm_timeout", "the first token took longer than 0.3 s"),
        ("drop", "llm_bad_response", "closed before the response was complete"),
    ],
)
async def test_llm_failures_are_typed(
    standins: StandinServer, http: httpx.AsyncClient, mode: str, code: str, words: str
) -> None:
    standins.state.config.llm_mode = mode  # type: ignore[assignment]
    chat = ChatClient(http, standins.base_url, timeouts=SHORT)
    with pytest.raises(ServiceError) as caught:
        await collect(chat)
    assert caught.value.code == code and words in caught.value.message
    assert caught.value.status == (500 if mode == "error" else None)
    # Back in service, the next request works on the same client.
    standins.state.config.llm_mode = "ok"
    assert isinstance((await collect(chat))[-1], ChatFinish)


async def test_a_stream_that_stalls_between_chunks_times_out_on_the_idle_limit(
    standins: StandinServer, http: httpx.AsyncClient
) -> None:
    standins.state.config.llm_tokens_per_s = 0.5  # two seconds between tokens against a 0.3 s idle limit
    chat = ChatClient(http, standins.base_url, timeouts=SHORT)
    with pytest.raises(ServiceError) as caught:
        await collect(chat)
    assert caught.value.code == "llm_timeout" and "the next chunk" in caught.value.message
    assert await standins.state.wait_for({"llm_disconnects": 1}, 10.0)


async def test_the_total_limit_bounds_a_reply_that_keeps_trickling(
    standins: StandinServer, http: httpx.AsyncClient
) -> None:
    standins.state.config.llm_tokens_per_s = 10.0
    chat = ChatClient(http, standins.base_url, timeouts=ServiceTimeouts(first_byte_s=1.0, idle_s=1.0, total_s=0.25))
    with pytest.raises(ServiceError) as caught:
        await collect(chat)
    assert caught.value.code == "llm_timeout" and "no complete response within 0.25 s" in caught.value.message


async def test_a_reply_beyond_the_size_bound_is_a_bad_response(
    standins: StandinServer, http: httpx.AsyncClient
) -> None:
    chat = ChatClient(http, standins.base_url, timeouts=SHORT, max_response_bytes=200)
    with pytest.raises(ServiceError) as caught:
        await collect(chat)
    assert caught.value.code == "llm_bad_response" and "longer than 200 bytes" in caught.value.message


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_a_service_nobody_listens_on_is_unavailable(http: httpx.AsyncClient) -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"
    with pytest.raises(ServiceError) as caught:
        await collect(ChatClient(http, url, timeouts=SHORT))
    assert caught.value.code == "llm_unavailable"
    with pytest.raises(ServiceError) as caught:
        await TranscriptionClient(http, url, timeouts=SHORT).transcribe(bytes(4800))
    assert caught.value.code == "asr_unavailable"


async def test_cancelling_the_reading_task_closes_the_http_stream(
    standins: StandinServer, http: httpx.AsyncClient
) -> None:
    standins.state.config.llm_tokens_per_s = 2.0  # a long reply still streaming when the task is cancelled
    chat = ChatClient(http, standins.base_url, timeouts=ServiceTimeouts(idle_s=30.0, total_s=60.0))
    first = asyncio.Event()

    async def read() -> None:
        async with chat.stream(HELLO) as deltas:
            async for _ in deltas:
                first.set()

    reader = asyncio.create_task(read())
    await first.wait()
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert await standins.state.wait_for({"llm_disconnects": 1}, 10.0)
    assert standins.state.stats.llm_completed == 0


async def test_leaving_the_stream_while_waiting_in_the_callers_own_code_closes_it_too(
    standins: StandinServer, http: httpx.AsyncClient
) -> None:
    # The caller cancelled while it awaited something else (the TTS): leaving the async with closes the response.
    standins.state.config.llm_tokens_per_s = 2.0
    chat = ChatClient(http, standins.base_url, timeouts=SHORT)
    async with chat.stream(HELLO) as deltas:
        await anext(deltas)
    assert await standins.state.wait_for({"llm_disconnects": 1}, 10.0)


async def test_a_transcription_sends_a_wav_and_returns_the_text(
    standins: StandinServer, http: httpx.AsyncClient
) -> None:
    standins.state.config.transcripts = ["Book a table for two."]
    asr = TranscriptionClient(http, standins.base_url, model="whisper-1", api_key="sk-asr", timeouts=SHORT)
    assert await asr.transcribe(bytes(2 * 24_000 * 3 // 2), 24_000) == "Book a table for two."
    assert await asr.transcribe(bytes(2 * 16_000), 16_000) == StandinConfig().default_transcript
    assert standins.state.stats.asr_audio_s == [1.5, 1.0]
    assert standins.state.stats.last_authorization == "Bearer sk-asr"


@pytest.mark.parametrize(
    ("mode", "code"),
    [("error", "asr_error"), ("garbage", "asr_bad_response"), ("hang", "asr_timeout"), ("drop", "asr_bad_response")],
)
async def test_transcription_failures_are_typed(
    standins: StandinServer, http: httpx.AsyncClient, mode: str, code: str
) -> None:
    standins.state.config.asr_mode = mode  # type: ignore[assignment]
    asr = TranscriptionClient(http, standins.base_url, timeouts=SHORT)
    with pytest.raises(ServiceError) as caught:
        await asr.transcribe(bytes(4800))
    assert caught.value.code == code


async def test_transcription_input_is_bounded(http: httpx.AsyncClient) -> None:
    asr = TranscriptionClient(http, f"http://127.0.0.1:{closed_port()}/v1", max_audio_s=1.0)
    with pytest.raises(ValueError, match="sample_rate"):
        await asr.transcribe(bytes(100), 44_100)
    with pytest.raises(ValueError, match="even number"):
        await asr.transcribe(bytes(3), 24_000)


async def test_a_turn_longer_than_the_bound_sends_its_newest_audio(
    standins: StandinServer, http: httpx.AsyncClient
) -> None:
    asr = TranscriptionClient(http, standins.base_url, timeouts=SHORT, max_audio_s=1.0)
    await asr.transcribe(bytes(2 * 24_000 * 3), 24_000)
    assert standins.state.stats.asr_audio_s == [1.0]


def test_coalesce_merges_runs_of_text_and_of_one_call_s_argument_pieces() -> None:
    deltas: list[TextDelta | ToolCallDelta] = [
        TextDelta("Hel"),
        TextDelta("lo"),
        ToolCallDelta(0, "c1", "get_weather", ""),
        ToolCallDelta(0, None, None, '{"ci'),
        ToolCallDelta(0, None, None, 'ty": 1}'),
        ToolCallDelta(1, "c2", "hang_up", "{"),  # another call: a new delta
        ToolCallDelta(1, None, None, "}"),
        TextDelta("!"),
    ]
    assert coalesce(deltas) == [
        TextDelta("Hello"),
        ToolCallDelta(0, "c1", "get_weather", '{"city": 1}'),
        ToolCallDelta(1, "c2", "hang_up", "{}"),
        TextDelta("!"),
    ]
    assert coalesce([]) == []


async def test_a_burst_of_tiny_chunks_in_one_write_comes_as_few_deltas(
    standins: StandinServer, http: httpx.AsyncClient
) -> None:
    arguments = {"notes": "n" * 24_000}  # 3,000 pieces of 8 characters, written at once
    standins.state.config.llm_mode = "burst"
    standins.state.config.replies = [ScriptedReply(tool_call=ScriptedToolCall("get_weather", arguments))]
    chat = ChatClient(http, standins.base_url, timeouts=SHORT)
    deltas = await collect(chat)
    pieces = [d for d in deltas if isinstance(d, ToolCallDelta)]
    assert json.loads("".join(p.arguments for p in pieces)) == arguments
    assert len(pieces) < 300  # one per network read, not one per chunk
    assert isinstance(deltas[-1], ChatFinish) and deltas[-1].finish_reason == "tool_calls"
