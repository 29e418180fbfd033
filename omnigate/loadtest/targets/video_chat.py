"""``video-chat``: live video chat, ``WS /v1/video/chat/stream``.

Each session sends camera frames (a moving test picture as JPEG) at ``video_fps`` and asks one question every
``query_every_s`` seconds (the run's texts, in turn); the spoken answer is the utterance: its TTFA is from the
question's send to the first audio byte, its end the query's ``response.audio.done``. At the end it sends
``video.done`` and waits for ``session.done``.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from collections.abc import Sequence

import numpy as np
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from omnigate.loadtest.targets.base import Target, ws_url
from omnigate.loadtest.targets.ws_connect import CLOSE_WAIT_S, connect_traced
from omnigate.loadtest.traces import SessionTrace, UtteranceTrace

VIDEO_CHAT_PATH = "/v1/video/chat/stream"
FRAME_SIZE = (320, 240)


def test_picture_frames(count: int) -> list[str]:
    """``count`` base64 JPEGs of a bright square crossing a gradient: every frame differs from the last."""
    from PIL import Image

    w, h = FRAME_SIZE
    ramp = np.tile(np.linspace(0, 200, w, dtype=np.uint8), (h, 1))
    frames = []
    for i in range(count):
        picture = np.stack([ramp, ramp[::-1], np.full_like(ramp, 80)], axis=-1)
        x = (i * 23) % (w - 60)
        picture[60:120, x : x + 60] = 255
        buffer = io.BytesIO()
        Image.fromarray(picture).save(buffer, "JPEG", quality=80)
        frames.append(base64.b64encode(buffer.getvalue()).decode())
    return frames


class _Answer:
    def __init__(self) -> None:
        self.utterance: UtteranceTrace | None = None
        self.query_id = -1
        self.done = asyncio.Event()
        self.finished = asyncio.Event()


class VideoChatTarget(Target):
    kind = "video-chat"
    _frames: list[str]  # the camera's pictures, made once in open()

    @property
    def url(self) -> str:
        return ws_url(self.spec.url, VIDEO_CHAT_PATH)

    async def open(self) -> None:
        self._frames = await asyncio.to_thread(test_picture_frames, 16)

    async def run_session(self, texts: Sequence[str], trace: SessionTrace) -> None:
        connection = await connect_traced(self.url, self.settings.connect_timeout_s, trace, self.auth_headers())
        if connection is None:
            return
        async with connection:
            await self._converse(connection, texts, trace)

    async def _converse(self, connection: ClientConnection, texts: Sequence[str], trace: SessionTrace) -> None:
        answer = _Answer()
        reader = asyncio.create_task(self._read(connection, trace, answer))
        camera = asyncio.create_task(self._camera(connection))
        try:
            config = {
                "type": "session.config",
                "audio_format": "pcm",
                "model": self.spec.model,
                "voice": self.spec.voice,
            }
            await connection.send(json.dumps({k: v for k, v in config.items() if v is not None}))
            for index, text in enumerate(texts):
                if index:
                    await asyncio.sleep(self.settings.query_every_s)  # the client's question cadence
                utterance = trace.begin_utterance(time.perf_counter(), text)
                answer.utterance, answer.query_id = utterance, index
                answer.done.clear()
                await connection.send(json.dumps({"type": "video.query", "text": text}))
                utterance.text_sent(time.perf_counter(), len(text))
                if not await self._wait(answer.done, reader):
                    if not reader.done():
                        trace.error("utterance_timeout")
                    return
            camera.cancel()
            await connection.send(json.dumps({"type": "video.done"}))
            if not await self._wait(answer.finished, reader, CLOSE_WAIT_S):
                trace.error("close_timeout")
        except ConnectionClosed:
            await asyncio.wait({reader}, timeout=CLOSE_WAIT_S)
        finally:
            camera.cancel()
            reader.cancel()
            await asyncio.gather(reader, camera, return_exceptions=True)

    async def _wait(self, event: asyncio.Event, reader: asyncio.Task[None], limit_s: float | None = None) -> bool:
        waiter = asyncio.ensure_future(event.wait())
        try:
            limit = self.settings.utterance_timeout_s if limit_s is None else limit_s
            await asyncio.wait({waiter, reader}, timeout=limit, return_when="FIRST_COMPLETED")
        finally:
            waiter.cancel()
        return event.is_set()

    async def _camera(self, connection: ClientConnection) -> None:
        period = 1.0 / self.settings.video_fps
        start = time.perf_counter()
        index = 0
        while True:
            await connection.send(json.dumps({"type": "video.frame", "data": self._frames[index % len(self._frames)]}))
            index += 1
            # A fixed schedule from the start, so slow sends do not lower the frame rate.
            await asyncio.sleep(max(0.0, start + index * period - time.perf_counter()))

    async def _read(self, connection: ClientConnection, trace: SessionTrace, answer: _Answer) -> None:
        try:
            async for message in connection:
                now_s = time.perf_counter()
                if isinstance(message, bytes):
                    trace.error("protocol_binary_message")
                    continue
                event = json.loads(message)
                kind = event.get("type")
                utterance = answer.utterance
                if kind == "error":
                    trace.error(str(event.get("code") or "server_error"), str(event.get("message")))
                elif kind == "session.done":
                    answer.finished.set()
                elif utterance is None or event.get("query_id") != answer.query_id:
                    continue
                elif kind == "response.audio.delta":
                    if utterance.units == 0:
                        utterance.unit_started(utterance.text, int(event["sample_rate"]))
                    utterance.audio(now_s, len(base64.b64decode(event["data"])))
                elif kind == "response.audio.done":
                    status = event.get("status")
                    utterance.finish(now_s, "completed" if status == "completed" else "failed")
                    if status != "completed":
                        trace.error(f"answer_{status}")
                    answer.done.set()
        except ConnectionClosed:
            pass
        if not answer.finished.is_set() and connection.close_code not in (None, 1000):
            trace.error(f"ws_close_{connection.close_code}", connection.close_reason)
