"""A Pipecat pipeline around one TTS service, driven like a voice agent: an LLM stand-in streams a reply token by
token (LLM response start, text frames at 50 tokens/s, response end), recorders on both sides see every frame."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner

from tests.integration.agent_pipelines import Timeline, now, paced

SAMPLE_RATE = 24000


class FrameRecorder(FrameProcessor):
    """Passes every frame on and keeps it with its arrival time; wakes waiters on each one."""

    def __init__(self, direction: FrameDirection) -> None:
        super().__init__()
        self._direction = direction
        self.frames: list[tuple[float, Frame]] = []
        self._changed = asyncio.Condition()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction == self._direction:
            self.frames.append((now(), frame))
            async with self._changed:
                self._changed.notify_all()
        await self.push_frame(frame, direction)

    async def wait_for(self, predicate: object, timeout_s: float = 60.0) -> None:
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(predicate)  # type: ignore[arg-type]

    def since(self, index: int) -> list[tuple[float, Frame]]:
        return self.frames[index:]


@dataclass
class RunningPipeline:
    worker: PipelineWorker
    upstream: FrameRecorder
    downstream: FrameRecorder

    def errors(self) -> list[ErrorFrame]:
        return [f for _, f in self.upstream.frames if isinstance(f, ErrorFrame)]

    async def reply(self, text: str, *, interrupt_after_frames: int | None = None) -> Timeline:
        """Stream ``text`` as an LLM turn; return once its TTSStoppedFrame (or the interruption) came out."""
        start = len(self.downstream.frames)
        timeline = Timeline(sample_rate=SAMPLE_RATE)
        await self.worker.queue_frame(LLMFullResponseStartFrame())

        def audio() -> list[tuple[float, TTSAudioRawFrame]]:
            return [(t, f) for t, f in self.downstream.since(start) if isinstance(f, TTSAudioRawFrame)]

        async def stream() -> None:
            async for _, token in paced(text):
                timeline.token_times.append(now())
                await self.worker.queue_frame(LLMTextFrame(token))
            await self.worker.queue_frame(LLMFullResponseEndFrame())

        streaming = asyncio.create_task(stream())
        try:
            if interrupt_after_frames is not None:
                await self.downstream.wait_for(lambda: len(audio()) >= interrupt_after_frames)
                streaming.cancel()
                timeline.interrupted_at = now()
                await self.worker.queue_frame(InterruptionFrame())
                await self.downstream.wait_for(
                    lambda: any(isinstance(f, InterruptionFrame) for _, f in self.downstream.since(start))
                )
            else:
                await self.downstream.wait_for(
                    lambda: (
                        any(isinstance(f, TTSStoppedFrame) for _, f in self.downstream.since(start))
                        and streaming.done()
                    )
                )
        finally:
            streaming.cancel()
        for t, frame in audio():
            timeline.frame_times.append(t)
            timeline.frames.append(frame.audio)
        return timeline

    def started_before_audio(self, start: int = 0) -> bool:
        kinds = [type(f) for _, f in self.downstream.since(start)]
        return TTSStartedFrame in kinds and kinds.index(TTSStartedFrame) < kinds.index(TTSAudioRawFrame)


@asynccontextmanager
async def pipeline(tts: FrameProcessor) -> AsyncIterator[RunningPipeline]:
    upstream = FrameRecorder(FrameDirection.UPSTREAM)
    downstream = FrameRecorder(FrameDirection.DOWNSTREAM)
    worker = PipelineWorker(
        Pipeline([upstream, tts, downstream]),
        params=PipelineParams(audio_out_sample_rate=SAMPLE_RATE),
        cancel_on_idle_timeout=False,
    )
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def _on_started(_worker: PipelineWorker, _frame: Frame) -> None:
        started.set()

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())
    try:
        async with asyncio.timeout(30):
            await started.wait()
        yield RunningPipeline(worker, upstream, downstream)
        await worker.queue_frame(EndFrame())
        async with asyncio.timeout(30):
            await running
    finally:
        if not running.done():
            await worker.cancel()
            await running
