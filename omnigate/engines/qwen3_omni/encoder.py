"""The inputs of every session's turns and questions encoded on one thread, batched: user audio and camera frames.

Sessions ask :class:`InputEncoder` (:meth:`InputEncoder.audio`, :meth:`InputEncoder.frames`) and await the result;
the encoder's thread takes every request waiting when it is free and encodes them together: all their frames in one
vision-encoder call, all their audio (resampled and turned into log-mel features on that thread) in one audio-encoder
call (:meth:`~omnigate.engines.qwen3_omni.model.Qwen3OmniModel.encode_audios`). A burst of turns ending together
then costs one encoder forward, not one per session on as many threads contending for the GIL and the GPU. Each
result equals that request's encode alone. The waiting requests are bounded (``engine_busy`` past it); a call that
raises fails its requests typed, and a thread that dies fails every waiter and refuses new requests, so no session
waits forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import WhisperFeatureExtractor

from omnigate.codecs.resample import StreamResampler
from omnigate.engines.base import EngineError
from omnigate.engines.qwen3_omni.encoder_stats import EncoderStats
from omnigate.engines.qwen3_omni.model import Qwen3OmniModel

log = logging.getLogger(__name__)

ENCODER_RATE = 16_000  # the audio encoder's log-mel features are of 16 kHz audio
# What one call takes at most (a larger request still goes, alone): bounds the encoders' activations.
MAX_CALL_FRAMES = 64
MAX_CALL_AUDIO_S = 300.0


@dataclass(eq=False)
class _Request:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    frames: Sequence[np.ndarray] = ()
    pcm: bytes = b""
    rate: int = ENCODER_RATE

    @property
    def is_audio(self) -> bool:
        return not self.frames

    @property
    def seconds(self) -> float:
        return len(self.pcm) / 2 / self.rate


class InputEncoder:
    """One thread encoding the waiting requests of every session together; ``audio`` and ``frames`` never block
    the event loop."""

    def __init__(self, model: Qwen3OmniModel, *, max_waiting: int) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {max_waiting}")
        self.model = model
        self.max_waiting = max_waiting
        self.stats = EncoderStats()
        mel_bins = int(model.config.thinker_config.audio_config.num_mel_bins)
        self._features = WhisperFeatureExtractor(feature_size=mel_bins)  # type: ignore[no-untyped-call]
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: list[_Request] = []
        self._taken: list[_Request] = []  # the call in progress (failed with the rest if the thread dies)
        self._closed: EngineError | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="qwen3-omni-encoder", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Fail what waits (``shutting_down``) and join the thread. Blocking: call it off the event loop."""
        self._close(EngineError("shutting_down", "the server is shutting down"))
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    async def audio(self, pcm: bytes, rate: int) -> torch.Tensor:
        """Audio tokens ``[n, hidden]`` of mono s16le ``pcm`` at ``rate``. Raises :class:`EngineError`
        (``engine_busy`` when too many requests wait, ``shutting_down``, ``internal_error``)."""
        tokens: torch.Tensor = await self._submit(pcm=pcm, rate=rate)
        return tokens

    async def frames(self, frames: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Vision tokens (:attr:`~omnigate.engines.qwen3_omni.vision.FrameTokens.tokens`) of each ``H x W x 3``
        uint8 frame; raises as :meth:`audio` does."""
        if not frames:
            return []
        tokens: list[torch.Tensor] = await self._submit(frames=frames)
        return tokens

    async def _submit(self, **what: Any) -> Any:
        loop = asyncio.get_running_loop()
        request = _Request(loop, loop.create_future(), **what)
        with self._lock:
            if self._closed is not None:
                raise _copy(self._closed)
            self._waiting = [r for r in self._waiting if not r.future.done()]  # (abandoned by their callers)
            if len(self._waiting) >= self.max_waiting:
                raise EngineError("engine_busy", "too many inputs wait for the qwen3-omni encoder; retry shortly")
            self._waiting.append(request)
            self._wake.notify()
        return await request.future

    def _close(self, error: EngineError) -> None:
        with self._lock:
            if self._closed is None:
                self._closed = error
            failed, self._waiting = self._waiting + self._taken, []
            self._taken = []
            self._wake.notify_all()
        for request in failed:
            _settle(request, _copy(error))

    # ---- the encoder's thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while self._closed is None and not self._waiting:
                        self._wake.wait()
                    if self._closed is not None:
                        return
                    self._taken = self._take()
                    taken = list(self._taken)
                self._encode([r for r in taken if not r.is_audio], self._encode_frames)
                self._encode([r for r in taken if r.is_audio], self._encode_audio)
                with self._lock:
                    self._taken = []
        except BaseException as exc:  # a dead thread answers no one: fail them all, refuse what comes
            log.exception("the qwen3-omni input encoder stopped")
            self._close(EngineError("internal_error", f"the input encoder stopped ({type(exc).__name__}: {exc})"))

    def _take(self) -> list[_Request]:
        """The waiting requests one round takes, in order, up to the per-call bounds (the first of each kind always
        goes). Under the lock."""
        taken: list[_Request] = []
        left: list[_Request] = []
        frames = turns = 0
        audio_s = 0.0
        for request in self._waiting:
            if request.future.done():
                continue
            if request.is_audio:
                fits = turns == 0 or audio_s + request.seconds <= MAX_CALL_AUDIO_S
                turns += fits
                audio_s += request.seconds if fits else 0.0
            else:
                fits = frames == 0 or frames + len(request.frames) <= MAX_CALL_FRAMES
                frames += len(request.frames) if fits else 0
            (taken if fits else left).append(request)
        self._waiting = left
        return taken

    def _encode(self, requests: list[_Request], call: Callable[[list[_Request]], Sequence[Any]]) -> None:
        if not requests:
            return
        try:
            results = call(requests)
        except Exception as exc:  # this call's requests fail, typed; the thread goes on
            log.exception("a qwen3-omni encoder call failed")
            self.stats.failed_calls += 1
            error = EngineError("internal_error", f"encoding the input failed: {type(exc).__name__}: {exc}")
            for request in requests:
                _settle(request, _copy(error))
            return
        for request, result in zip(requests, results, strict=True):
            _settle(request, result)  # (an EngineError for a turn whose audio alone failed)

    def _encode_frames(self, requests: list[_Request]) -> list[list[torch.Tensor]]:
        frames = [frame for request in requests for frame in request.frames]
        encoded = iter(self.model.encode_frames(frames))
        self.stats.frame_calls += 1
        self.stats.frames += len(frames)
        self.stats.frame_requests += len(requests)
        self.stats.largest_frame_call = max(self.stats.largest_frame_call, len(frames))
        return [[next(encoded).tokens for _ in request.frames] for request in requests]

    def _encode_audio(self, requests: list[_Request]) -> list[torch.Tensor | EngineError]:
        outcomes: list[torch.Tensor | EngineError] = []
        features: list[torch.Tensor] = []
        for request in requests:
            try:
                features.append(self._log_mel(request.pcm, request.rate))
                outcomes.append(features[-1])
            except Exception as exc:  # this turn's audio alone fails (the others still go)
                outcomes.append(EngineError("invalid_audio", f"the audio could not be read: {exc}"))
        if not features:
            return outcomes
        encoded = iter(self.model.encode_audios(features))
        self.stats.audio_calls += 1
        self.stats.audio_items += len(features)
        self.stats.largest_audio_call = max(self.stats.largest_audio_call, len(features))
        return [o if isinstance(o, EngineError) else next(encoded) for o in outcomes]

    def _log_mel(self, pcm: bytes, rate: int) -> torch.Tensor:
        """The audio encoder's input ``[mel, frames]`` of s16le ``pcm`` at ``rate``."""
        if rate != ENCODER_RATE:
            resampler = StreamResampler(rate, ENCODER_RATE)
            pcm = resampler.process(pcm) + resampler.flush()
        audio = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
        features: Any = self._features(
            audio, sampling_rate=ENCODER_RATE, return_tensors="pt", padding="longest", truncation=False
        )
        tensor: torch.Tensor = features["input_features"][0]
        return tensor


def _copy(error: EngineError) -> EngineError:
    """A new exception of the same code and message: one raised in each waiter, not one shared traceback."""
    return EngineError(error.code, error.message)


def _settle(request: _Request, outcome: Any) -> None:
    """Hand ``outcome`` (a result, or an exception to raise) to the request's waiter on its loop."""

    def settle() -> None:
        if request.future.done():  # (its caller gave up)
            return
        if isinstance(outcome, BaseException):
            request.future.set_exception(outcome)
        else:
            request.future.set_result(outcome)

    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
        request.loop.call_soon_threadsafe(settle)
