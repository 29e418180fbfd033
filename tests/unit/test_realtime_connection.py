"""The realtime protocol core on a real engine pool (the synthetic test engine), with no transport in between."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from omnigate.engines.pool import EnginePool
from omnigate.engines.synthetic import SyntheticEngine
from omnigate.gateway.realtime.connection import RealtimeConnection
from omnigate.gateway.realtime.tts_backend import TtsBackend
from omnigate.sessions.realtime.outbox import Closing, OutgoingAudio, OutgoingEvent
from omnigate.sessions.realtime.session import RealtimeLimits
from omnigate.sessions.segmenter import SegmenterConfig
from omnigate.sessions.speech import SessionLimits
from tests.audio_checks import synthetic_ms
from tests.unit.test_realtime_protocol import validate_server_event

LONG_TEXT = "This sentence is long enough to keep a response busy. " * 6  # about 16 s of synthetic audio
CHUNK_MS = 40.0  # the synthetic engine's chunk


@pytest.fixture
async def pool() -> AsyncIterator[EnginePool]:
    engine_pool = EnginePool(SyntheticEngine.from_spec("sample_rate=24000"))
    engine_pool.start()
    yield engine_pool
    await asyncio.to_thread(engine_pool.stop)


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1) as pool:
        yield pool


class Client:
    """Drives one connection core the way a transport does, validating every server event it reads."""

    def __init__(self, connection: RealtimeConnection) -> None:
        self.connection = connection
        self.seen: list[dict[str, Any]] = []
        self.closing: Closing | None = None

    def send(self, kind: str, **fields: Any) -> None:
        self.connection.receive_text(json.dumps({"type": kind, **fields}))

    async def next(self) -> dict[str, Any]:
        async with asyncio.timeout(20):
            output = await self.connection.next_output()
        if isinstance(output, Closing):
            self.closing = output
            return {"type": "<closed>"}
        assert isinstance(output, OutgoingEvent)
        event: dict[str, Any] = json.loads(output.payload)
        validate_server_event(event)
        self.seen.append(event)
        return event

    async def until(self, kind: str) -> list[dict[str, Any]]:
        """Events up to and including the next one of ``kind``."""
        events = []
        while True:
            event = await self.next()
            events.append(event)
            if event["type"] in (kind, "<closed>"):
                return events


_OPEN: list[RealtimeConnection] = []


@pytest.fixture(autouse=True)
def release_connections() -> Iterator[None]:
    """Every connection a test opened is released when it ends, as a transport adapter's scope would."""
    yield
    while _OPEN:
        _OPEN.pop().release()


def connect(pool: EnginePool, executor: ThreadPoolExecutor, **limits: Any) -> Client:
    backend = TtsBackend(
        pool,
        SessionLimits(outbox_media_ms=limits.get("outbox_media_ms", 2000.0)),
        max_audio_ms=120_000,
        segmenter=SegmenterConfig(),
    )
    connection = RealtimeConnection(
        backend,
        limits=RealtimeLimits(**limits),
        model="synthetic",
        served_models=frozenset({"synthetic"}),
        resolve_voice=lambda name: name,
        vad_executor=executor,
    )
    connection.open()
    _OPEN.append(connection)
    return Client(connection)


def watch_for_full_outbox(connection: RealtimeConnection) -> asyncio.Event:
    """An event set when the producer finds the outbox full and has to wait for the client."""
    full = asyncio.Event()
    wait = connection.wait_for_room

    async def watched() -> None:
        if not connection.outbox.has_media_room:
            full.set()
        await wait()

    connection.wait_for_room = watched  # type: ignore[method-assign]
    return full


def audio_ms(events: list[dict[str, Any]], response_id: str | None = None) -> float:
    deltas = [e for e in events if e["type"] == "response.output_audio.delta"]
    return sum(len(base64.b64decode(e["delta"])) / 48.0 for e in deltas if response_id in (None, e["response_id"]))


