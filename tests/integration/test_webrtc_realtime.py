"""The OpenAI Realtime protocol on a call's ``oai-events`` data channel, audio on the media tracks (loopback)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from aiortc.mediastreams import AudioStreamTrack

from omnigate.gateway.security.credentials import api_key_hash
from omnigate.gateway.settings import ResponderSettings, Settings
from omnigate.gateway.webrtc.call import REALTIME_CHANNEL, SPEECH_CHANNEL
from omnigate.loadtest.openai_standins import StandinServer
from tests.audio_checks import synthetic_ms
from tests.integration.test_webrtc import LOOPBACK, Listener, call, live_calls, on_server
from tests.serving import RunningServer, serve

pytestmark = pytest.mark.integration

REPLY = "Good evening. Your table for two is booked at eight."
LONG_REPLY = "This sentence keeps a real-time response busy for a while. " * 4


@pytest.fixture(scope="module")
def rtc_realtime_server() -> Iterator[RunningServer]:
    with serve(Settings(engine="synthetic", webrtc_host_addresses=LOOPBACK)) as server:
        yield server


def assistant_item(text: str, item_id: str | None = None) -> dict[str, object]:
    item: dict[str, object] = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text}],
    }
    if item_id is not None:
        item["id"] = item_id
    return item


async def assert_freed(server: RunningServer) -> None:
    await on_server(server, server.app.state.webrtc.join())
    gateway = server.gateway
    assert gateway.registry.active.get("webrtc", 0) == 0
    # Its admission slot is free at once; the stream object itself closes when an engine step it is in ends.
    assert gateway.pool is not None and gateway.pool.admission.active == 0


async def test_a_response_is_heard_on_the_track_and_the_microphone_is_the_input_buffer(
    rtc_realtime_server: RunningServer,
) -> None:
    listener = Listener()
    microphone = AudioStreamTrack()  # aiortc's paced silence: a stand-in microphone
    async with call(rtc_realtime_server, listener, microphone, REALTIME_CHANNEL) as peer:
        await listener.until(lambda: bool(listener.of("session.created")))
        peer.send_json(
            {
                "type": "session.update",
                "session": {
                    "type": "realtime",
                    "output_modalities": ["audio"],
                    "audio": {"input": {"turn_detection": None}},
                },
            }
        )
        await listener.until(lambda: bool(listener.of("session.updated")))
        peer.send_json({"type": "conversation.item.create", "item": assistant_item(REPLY, "reply_1")})
        peer.send_json({"type": "response.create", "event_id": "gen_1"})
        await listener.until(lambda: bool(listener.of("output_audio_buffer.stopped")))
        # The microphone has been sending all along: its audio is the input buffer, committed on request.
        peer.send_json({"type": "input_audio_buffer.commit"})
        await listener.until(lambda: bool(listener.of("input_audio_buffer.committed") or listener.of("error")))
    assert not listener.of("error"), listener.of("error")
    assert listener.events[0]["type"] == "session.created"
    [done] = listener.of("response.done")
    response_id = done["response"]["id"]
    assert done["response"]["status"] == "completed"
    kinds = [e["type"] for e in listener.events]
    assert "response.output_audio.delta" not in kinds  # the audio travels on the track
    assert kinds.index("output_audio_buffer.started") < kinds.index("output_audio_buffer.stopped")
    assert listener.of("output_audio_buffer.started")[0]["response_id"] == response_id
    assert listener.of("output_audio_buffer.stopped")[0]["response_id"] == response_id
    transcript = listener.of("response.output_audio_transcript.done")[0]["transcript"]
    assert transcript == REPLY
    heard_ms = listener.audible_frames * 20
    # Whole 20 ms frames; a frame that decodes to exact zeros (at the tone's segment edges) counts as silence.
    assert synthetic_ms(REPLY) - 100 <= heard_ms <= synthetic_ms(REPLY) + 100
    samples = np.frombuffer(bytes(listener.audio), dtype="<i2").astype(np.float64)
    assert np.sqrt(np.mean(samples**2)) > 500  # a tone, not near-silence
    committed = listener.of("input_audio_buffer.committed")
    assert committed and committed[0]["item_id"]
    await assert_freed(rtc_realtime_server)


async def test_cancel_ends_the_response_and_silences_the_track(rtc_realtime_server: RunningServer) -> None:
    listener = Listener()
    async with call(rtc_realtime_server, listener, channel_label=REALTIME_CHANNEL) as peer:
        await listener.until(lambda: bool(listener.of("session.created")))
        peer.send_json({"type": "response.create", "response": {"input": [assistant_item(LONG_REPLY)]}})
        # Half a second has played; the engine runs ahead of real time, so the outbox and the track are full.
        await listener.until(lambda: listener.audible_frames >= 25)
        audible_at_cancel = listener.audible_frames
        peer.send_json({"type": "response.cancel"})
        await listener.until(lambda: bool(listener.of("response.done")) and listener.silent_run >= 50)
        [done] = listener.of("response.done")
        assert done["response"]["status"] == "cancelled"
        # What was on the wire and in the track's short lead when the cancel landed, not the outbox behind it.
        assert listener.audible_frames - audible_at_cancel <= 15
        assert listener.audible_frames * 20 < synthetic_ms(LONG_REPLY) / 2
        stopped = listener.of("output_audio_buffer.stopped")
        assert [e["response_id"] for e in stopped] == [done["response"]["id"]]
        # The session goes on: a second response is heard in full.
        before = listener.audible_frames
        peer.send_json({"type": "response.create", "response": {"input": [assistant_item("Still here.")]}})
        await listener.until(lambda: len(listener.of("output_audio_buffer.stopped")) == 2)
    assert listener.of("response.done")[1]["response"]["status"] == "completed"
    assert (listener.audible_frames - before) * 20 >= synthetic_ms("Still here.") - 100
    assert not listener.of("error")
    await assert_freed(rtc_realtime_server)


async def test_a_speech_channel_beside_realtime_is_refused_typed(rtc_realtime_server: RunningServer) -> None:
    listener = Listener()
    async with call(rtc_realtime_server, listener, channel_label=REALTIME_CHANNEL) as peer:
        await listener.until(lambda: bool(listener.of("session.created")))
        speech = peer.pc.createDataChannel("speech")
        answers: asyncio.Queue[str] = asyncio.Queue(maxsize=4)
        speech.on("message", lambda message: answers.put_nowait(message))
        error = json.loads(await asyncio.wait_for(answers.get(), 10))
        [live] = live_calls(rtc_realtime_server)
        assert live.realtime is not None
        # The realtime session is untouched.
        peer.send_json({"type": "session.update", "event_id": "up_1", "session": {"type": "realtime"}})
        await listener.until(lambda: bool(listener.of("session.updated")))
    assert error["type"] == "error" and error["code"] == "channel_in_use"
    assert not listener.of("error")
    await assert_freed(rtc_realtime_server)


KEY = "webrtc-test-key"


async def mint_secret(server: RunningServer, session: dict[str, object]) -> dict[str, str]:
    """The Authorization header of a client secret minted with ``session``."""
    async with httpx.AsyncClient(base_url=server.http_url, headers={"authorization": f"Bearer {KEY}"}) as client:
        minted = await client.post("/v1/realtime/client_secrets", json={"session": session})
    assert minted.status_code == 200, minted.text
    return {"authorization": f"Bearer {minted.json()['value']}"}


def keyed_rtc_settings() -> Settings:
    return Settings(engine="synthetic", webrtc_host_addresses=LOOPBACK, api_key_hashes=(api_key_hash(KEY),))


async def test_the_session_minted_with_the_calls_client_secret_configures_it() -> None:
    with serve(keyed_rtc_settings()) as server:
        secret = await mint_secret(server, {"type": "realtime", "audio": {"output": {"voice": "noise", "speed": 1.5}}})
        listener = Listener()
        async with call(server, listener, None, REALTIME_CHANNEL, headers=secret):
            await listener.until(lambda: bool(listener.of("session.updated") or listener.of("error")))
        assert not listener.of("error"), listener.of("error")
        [updated] = listener.of("session.updated")
        assert updated["session"]["audio"]["output"] == {**updated["session"]["audio"]["output"], "voice": "noise",
                                                         "speed": 1.5}  # fmt: skip
        await assert_freed(server)


async def test_a_minted_speech_session_configures_the_calls_speech_channel() -> None:
    with serve(keyed_rtc_settings()) as server:
        secret = await mint_secret(server, {"type": "speech", "voice": "noise"})
        listener = Listener()
        async with call(server, listener, None, SPEECH_CHANNEL, headers=secret) as peer:
            # No session.config from the page: the minted one applies.
            peer.send_json({"type": "input.text", "text": "Configured by the app server."})
            peer.send_json({"type": "input.done"})
            await listener.until(lambda: bool(listener.of("session.done") or listener.of("error")))
        assert not listener.of("error"), listener.of("error")
        assert listener.of("session.done")[0]["status"] == "completed"
        await assert_freed(server)


async def test_with_an_llm_a_text_turn_is_answered_on_the_track() -> None:
    async with StandinServer() as standins:
        settings = Settings(
            engine="synthetic",
            webrtc_host_addresses=LOOPBACK,
            responder=ResponderSettings(llm_url=standins.base_url),
        )
        with serve(settings) as server:
            listener = Listener()
            async with call(server, listener, channel_label=REALTIME_CHANNEL) as peer:
                await listener.until(lambda: bool(listener.of("session.created")))
                item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi there"}]}
                peer.send_json({"type": "conversation.item.create", "item": item})
                peer.send_json({"type": "response.create"})
                await listener.until(lambda: bool(listener.of("output_audio_buffer.stopped")))
            await assert_freed(server)
    assert not listener.of("error"), listener.of("error")
    [done] = listener.of("response.done")
    assert done["response"]["status"] == "completed"
    transcript = done["response"]["output"][0]["content"][0]["transcript"]
    assert transcript.startswith("You said: Hi there")
    assert listener.audible_frames * 20 >= synthetic_ms(transcript) / 2  # the reply is heard on the track
    assert "omnigate_first_audio_ms" in done["response"]["metadata"]
    assert standins.state.stats.llm_completed == 1
