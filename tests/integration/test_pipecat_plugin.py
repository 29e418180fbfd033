"""``omnigate.integrations.pipecat.OmnigateTTSService`` in a Pipecat pipeline (unchanged framework code) against a
real ``omnigate serve``: an LLM stand-in streams each reply token by token at 50 tokens/s (response start, text frames,
response end), recorders on both sides of the service see every frame, and the audio is checked as speech."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

from tests.audio_checks import speech_fraction
from tests.integration.agent_pipelines import REPLIES, ServerProcess, omnigate_serve

pytest.importorskip("pipecat")
from pipecat.frames.frames import (
    ErrorFrame,
    InterruptionFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)

from omnigate.integrations.pipecat import OmnigateTTSService
from tests.integration.pipecat_pipeline import SAMPLE_RATE, RunningPipeline, pipeline

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with omnigate_serve(tmp_path_factory.mktemp("pipecat")) as running:
        yield running


def tts_frames(p: RunningPipeline, start: int = 0) -> list[type]:
    kinds = (TTSStartedFrame, TTSAudioRawFrame, TTSStoppedFrame, InterruptionFrame)
    return [type(f) for _, f in p.downstream.since(start) if isinstance(f, kinds)]


async def test_a_reply_streamed_token_by_token_is_speech_in_frame_order(server: ServerProcess) -> None:
    async with pipeline(OmnigateTTSService(base_url=server.base_url, voice="alloy")) as p:
        timeline = await p.reply(REPLIES[0])
        kinds = tts_frames(p)
        audio = [f for _, f in p.downstream.frames if isinstance(f, TTSAudioRawFrame)]
        assert not p.errors()
    assert kinds[0] is TTSStartedFrame and kinds[-1] is TTSStoppedFrame
    assert set(kinds[1:-1]) == {TTSAudioRawFrame}  # one context: started, its audio, stopped
    assert all(f.sample_rate == SAMPLE_RATE and f.num_channels == 1 for f in audio)
    assert len({f.context_id for f in audio}) == 1
    assert speech_fraction(timeline.pcm, SAMPLE_RATE) > 0.6 and len(timeline.pcm) / (2 * SAMPLE_RATE) > 4.0


async def test_an_interruption_stops_the_audio_and_the_next_reply_plays_normally(server: ServerProcess) -> None:
    async with pipeline(OmnigateTTSService(base_url=server.base_url, voice="alloy")) as p:
        reference = await p.reply(REPLIES[2])
        start = len(p.downstream.frames)
        await p.reply(REPLIES[1], interrupt_after_frames=3)
        interrupted = p.downstream.since(start)
        cut = next(i for i, (_, f) in enumerate(interrupted) if isinstance(f, InterruptionFrame))
        late = [f for _, f in interrupted[cut:] if isinstance(f, TTSAudioRawFrame)]
        after_start = len(p.downstream.frames)
        after = await p.reply(REPLIES[2])
        assert not p.errors()
        # Nothing of the interrupted reply after the interruption (within one frame), and none of it in the next.
        assert len(late) <= 1
        audio_after = [f for _, f in p.downstream.since(after_start) if isinstance(f, TTSAudioRawFrame)]
        interrupted_contexts = {f.context_id for _, f in interrupted if isinstance(f, TTSAudioRawFrame)}
        assert not interrupted_contexts & {f.context_id for f in audio_after}
    assert speech_fraction(after.pcm, SAMPLE_RATE) > 0.6
    assert len(after.pcm) == pytest.approx(len(reference.pcm), rel=0.1)


async def test_a_voice_the_server_does_not_have_is_an_error_frame(server: ServerProcess) -> None:
    async with pipeline(OmnigateTTSService(base_url=server.base_url, voice="nobody")) as p:
        await p.upstream.wait_for(lambda: bool(p.errors()))
        errors = p.errors()
    assert "unknown_voice" in errors[0].error


async def test_no_free_slot_is_an_error_frame(tmp_path: Path) -> None:
    with omnigate_serve(tmp_path, "--max-sessions", "1") as busy:
        async with connect(busy.base_url.replace("http", "ws") + "/v1/audio/speech/stream"):  # holds the one slot
            tts = OmnigateTTSService(base_url=busy.base_url, voice="alloy", reconnect_on_error=False)
            async with pipeline(tts) as p:
                await p.upstream.wait_for(lambda: any("server_busy" in e.error for e in p.errors()))
    assert isinstance(p.errors()[0], ErrorFrame)


async def test_the_api_key_goes_as_a_bearer_token(tmp_path: Path) -> None:
    with omnigate_serve(tmp_path, "--api-key", "sk-agent") as keyed:
        async with pipeline(OmnigateTTSService(base_url=keyed.base_url, api_key="sk-agent", voice="alloy")) as p:
            timeline = await p.reply(REPLIES[0])
            assert not p.errors()
        wrong = OmnigateTTSService(base_url=keyed.base_url, api_key="sk-wrong", voice="alloy")
        async with pipeline(wrong) as p:
            await p.upstream.wait_for(lambda: bool(p.errors()))
            assert "401" in p.errors()[0].error
    assert speech_fraction(timeline.pcm, SAMPLE_RATE) > 0.6
