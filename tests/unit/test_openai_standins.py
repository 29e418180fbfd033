"""The OpenAI-compatible stand-ins: scripts, timing knobs, failure modes switched at runtime, the admin routes,
and the ``omnigate-loadtest standins`` command serving them from a subprocess."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from omnigate.engines.openai_compat.transcription import wav_bytes
from omnigate.loadtest.openai_standins import (
    ScriptedReply,
    ScriptedToolCall,
    StandinConfig,
    StandinServer,
    default_reply,
    standins_process,
)


@pytest.fixture
async def standins() -> AsyncIterator[StandinServer]:
    async with StandinServer() as server:
        yield server


def sse_payloads(body: str) -> list[str]:
    return [line[len("data: ") :] for line in body.splitlines() if line.startswith("data: ")]


async def test_scripted_replies_come_in_order_then_the_default(standins: StandinServer) -> None:
    standins.state.config.replies = [
        ScriptedReply(text="One."),
        ScriptedReply(tool_call=ScriptedToolCall("hang_up", {"reason": "done"})),
    ]
    url = standins.base_url + "/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient() as client:
        first = (await client.post(url, json=body)).json()
        second = (await client.post(url, json={**body, "stream": True})).text
        third = (await client.post(url, json=body)).json()
    assert first["choices"][0]["message"]["content"] == "One."
    payloads = sse_payloads(second)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    head = chunks[0]["choices"][0]["delta"]["tool_calls"][0]
    assert head["function"]["name"] == "hang_up" and head["id"].startswith("call_")
    arguments = "".join(
        c["choices"][0]["delta"].get("tool_calls", [{}])[0].get("function", {}).get("arguments", "")
        for c in chunks[1:-1]
    )
    assert json.loads(arguments) == {"reason": "done"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert third["choices"][0]["message"]["content"].startswith("You said: hi.")
    assert len(standins.state.stats.llm_first_token_service_ms) == 1  # the streamed one
    standins.state.config.default_reply = "Fixed."
    async with httpx.AsyncClient() as client:
        fixed = (await client.post(url, json=body)).json()
    assert fixed["choices"][0]["message"]["content"] == "Fixed."


def test_the_default_reply_calls_a_named_tool_and_reads_back_its_output() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    asked = default_reply([{"role": "user", "content": "How is the weather?"}], tools)
    assert asked.tool_call == ScriptedToolCall("get_weather", {"request": "How is the weather?"})
    answered = default_reply([{"role": "tool", "content": "sunny", "tool_call_id": "c"}], tools)
    assert answered.text.startswith("The tool answered: sunny")
    assert default_reply([{"role": "user", "content": "Hi"}], tools).tool_call is None


async def test_modes_switch_at_runtime_and_the_wait_route_reports_disconnects(standins: StandinServer) -> None:
    admin = f"http://127.0.0.1:{standins.port}/_standin"
    chat = standins.base_url + "/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with httpx.AsyncClient() as client:
        assert (await client.post(admin + "/mode", json={"llm": "error"})).json() == {"llm": "error", "asr": "ok"}
        failed = await client.post(chat, json=body)
        assert failed.status_code == 500 and failed.json()["error"]["message"].startswith("the llm stand-in")
        await client.post(admin + "/mode", json={"llm": "hang"})
        with pytest.raises(httpx.ReadTimeout):
            await client.post(chat, json=body, timeout=httpx.Timeout(5.0, read=0.2))
        waited = await client.post(admin + "/wait", json={"llm_disconnects": 1, "timeout_s": 10})
        assert waited.status_code == 200 and waited.json()["llm_disconnects"] == 1
        await client.post(admin + "/mode", json={"llm": "ok"})
        assert sse_payloads((await client.post(chat, json=body)).text)[-1] == "[DONE]"
        timed_out = await client.post(admin + "/wait", json={"llm_disconnects": 2, "timeout_s": 0.05})
        assert timed_out.status_code == 408
        stats = (await client.get(admin + "/stats")).json()
        assert (stats["llm_requests"], stats["llm_completed"], stats["llm_disconnects"]) == (3, 2, 1)
        bad = await client.post(admin + "/mode", json={"llm": "sometimes"})
        assert bad.status_code >= 400


async def test_the_config_route_changes_delays_and_scripts(standins: StandinServer) -> None:
    admin = f"http://127.0.0.1:{standins.port}/_standin/config"
    async with httpx.AsyncClient() as client:
        changed = (await client.post(admin, json={"asr_delay_ms": 5, "transcripts": ["a", "b"]})).json()
        assert changed["asr_delay_ms"] == 5 and changed["transcripts"] == ["a", "b"]
        files = {"file": ("a.wav", wav_bytes(bytes(3200), 16_000), "audio/wav")}
        url = standins.base_url + "/audio/transcriptions"
        texts = [(await client.post(url, data={"model": "whisper-1"}, files=files)).json() for _ in range(3)]
    assert [t["text"] for t in texts] == ["a", "b", StandinConfig().default_transcript]
    assert texts[0]["usage"] == {"type": "duration", "seconds": 0.1}
    assert standins.state.stats.asr_audio_s == [0.1, 0.1, 0.1]
    assert len(standins.state.stats.asr_service_ms) == 3 and min(standins.state.stats.asr_service_ms) >= 5.0


async def test_an_upload_that_is_not_a_wav_is_refused(standins: StandinServer) -> None:
    async with httpx.AsyncClient() as client:
        url = standins.base_url + "/audio/transcriptions"
        refused = await client.post(url, files={"file": ("a.wav", b"not audio", "audio/wav")})
    assert refused.status_code == 400


async def test_the_command_serves_the_standins_from_a_subprocess(tmp_path: Path) -> None:
    async with standins_process(["--reply", "Scripted.", "--asr-delay-ms", "0"], tmp_path / "standins.log") as base:
        assert base.startswith("http://127.0.0.1:") and base.endswith("/v1")
        async with httpx.AsyncClient() as client:
            body = {"messages": [{"role": "user", "content": "x"}]}
            reply = await client.post(base + "/chat/completions", json=body)
    assert reply.json()["choices"][0]["message"]["content"] == "Scripted."
