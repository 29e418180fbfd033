"""A user turn's audio encoded while the user still speaks, with tokens equal to the whole turn's encode.

Qwen3-Omni's audio encoder attends inside windows of ``n_window_infer`` log-mel frames (8 s) counted from the start of
its input, so a window's tokens depend on that window's features only: a window is encoded as soon as the samples its
frames read (and a margin) have come. Its feature values are not final until the turn ends, though: the log-mel
features clamp every value to the loudest frame of the whole turn minus 8 (transformers' ``WhisperFeatureExtractor``,
which Qwen3-Omni's processor uses). So each window is encoded with the features of the audio heard so far, encoded
again when a later window finds its features changed (a louder frame came), and used at the turn's end only where its
features equal the whole turn's bit for bit (the whole turn's features computed from its PCM exactly as a turn
encoded only at its end); from the first window that differs on, the rest of the turn is encoded then, as one
input, as all of it was before. A turn shorter than a window, or whose loudest frame comes in its last
seconds, costs what it did; a long one leaves only its last window (and a margin) for the end.

:class:`TurnAhead` holds one turn's state: :meth:`TurnAhead.hear` runs on the session's event loop (it only keeps the
bytes and, when a window's audio is complete, wakes the encoder's thread); the rest runs on the input encoder's thread
(:class:`~omnigate.engines.qwen3_omni.encoder.InputEncoder`), which resamples and computes the features there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from omnigate.codecs.resample import StreamResampler

ENCODER_RATE = 16_000  # the audio encoder's log-mel features are of 16 kHz audio
HOP = 160  # log-mel frame hop, in 16 kHz samples
HALF_WINDOW = 200  # half the STFT window: a frame reads this many samples past its centre
# Samples a window waits for past the last one its frames read: the resampler's delay, with room to spare.
MARGIN = 1_600

Features = Callable[[bytes], torch.Tensor]  # 16 kHz s16le -> log-mel features [mel, frames]
TurnFeatures = Callable[[bytes, int], torch.Tensor]  # s16le at a rate -> log-mel features [mel, frames]


def complete_windows(samples: int, window_frames: int) -> int:
    """Windows complete in the first ``samples`` 16 kHz samples of a turn: every frame of theirs reads within them,
    with the margin to spare (the features of a prefix also drop its last frame, which the margin covers)."""
    return max(0, samples - HALF_WINDOW - MARGIN) // (HOP * window_frames)


@dataclass
class _Window:
    features: torch.Tensor  # [mel, window_frames]: what it was encoded from
    tokens: torch.Tensor


class TurnAhead:
    """One user turn heard as it comes: its audio, and the tokens of its whole windows encoded so far."""

    def __init__(self, rate: int, window_frames: int, wake: Callable[[TurnAhead], None]) -> None:
        if rate <= 0 or window_frames <= 0:
            raise ValueError(f"a positive rate and window are needed, got {rate} Hz, {window_frames} frames")
        self.rate = rate
        self.window_frames = window_frames
        self._wake = wake
        self._lock = threading.Lock()
        self._new = bytearray()  # heard on the loop, not yet resampled on the encoder's thread
        self._heard = 0  # samples at ``rate`` heard
        self._asked = 0  # windows whose audio had come when the encoder was last woken
        self._woken = False
        self._closed = False
        self._broken = False  # the heard audio could not be read: the turn is encoded whole at its end
        # the encoder's thread only
        self._resampler = StreamResampler(rate, ENCODER_RATE)
        self._audio = bytearray()  # 16 kHz s16le of the turn so far
        self.windows: list[_Window] = []

    # ---- the session's loop -----------------------------------------------------------------------------------

    def hear(self, pcm: bytes) -> None:
        """More of the turn's mono s16le audio, in order. Never blocks: a window whose audio is complete is encoded
        on the encoder's thread."""
        with self._lock:
            if self._closed or not pcm:
                return
            self._new.extend(pcm)
            self._heard += len(pcm) // 2
            complete = self._whole_windows(self._heard * ENCODER_RATE // self.rate)
            wake = not self._woken and complete > self._asked
            if wake:
                self._woken = True
                self._asked = complete
        if wake:
            self._wake(self)

    def close(self) -> None:
        """Nothing more is heard (the turn was committed or forgotten); a wake still queued does nothing."""
        with self._lock:
            self._closed = True

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    @property
    def broken(self) -> bool:
        """The audio heard could not be read: nothing is encoded ahead, the turn is encoded whole at its end."""
        return self._broken

    # ---- the encoder's thread ---------------------------------------------------------------------------------

    def windows_to_encode(self, features: Features) -> list[tuple[int, torch.Tensor]]:
        """The windows to encode now (index, features): those newly complete, and earlier ones whose features the
        audio heard since changed. Call :meth:`encoded` with each one's tokens."""
        with self._lock:
            self._woken = False
        if self._broken:
            return []
        try:
            self._take_heard()
        except Exception:  # (the whole turn, given at its end, is what counts: it is encoded then)
            self._broken = True
            raise
        whole = self._whole_windows(len(self._audio) // 2)
        with self._lock:
            self._asked = whole  # (hear estimates; the resampler's delay may hold the last back: asked again)
        if whole == 0:
            return []
        found = features(bytes(self._audio))
        todo: list[tuple[int, torch.Tensor]] = []
        for index in range(whole):
            window = self._slice(found, index)
            if index >= len(self.windows) or not torch.equal(self.windows[index].features, window):
                todo.append((index, window.clone()))
        return todo

    def encoded(self, index: int, features: torch.Tensor, tokens: torch.Tensor) -> None:
        """Window ``index``, encoded from ``features``."""
        window = _Window(features, tokens)
        if index < len(self.windows):
            self.windows[index] = window
        else:
            assert index == len(self.windows), "windows are encoded in order"
            self.windows.append(window)

    def finish(self, pcm: bytes, features: TurnFeatures) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The turn ended; ``pcm`` is all of it, at :attr:`rate`: the tokens of its first windows whose features are
        the whole turn's, and the features of the rest of the turn, from the first window that is not. Raises what
        reading ``pcm`` raises."""
        self.close()
        self._new.clear()
        self._audio = bytearray()
        whole = features(pcm, self.rate)
        kept: list[torch.Tensor] = []
        for index, window in enumerate([] if self._broken else self.windows):
            if not torch.equal(window.features, self._slice(whole, index)):
                break
            kept.append(window.tokens)
        self.windows = []
        return kept, whole[:, len(kept) * self.window_frames :]

    def _take_heard(self) -> None:
        with self._lock:
            pcm = bytes(self._new)
            self._new.clear()
        if pcm:
            self._audio += self._resampler.process(pcm)

    def _whole_windows(self, samples: int) -> int:
        return complete_windows(samples, self.window_frames)

    def _slice(self, features: torch.Tensor, index: int) -> torch.Tensor:
        return features[:, index * self.window_frames : (index + 1) * self.window_frames]
