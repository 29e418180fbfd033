"""Server VAD under speech that never pauses for long: 45 s of the piper voice, then silence.

A session buffers at most ``realtime_input_max_bytes`` of a turn (about 21.8 s at 24 kHz). The detector must hear
all of the audio: a turn that outgrows the buffer is committed at its maximum length with a typed error, the speech
goes on as the next turn, and the silence at the end ends the last turn. No append is refused on the way.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest

from omnigate.codecs.resample import StreamResampler
from omnigate.engines.piper import PiperEngine
from omnigate.gateway.settings import Settings
from tests.integration.test_realtime_ws import realtime, recv
from tests.serving import serve

pytestmark = pytest.mark.integration

# One long sentence of clauses: piper's pauses between them stay well under the silence the session waits for.
MONOLOGUE = (
    "The committee met on Tuesday morning, and after a long discussion about the budget, the schedule, the new "
    "building and the parking rules, everyone agreed that the plan should go ahead, although several members asked "
    "for more time to read the report, to talk with their neighbours, and to think about what the changes would mean "
    "for the families who live on the north side of the river, near the old mill, where the road floods every spring"
)
APPEND_BYTES = 4800  # 100 ms at 24 kHz
PACE = 2.0  # times real time: a fast microphone, slow enough that the VAD keeps up on a loaded machine
SILENCE_S = 3.0
SILENCE_MS = 1200  # the session's end-of-turn silence


def monologue_pcm(piper: PiperEngine) -> bytes:
    """At least 40 s of speech: the sentence, said twice."""
    samples = piper.synthesize(MONOLOGUE, speaker_id=None, speed=1.0)
    resampler = StreamResampler(piper.info.sample_rate, 24000)
    once = resampler.process(samples.astype("<i2").tobytes()) + resampler.flush()
    speech = once + once
    assert len(speech) / 48000 >= 40.0
    return speech


async def test_45_s_of_speech_then_silence_commits_at_the_turn_limit_and_ends_in_silence(
    piper_engine: PiperEngine,
) -> None:
    speech = monologue_pcm(piper_engine)
    audio = speech + bytes(int(48000 * SILENCE_S))
    settings = Settings(engine="synthetic")
    cap_ms = settings.realtime_input_max_bytes / 48
    speech_ms = len(speech) / 48
    with serve(settings) as server:
        async with realtime(server) as connection:
            assert (await recv(connection))["type"] == "session.created"
            await connection.session.update(
                session={
                    "type": "realtime",
                    "audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": SILENCE_MS}}},
                }
            )
            assert (await recv(connection))["type"] == "session.updated"

            async def stream() -> None:
                for offset in range(0, len(audio), APPEND_BYTES):
                    await connection.input_audio_buffer.append(
                        audio=base64.b64encode(audio[offset : offset + APPEND_BYTES]).decode()
                    )
                    await asyncio.sleep(APPEND_BYTES / 48000 / PACE)  # pacing the microphone, not a wait for state

            sender = asyncio.create_task(stream())
            events: list[dict[str, Any]] = []
            try:
                # Forced ends fall inside the speech; the last turn ends in the closing silence, after it.
                while (event := await recv(connection))["type"] != "input_audio_buffer.speech_stopped" or (
                    event["audio_end_ms"] <= speech_ms
                ):
                    events.append(event)
                events.append(event)
                await sender
                await connection.input_audio_buffer.append(audio=base64.b64encode(bytes(APPEND_BYTES)).decode())
                await connection.input_audio_buffer.clear()
                after = [event := await recv(connection)]
                while event["type"] != "input_audio_buffer.cleared":
                    after.append(event := await recv(connection))
            finally:
                sender.cancel()
    errors = [e["error"]["code"] for e in events + after if e["type"] == "error"]
    assert "input_backpressure" not in errors
    assert errors and set(errors) == {"input_turn_limit"}
    starts = [e["audio_start_ms"] for e in events if e["type"] == "input_audio_buffer.speech_started"]
    stops = [e["audio_end_ms"] for e in events if e["type"] == "input_audio_buffer.speech_stopped"]
    assert len(starts) == len(stops) == len(errors) + 1
    for start, stop in zip(starts[:-1], stops[:-1], strict=True):
        # Committed at the turn limit: at the first voiced window past it, so a pause the limit falls in (shorter
        # than the end-of-turn silence, or it would have ended the turn) can delay the commit by its length.
        assert cap_ms - 100 <= stop - start <= cap_ms + SILENCE_MS
    assert stops[-1] - speech_ms <= SILENCE_S * 1000  # the last one ends in the silence
    committed = [e for e in events + after if e["type"] == "input_audio_buffer.committed"]
    assert len(committed) == len(stops)
