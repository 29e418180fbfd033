"""The inbound (microphone) track of a call, always consumed into a bounded buffer.

aiortc queues decoded frames of a remote track in an unbounded queue until someone calls ``recv()``, so every
inbound track is read as it arrives, as mono s16le at 48 kHz. On the ``speech`` channel it is kept in a ring of
fixed size (the oldest audio is dropped); on ``oai-events`` it goes to the realtime session as it arrives.
"""

from __future__ import annotations

from collections.abc import Callable

import av
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from omnigate.codecs.rtc_audio import RTC_SAMPLE_RATE


class MicrophoneRing:
    """The latest inbound audio: mono s16le at 48 kHz, at most ``capacity_bytes`` (oldest dropped first)."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 2:
            raise ValueError("a microphone ring holds at least one sample")
        self.capacity_bytes = capacity_bytes - capacity_bytes % 2
        self._buffer = bytearray()
        self.received_bytes = 0
        self.dropped_bytes = 0

    def __len__(self) -> int:
        return len(self._buffer)

    def append(self, pcm: bytes) -> None:
        self.received_bytes += len(pcm)
        self._buffer += pcm
        excess = len(self._buffer) - self.capacity_bytes
        if excess > 0:
            del self._buffer[:excess]
            self.dropped_bytes += excess

    def take(self) -> bytes:
        """Everything buffered, oldest first; the ring is then empty."""
        data = bytes(self._buffer)
        self._buffer.clear()
        return data


async def consume_microphone(track: MediaStreamTrack, sink: Callable[[bytes], None]) -> None:
    """Read ``track`` until it ends, downmixing and resampling each frame to 48 kHz mono for ``sink``."""
    resampler = av.AudioResampler(format="s16", layout="mono", rate=RTC_SAMPLE_RATE)
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            return
        if isinstance(frame, av.AudioFrame):
            for mono in resampler.resample(frame):
                sink(mono.to_ndarray().tobytes())
