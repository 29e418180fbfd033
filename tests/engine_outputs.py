"""A sink for engine-pool outputs that tests await on: audio thresholds and the stream's end, without sleeps."""

from __future__ import annotations

import asyncio
import threading

from omnigate.engines.base import AudioChunk, EngineOutput, StreamDone

TIMEOUT_S = 10.0


class Collector:
    """A pool sink that records outputs and wakes waiters when audio totals or the stream's end arrive."""

    def __init__(self) -> None:
        self.outputs: list[EngineOutput] = []
        self.threads: set[int] = set()
        self.done = asyncio.Event()
        self._waiters: list[tuple[float, asyncio.Event]] = []

    def __call__(self, outputs: list[EngineOutput]) -> None:
        self.threads.add(threading.get_ident())
        self.outputs.extend(outputs)
        for threshold, event in self._waiters:
            if self.audio_ms >= threshold:
                event.set()
        if any(isinstance(o, StreamDone) for o in outputs):
            self.done.set()

    @property
    def audio_ms(self) -> float:
        return sum(o.duration_ms for o in self.outputs if isinstance(o, AudioChunk))

    async def audio_reaches(self, ms: float) -> None:
        event = asyncio.Event()
        self._waiters.append((ms, event))
        if self.audio_ms >= ms:
            event.set()
        await asyncio.wait_for(event.wait(), TIMEOUT_S)

    async def finished(self) -> StreamDone:
        await asyncio.wait_for(self.done.wait(), TIMEOUT_S)
        last = self.outputs[-1]
        assert isinstance(last, StreamDone)
        return last
