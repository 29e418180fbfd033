"""The engine core's socket server and the gateway's transport against each other over a real Unix socket, in one
process: a stream call from open to its terminal, a cancel that frees the slot, and a core that goes away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from omnigate.engines.admission import AdmissionSettings
from omnigate.engines.base import AudioChunk, StreamDone, SynthesisParams
from omnigate.engines.core.__main__ import core_for
from omnigate.engines.core.client import CoreTransport
from omnigate.engines.core.server import serve_core
from omnigate.engines.remote.protocol import (
    ControlBatch,
    Opened,
    OpenStream,
    Outputs,
    decode_report,
    decode_stats,
    decode_stream_message,
    encode,
)
from omnigate.engines.remote.replica import ReplicaCore
from omnigate.engines.remote.transport import ReplicaUnavailable
from omnigate.engines.synthetic import SyntheticEngine
from omnigate.gateway.cli.serve import build_parser, settings_from_args


@contextlib.asynccontextmanager
async def running_core(path: str) -> AsyncIterator[tuple[ReplicaCore, asyncio.Event]]:
    # Slots admission: the test reads free slots, which headroom admission would cap by its cost estimate.
    core = ReplicaCore(
        SyntheticEngine.from_spec("rtf=0.01"), "core-under-test", admission=AdmissionSettings(policy="slots")
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    server = asyncio.create_task(serve_core(core, path, stop, ready))
    try:
        async with asyncio.timeout(10):
            await ready.wait()
        yield core, stop
    finally:
        stop.set()
        await server
        await asyncio.to_thread(core.shutdown)


def _open(stream_id: str, credit_ms: float, text: str = "Hello there.") -> bytes:
    voice = SyntheticEngine.from_spec(None).info.default_voice
    return encode(OpenStream(stream_id, "gw", SynthesisParams(voice=voice), credit_ms, [text], input_done=True))


async def test_a_stream_call_runs_to_its_terminal(tmp_path: Path) -> None:
    path = str(tmp_path / "core.sock")
    async with running_core(path) as _:
        transport = CoreTransport(path)
        messages = [decode_stream_message(m) async for m in transport.open_stream(_open("s1", 60_000.0))]
        assert isinstance(messages[0], Opened) and messages[0].replica == "core-under-test"
        items = [item for m in messages[1:] if isinstance(m, Outputs) for item in m.items]
        assert any(isinstance(item, AudioChunk) and item.pcm for item in items)
        assert [type(i) for i in items].count(StreamDone) == 1 and items[-1] == StreamDone(reason="completed")
        stats = decode_stats(await transport.stats("gw"))
        assert stats.report.active == 0 and stats.report.free_slots == stats.info.max_sessions
        await transport.close()


async def test_giving_up_a_call_frees_its_slot_in_the_core(tmp_path: Path) -> None:
    path = str(tmp_path / "core.sock")
    async with running_core(path) as (core, _):
        transport = CoreTransport(path)
        # No credit: the stream is admitted and then waits, holding its slot.
        call = transport.open_stream(_open("s1", 0.0))
        assert isinstance(decode_stream_message(await anext(call)), Opened)
        assert core.pool.active == 1
        await call.aclose()  # sends CANCEL
        # The core answers in order on the connection: once this reply is here, the cancel was applied.
        report = decode_report(await transport.control(encode(ControlBatch("gw", []))))
        assert report.active == 0 and core.pool.active == 0
        await transport.close()


async def test_a_core_that_goes_away_fails_open_calls_as_unavailable(tmp_path: Path) -> None:
    path = str(tmp_path / "core.sock")
    transport = CoreTransport(path)
    async with running_core(path) as (_, stop):
        call = transport.open_stream(_open("s1", 0.0))
        assert isinstance(decode_stream_message(await anext(call)), Opened)
        stop.set()
        with pytest.raises(ReplicaUnavailable):
            await anext(call)
    with pytest.raises(ReplicaUnavailable, match="not reachable"):
        await transport.stats("gw")
    await transport.close()


@pytest.mark.parametrize("policy", ["slots", "headroom"])
def test_the_core_admits_by_the_policy_serve_was_given(policy: str) -> None:
    settings = settings_from_args(build_parser().parse_args(["serve", "--engine", "synthetic", "--admission", policy]))
    core = core_for(SyntheticEngine.from_spec("rtf=0.01"), settings)
    try:
        assert core.pool.admission.settings.policy == policy
    finally:
        core.shutdown()