async def test_a_response_speaks_assistant_items_in_protocol_order(
    pool: EnginePool, executor: ThreadPoolExecutor
) -> None:
    client = connect(pool, executor)
    created = await client.next()
    assert created["type"] == "session.created"
    assert created["session"]["capabilities"]["speaks_text_items"] is True
    client.send("session.update", session={"type": "realtime", "audio": {"output": {"voice": "tone"}}})
    assert (await client.next())["type"] == "session.updated"
    client.send(
        "conversation.item.create",
        item={
            "type": "message",
            "role": "assistant",
            "id": "agent_1",
            "content": [{"type": "output_text", "text": "Hi there. Bye now."}],
        },
    )
    added = await client.until("conversation.item.done")
    assert added[0]["type"] == "conversation.item.added" and added[0]["item"]["id"] == "agent_1"
    client.send("response.create", event_id="c1", response={"metadata": {"client_event_id": "c1"}})
    events = await client.until("response.done")
    kinds = [e["type"] for e in events]
    first_delta = kinds.index("response.output_audio.delta")
    assert kinds[:4] == [
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
    ]
    assert first_delta > 3 and kinds.index("response.output_audio_transcript.delta") < first_delta
    assert kinds[-6:] == [
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    assert events[0]["response"]["metadata"] == {"client_event_id": "c1"}
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["usage"]["output_token_details"]["audio_tokens"] > 0
    transcript = events[-5]["transcript"]
    assert transcript == "Hi there. Bye now."
    assert audio_ms(events) == pytest.approx(synthetic_ms("Hi there. Bye now."), abs=1.0)
    ids = [e["event_id"] for e in client.seen]
    assert len(ids) == len(set(ids))
    assert {e["response_id"] for e in events if "response_id" in e} == {done["id"]}


async def test_nothing_to_speak_and_one_active_response(pool: EnginePool, executor: ThreadPoolExecutor) -> None:
    client = connect(pool, executor)
    await client.next()
    client.send("response.create", event_id="c7")
    error = await client.next()
    assert error["error"]["code"] == "nothing_to_speak" and error["error"]["event_id"] == "c7"
    client.send(
        "response.create",
        response={
            "input": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": LONG_TEXT}]}]
        },
    )
    await client.until("response.created")
    client.send(
        "response.create",
        event_id="c8",
        response={
            "input": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Again."}]}]
        },
    )
    while (event := await client.next())["type"] != "error":
        assert event["type"] != "response.created"
    assert event["error"]["code"] == "conversation_already_has_active_response"
    assert event["error"]["event_id"] == "c8"


async def test_cancel_purges_queued_audio_and_ends_the_response_once(
    pool: EnginePool, executor: ThreadPoolExecutor
) -> None:
    client = connect(pool, executor)
    await client.next()
    client.send(
        "conversation.item.create",
        item={"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": LONG_TEXT}]},
    )
    connection = client.connection
    full = watch_for_full_outbox(connection)
    client.send("response.create")
    # The client reads nothing: generation stops when the outbox holds its bound of audio.
    async with asyncio.timeout(20):
        await full.wait()
    assert 2000.0 <= connection.outbox.media_ms <= 2000.0 + CHUNK_MS
    client.send("response.cancel", event_id="c2")
    events = await client.until("response.done")
    response_id = events[-1]["response"]["id"]
    assert events[-1]["response"]["status"] == "cancelled"
    assert events[-1]["response"]["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    assert audio_ms(events, response_id) == 0.0  # every queued delta was purged before the terminal event
    assert pool.aborted_total == 1  # the engine stream was aborted
    client.send(
        "conversation.item.create",
        item={"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Next."}]},
    )
    client.send("response.create")
    later = await client.until("response.done")
    assert all(e.get("response_id") != response_id for e in later)
    assert later[-1]["response"]["status"] == "completed" and audio_ms(later) > 0
    client.send("response.cancel", event_id="c3")
    error = await client.next()
    assert error["error"]["code"] == "response_cancel_not_active" and error["error"]["event_id"] == "c3"


