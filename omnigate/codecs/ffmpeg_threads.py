"""FFmpeg works on the thread that calls it: it starts no thread pools of its own.

FFmpeg sizes the pools it starts by itself by the machine's cores: every filter graph gets slice threads, and so does
every codec opened with an automatic thread count. PyAV gives no knob where it builds such a graph: each audio encoder
converts its input through a filter graph of its own (PyAV's ``AudioResampler``, made on the first ``encode``), so
every live Opus, MP3 or AAC encoder held one idle thread per core, started inside whichever worker thread encoded
first (so carrying that thread's name), until the encoder was garbage-collected. Forcing FFmpeg's core count to one
stops every such pool from being started; the work per call (a 20 ms Opus packet, a resampled chunk) is tiny, and the
threads that call FFmpeg are the server's own pools, sized by its configuration.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

import av  # noqa: F401 - loads PyAV's libavutil, looked up below in this process

log = logging.getLogger(__name__)


def _pyav_libavutil() -> str | None:
    """The path of the libavutil PyAV runs on, which its extension modules load privately (not global symbols)."""
    if sys.platform == "linux":
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and "/libavutil" in fields[5]:
                    return fields[5].strip()
    return ctypes.util.find_library("avutil")  # PyAV built against the system's FFmpeg


@functools.cache
def ffmpeg_on_calling_threads() -> bool:
    """Make FFmpeg (through PyAV, process-wide) start no worker threads; False where its library is not found."""
    path = _pyav_libavutil()
    if path is None:
        log.warning("libavutil not found: FFmpeg filter graphs and codecs keep their per-core thread pools")
        return False
    libavutil = ctypes.CDLL(path)
    libavutil.av_cpu_force_count(ctypes.c_int(1))
    return True
