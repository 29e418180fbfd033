"""An Opus encoder, and the filter graph PyAV builds inside it, start no FFmpeg threads once FFmpeg is told so."""

from __future__ import annotations

import os
import threading

from omnigate.codecs.ffmpeg_threads import ffmpeg_on_calling_threads
from omnigate.codecs.rtc_audio import RTC_FRAME_BYTES, OpusFrameEncoder


def test_an_encoder_used_in_a_worker_thread_starts_no_thread_of_its_own() -> None:
    assert ffmpeg_on_calling_threads()
    encoders: list[OpusFrameEncoder] = []
    counts: list[int] = []

    def encode() -> None:
        before = len(os.listdir("/proc/self/task"))
        encoder = OpusFrameEncoder()
        assert encoder.encode(bytes(RTC_FRAME_BYTES))  # the first encode builds PyAV's resampler graph
        encoders.append(encoder)  # alive while counted
        counts.append(len(os.listdir("/proc/self/task")) - before)

    worker = threading.Thread(target=encode)
    worker.start()
    worker.join()
    assert counts == [0]