async def test_truncate_is_validated_against_the_audio_actually_sent(
    pool: EnginePool, executor: ThreadPoolExecutor
) -> None:
    client = connect(pool, executor)
    await client.next()
    client.send(
        "conversation.item.create",
        item={"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": LONG_TEXT}]},
    )
    client.send("response.create")
    events = await client.until("response.output_item.added")
    item_id = events[-1]["item"]["id"]
    while audio_ms(client.seen) < 500.0:
        await client.next()
    sent = audio_ms(client.seen)
    client.send(
        "conversation.item.truncate", event_id="t1", item_id=item_id, content_index=0, audio_end_ms=int(sent) + 200
    )
    while (event := await client.next())["type"] != "error":
        pass
    assert event["error"]["code"] == "audio_end_ms_beyond_sent" and event["error"]["event_id"] == "t1"
    sent = audio_ms(client.seen)  # what the client has taken by now (it kept reading)
    client.send("conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=int(sent) + 20)
    while (event := await client.next())["type"] != "conversation.item.truncated":
        pass
    assert event["audio_end_ms"] == int(sent)  # a rounding overshoot is clamped to what was sent
    client.send("conversation.item.truncate", item_id="nope", content_index=0, audio_end_ms=0)
    while (event := await client.next())["type"] != "error":
        pass
    assert event["error"]["code"] == "item_not_found"


async def test_input_beyond_the_cap_is_refused_not_buffered(pool: EnginePool, executor: ThreadPoolExecutor) -> None:
    client = connect(pool, executor, input_max_bytes=48_000)
    await client.next()
    client.send("session.update", session={"audio": {"input": {"turn_detection": None}}})
    assert (await client.next())["session"]["audio"]["input"]["turn_detection"] is None
    half_second = base64.b64encode(bytes(24_000)).decode()
    client.send("input_audio_buffer.commit", event_id="k0")
    assert (await client.next())["error"]["code"] == "input_audio_buffer_commit_empty"
    client.send("input_audio_buffer.append", audio=half_second)
    client.send("input_audio_buffer.append", audio=half_second)
    active_at = client.connection.core.last_activity
    client.send("input_audio_buffer.append", event_id="a3", audio=half_second)
    error = await client.next()
    assert error["error"]["code"] == "input_backpressure" and error["error"]["event_id"] == "a3"
    assert client.connection.core.last_activity == active_at  # a refused append does not keep an idle session open
    client.send("input_audio_buffer.commit")
    committed = await client.until("conversation.item.done")
    assert committed[0]["type"] == "input_audio_buffer.committed"
    assert committed[1]["item"]["role"] == "user" and committed[1]["item"]["content"] == [{"type": "input_audio"}]
    client.send("input_audio_buffer.append", audio=half_second)
    client.send("input_audio_buffer.clear")
    assert (await client.next())["type"] == "input_audio_buffer.cleared"  # the append above was accepted silently


async def test_refused_session_update_keeps_the_previous_config(pool: EnginePool, executor: ThreadPoolExecutor) -> None:
    client = connect(pool, executor)
    before = (await client.next())["session"]
    client.send(
        "session.update",
        event_id="u1",
        session={
            "tools": [{"type": "function", "name": "f"}],
            "audio": {"output": {"format": {"type": "audio/pcmu"}}},
            "output_modalities": ["text"],
        },
    )
    error = await client.next()
    assert error["error"]["code"] == "unsupported" and error["error"]["event_id"] == "u1"
    assert error["error"]["param"] == "session.output_modalities"
    client.send("session.update", session={})
    after = (await client.next())["session"]
    assert after == before


async def test_g711_output_and_bad_messages(pool: EnginePool, executor: ThreadPoolExecutor) -> None:
    client = connect(pool, executor)
    await client.next()
    client.send("session.update", session={"audio": {"output": {"format": {"type": "audio/pcmu"}}}})
    assert (await client.next())["session"]["audio"]["output"]["format"] == {"type": "audio/pcmu"}
    client.send(
        "response.create",
        response={
            "input": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]}]
        },
    )
    events = await client.until("response.done")
    ulaw_bytes = sum(len(base64.b64decode(e["delta"])) for e in events if e["type"] == "response.output_audio.delta")
    assert ulaw_bytes == pytest.approx(8 * synthetic_ms("Hello."), abs=16)  # 8 kHz, one byte per sample
    client.connection.receive_text("{not json")
    assert (await client.next())["error"]["code"] == "invalid_json"
    client.send("response.audio.delta", event_id="b1")
    error = await client.next()
    assert error["error"]["code"] == "unknown_event" and error["error"]["event_id"] == "b1"
    client.send("input_audio_buffer.append", audio="***")
    assert (await client.next())["error"]["code"] == "invalid_audio"
    client.send("conversation.item.create", item={"type": "function_call", "name": "f"})
    assert (await client.next())["error"]["code"] == "unsupported"


async def test_a_client_that_never_reads_is_closed_typed(pool: EnginePool, executor: ThreadPoolExecutor) -> None:
    client = connect(pool, executor, outbox_events=64)
    for _ in range(200):
        client.send("response.cancel")  # each answered by an error the client never reads
    assert client.connection.closed
    events = []
    while client.closing is None:
        events.append(await client.next())
    assert events[-2]["error"]["code"] == "backlog" and client.closing.close_code == 1008
    assert len(events) <= 64 + 1


async def test_track_route_hands_pcm_to_the_transport_and_clear_stops_it(
    pool: EnginePool, executor: ThreadPoolExecutor
) -> None:
    backend = TtsBackend(pool, SessionLimits(), max_audio_ms=120_000, segmenter=SegmenterConfig())
    connection = RealtimeConnection(
        backend,
        limits=RealtimeLimits(outbox_media_ms=500.0),  # a media track consumes in real time: a short outbox
        model="synthetic",
        served_models=frozenset({"synthetic"}),
        resolve_voice=lambda name: name,
        vad_executor=executor,
        audio_route="track",
    )
    connection.open()
    full = watch_for_full_outbox(connection)
    text = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": LONG_TEXT}]}]
    connection.receive_text(json.dumps({"type": "response.create", "response": {"input": text}}))
    track_ms = 0.0
    kinds: list[str] = []
    while track_ms < 300.0:
        output = await connection.next_output()
        if isinstance(output, OutgoingAudio):
            assert output.sample_rate == 24000 and len(output.pcm) % 2 == 0
            track_ms += output.audio_ms
        else:
            assert isinstance(output, OutgoingEvent)
            kinds.append(json.loads(output.payload)["type"])
    assert "response.output_audio.delta" not in kinds and "response.content_part.added" in kinds
    async with asyncio.timeout(20):
        await full.wait()
    connection.receive_text(json.dumps({"type": "output_audio_buffer.clear"}))
    after: list[dict[str, Any]] = []
    while not after or after[-1]["type"] != "output_audio_buffer.cleared":
        output = await connection.next_output()
        assert not isinstance(output, OutgoingAudio)  # nothing queued for the track survives the clear
        assert isinstance(output, OutgoingEvent)
        after.append(json.loads(output.payload))
    done = next(e for e in after if e["type"] == "response.done")
    assert done["response"]["status_details"]["reason"] == "client_cancelled"
    assert after[-1]["response_id"] == done["response"]["id"]
    connection.release()
