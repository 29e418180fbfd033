"""The inputs of every session's turns and questions encoded on one thread, batched: user audio and camera frames.

Sessions ask :class:`InputEncoder` (:meth:`InputEncoder.audio`, :meth:`InputEncoder.frames`) and await the result;
the encoder's thread takes every request waiting when it is free and encodes them together: all their frames in one
vision-encoder call, all their audio (resampled and turned into log-mel features on that thread) in one audio-encoder
call (:meth:`~omnigate.engines.qwen3_omni.model.Qwen3OmniModel.encode_audios`). A burst of turns ending together
then costs one encoder forward, not one per session on as many threads contending for the GIL and the GPU. Each
result equals that request's encode alone. The waiting requests are bounded (``engine_busy`` past it); a call that
raises fails its requests typed, and a thread that dies fails every waiter and refuses new requests, so no session
waits forever. A realtime turn can also be heard as it comes (:meth:`InputEncoder.turn_ahead`): its whole 8-s windows
are encoded on this thread while the user still speaks (:mod:`omnigate.engines.qwen3_omni.audio_ahead`), batched with
whatever else waits, and its end encodes only the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
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
from omnigate.engines.qwen3_omni.audio_ahead import ENCODER_RATE, HOP, TurnAhead
from omnigate.engines.qwen3_omni.encoder_stats import EncoderStats
from omnigate.engines.qwen3_omni.model import Qwen3OmniModel

log = logging.getLogger(__name__)

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
    ahead: TurnAhead | None = None  # a turn heard as it came (``pcm`` is all of it)

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
        self._window_frames = int(model.config.thinker_config.audio_config.n_window_infer)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: list[_Request] = []
        self._taken: list[_Request] = []  # the call in progress (failed with the rest if the thread dies)
        self._due: list[TurnAhead] = []  # turns heard ahead with a window to encode (each listed once at most)
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

    def turn_ahead(self, rate: int) -> TurnAhead:
        """A user turn of mono s16le audio at ``rate`` to hear as it comes (:meth:`TurnAhead.hear`, never blocking),
        its whole windows encoded meanwhile; end it with :meth:`finish_turn`, or :meth:`TurnAhead.close` it."""
        return TurnAhead(rate, self._window_frames, self._heard_window)

    async def finish_turn(self, ahead: TurnAhead, pcm: bytes) -> torch.Tensor:
        """Audio tokens of the turn ``ahead`` heard, whose whole audio is ``pcm``: equal to :meth:`audio` of it (the
        windows encoded ahead are used only where their features are the whole turn's). Raises as :meth:`audio`."""
        tokens: torch.Tensor = await self._submit(pcm=pcm, rate=ahead.rate, ahead=ahead)
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

    def _heard_window(self, ahead: TurnAhead) -> None:
        """A turn heard ahead has a window to encode (the session's loop): the thread takes it with its next call."""
        with self._lock:
            if self._closed is None:
                self._due.append(ahead)
                self._wake.notify()

    def _close(self, error: EngineError) -> None:
        with self._lock:
            if self._closed is None:
                self._closed = error
            failed, self._waiting = self._waiting + self._taken, []
            self._taken = []
            self._due = []
            self._wake.notify_all()
        for request in failed:
            _settle(request, _copy(error))

    # ---- the encoder's thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while self._closed is None and not self._waiting and not self._due:
                        self._wake.wait()
                    if self._closed is not None:
                        return
                    self._taken = self._take()
                    taken = list(self._taken)
                    due, self._due = self._due, []
                frames = [r for r in taken if not r.is_audio]
                if frames:
                    self._encode(frames, self._encode_frames)
                turns = [r for r in taken if r.is_audio]
                if turns or due:
                    self._encode(turns, functools.partial(self._encode_audio, due=due))
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

    def _encode_audio(self, requests: list[_Request], due: list[TurnAhead]) -> list[torch.Tensor | EngineError]:
        """The turns' audio, and the windows of the turns heard ahead that are due, in one encoder call."""
        plans: list[_TurnPlan | EngineError] = []
        for request in requests:
            try:
                plans.append(self._plan_turn(request))
            except Exception as exc:  # this turn's audio alone fails (the others still go)
                plans.append(EngineError("invalid_audio", f"the audio could not be read: {exc}"))
        turn_features = [p.rest for p in plans if isinstance(p, _TurnPlan) and p.rest is not None]
        windows = self._due_windows(due, sum(f.shape[-1] for f in turn_features))
        features = turn_features + [window for _, _, window in windows]
        encoded = iter(self.model.encode_audios(features) if features else [])
        if features:
            self.stats.audio_calls += 1
            self.stats.audio_items += len(features)
            self.stats.largest_audio_call = max(self.stats.largest_audio_call, len(features))
            self.stats.windows_ahead += len(windows)
        outcomes: list[torch.Tensor | EngineError] = []
        for plan in plans:
            if isinstance(plan, EngineError):
                outcomes.append(plan)
                continue
            parts = plan.kept + ([next(encoded)] if plan.rest is not None else [])
            self.stats.windows_kept += len(plan.kept)
            outcomes.append(parts[0] if len(parts) == 1 else torch.cat(parts))
        for ahead, index, window in windows:
            ahead.encoded(index, window, next(encoded))
        return outcomes

    def _plan_turn(self, request: _Request) -> _TurnPlan:
        """What encoding the turn takes: its features, or for a turn heard ahead the tokens of its windows that
        stand and the features of the rest (None: nothing is left)."""
        if request.ahead is None:
            return _TurnPlan([], self._log_mel(request.pcm, request.rate))
        kept, rest = request.ahead.finish(request.pcm, self._log_mel)
        return _TurnPlan(kept, rest if rest.shape[-1] else None)

    def _due_windows(self, due: list[TurnAhead], frames: int) -> list[tuple[TurnAhead, int, torch.Tensor]]:
        """The windows the turns heard ahead have to encode, within the call's bound on audio (``frames`` of it
        already taken): turns past it wait for the next call."""
        bound = MAX_CALL_AUDIO_S * ENCODER_RATE / HOP
        windows: list[tuple[TurnAhead, int, torch.Tensor]] = []
        for position, ahead in enumerate(due):
            if frames >= bound:
                with self._lock:
                    self._due = due[position:] + self._due
                break
            if ahead.closed:
                continue  # ended (this call finished it) or forgotten
            try:
                found = ahead.windows_to_encode(self._mel)
            except Exception:  # it is encoded whole at its end; the others go on
                log.exception("a turn heard ahead could not be read")
                continue
            windows += [(ahead, index, window) for index, window in found]
            frames += sum(int(window.shape[-1]) for _, window in found)
        return windows

    def _log_mel(self, pcm: bytes, rate: int) -> torch.Tensor:
        """The audio encoder's input ``[mel, frames]`` of s16le ``pcm`` at ``rate``."""
        if rate != ENCODER_RATE:
            resampler = StreamResampler(rate, ENCODER_RATE)
            pcm = resampler.process(pcm) + resampler.flush()
        return self._mel(pcm)

    def _mel(self, pcm: bytes) -> torch.Tensor:
        """The log-mel features ``[mel, frames]`` of 16 kHz s16le ``pcm``."""
        audio = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
        features: Any = self._features(
            audio, sampling_rate=ENCODER_RATE, return_tensors="pt", padding="longest", truncation=False
        )
        tensor: torch.Tensor = features["input_features"][0]
        return tensor


@dataclass
class _TurnPlan:
    kept: list[torch.Tensor]  # tokens of the windows encoded ahead that stand
    rest: torch.Tensor | None  # features still to encode


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
