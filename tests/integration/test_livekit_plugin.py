"""``omnigate.integrations.livekit.TTS`` in LiveKit Agents (unchanged framework code) against a real ``omnigate serve``.

The synthesis stream is driven the way ``Agent.tts_node`` drives it (``async with tts.stream()``, ``push_text`` per LLM
token, ``end_input()``, frames read as they come; closing the stream is how the framework interrupts a reply), with an
LLM stand-in streaming 50 tokens/s. Every reply is checked as speech with the Silero VAD.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

from tests.audio_checks import speech_fraction
from tests.integration.agent_pipelines import REPLIES, ServerProcess, omnigate_serve, paced

agents = pytest.importorskip("livekit.agents")
from livekit.agents import APIConnectionError, APIConnectOptions, APIStatusError  # noqa: E402

from omnigate.integrations.livekit import TTS  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NO_RETRY = APIConnectOptions(max_retry=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with omnigate_serve(tmp_path_factory.mktemp("livekit")) as running:
        yield running


async def speak(tts: TTS, text: str) -> tuple[bytes, list[str], bool]:
    """One reply through ``tts.stream()``: its PCM, the segment id of every frame, and whether the last was final."""
    pcm: list[bytes] = []
    segments: list[str] = []
    final = False
    async with tts.stream(conn_options=NO_RETRY) as stream:

        async def forward() -> None:
            async for _, token in paced(text):
                stream.push_text(token)
            stream.end_input()

        forwarding = asyncio.create_task(forward())
        try:
            async for event in stream:
                assert event.frame.sample_rate == 24000 and event.frame.num_channels == 1
                pcm.append(event.frame.data.tobytes())
                segments.append(event.segment_id)
                final = event.is_final
        finally:
            await forwarding
    return b"".join(pcm), segments, final


async def test_a_reply_streamed_token_by_token_is_speech(server: ServerProcess) -> None:
    async with TTS(base_url=server.base_url, voice="alloy") as tts:
        pcm, segments, final = await speak(tts, REPLIES[0])
        again, _, _ = await speak(tts, REPLIES[1])
    assert speech_fraction(pcm, 24000) > 0.6 and speech_fraction(again, 24000) > 0.6
    assert len(set(segments)) == 1 and final  # one reply, one segment, ended by a final frame
    assert len(pcm) / 48000 > 4.0  # three sentences, all spoken


async def test_synthesize_uses_the_same_socket_path(server: ServerProcess) -> None:
    async with TTS(base_url=server.base_url + "/v1", voice="alloy") as tts:
        async with tts.synthesize("Just one sentence.", conn_options=NO_RETRY) as chunked:
            frame = await chunked.collect()
        async with tts.stream(conn_options=NO_RETRY) as stream:
            stream.push_text("And a second one.")
            stream.end_input()
            assert [event async for event in stream]
        assert stream._connection_reused  # the socket synthesize() used went back to the pool
    assert speech_fraction(frame.data.tobytes(), 24000) > 0.5


async def test_an_interrupted_reply_stops_and_the_next_plays_normally(server: ServerProcess) -> None:
    async with TTS(base_url=server.base_url, voice="alloy") as tts:
        reference, _, _ = await speak(tts, REPLIES[2])
        stream = tts.stream(conn_options=NO_RETRY)

        async def forward() -> None:
            async for _, token in paced(REPLIES[1]):
                stream.push_text(token)
            stream.end_input()

        forwarding = asyncio.create_task(forward())
        heard = 0
        async for _ in stream:
            heard += 1
            if heard == 3:
                break
        forwarding.cancel()
        await stream.aclose()  # what the framework does on a barge-in
        assert [event async for event in stream] == []  # nothing of the interrupted reply comes after
        after, segments, final = await speak(tts, REPLIES[2])
    assert speech_fraction(after, 24000) > 0.6 and final and len(set(segments)) == 1
    # The same reply at the same length: no audio of the cancelled one leaked in front of it.
    assert len(after) == pytest.approx(len(reference), rel=0.1)


async def test_a_voice_the_server_does_not_have_is_a_non_retryable_api_status_error(server: ServerProcess) -> None:
    async with TTS(base_url=server.base_url, voice="nobody") as tts:
        with pytest.raises(APIStatusError) as refused:
            await speak(tts, "Hello there.")
    assert refused.value.status_code == 400 and not refused.value.retryable
    assert isinstance(refused.value.body, dict) and refused.value.body["code"] == "unknown_voice"


async def test_no_free_slot_is_a_retryable_api_status_error(tmp_path: Path) -> None:
    with omnigate_serve(tmp_path, "--max-sessions", "1") as busy:
        async with connect(busy.base_url.replace("http", "ws") + "/v1/audio/speech/stream"):  # holds the one slot
            async with TTS(base_url=busy.base_url, voice="alloy") as tts:
                with pytest.raises(APIStatusError) as refused:
                    await speak(tts, "Hello there.")
    assert refused.value.status_code == 503 and refused.value.retryable
    assert isinstance(refused.value.body, dict) and refused.value.body["code"] == "server_busy"


async def test_an_unreachable_server_is_an_api_connection_error(tmp_path: Path) -> None:
    async with TTS(base_url="http://127.0.0.1:9", voice="alloy") as tts:
        with pytest.raises(APIConnectionError):
            await speak(tts, "Hello there.")


async def test_the_api_key_goes_as_a_bearer_token(tmp_path: Path) -> None:
    with omnigate_serve(tmp_path, "--api-key", "sk-agent") as keyed:
        async with TTS(base_url=keyed.base_url, api_key="sk-agent", voice="alloy") as tts:
            pcm, _, _ = await speak(tts, "Hello there.")
        async with TTS(base_url=keyed.base_url, api_key="sk-wrong", voice="alloy") as tts:
            with pytest.raises(APIStatusError) as refused:
                await speak(tts, "Hello there.")
    assert speech_fraction(pcm, 24000) > 0.5
    assert refused.value.status_code == 401 and not refused.value.retryable
