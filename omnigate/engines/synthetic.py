"""The synthetic engine family: a deterministic tone/noise source that loads the gateway without a model.

It is a test double for load tests and gateway benchmarks, not a voice. Its outputs follow the same segment
semantics as the real engines (one segment per text unit) and its cost follows a simple model of a batched
accelerator: a step advances every stream in the batch by at most one chunk and blocks its scheduler thread
for ``rtf`` times the longest chunk it produced, plus ``first_chunk_delay_ms`` when a stream gets its first
audio.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec
import numpy as np
import numpy.typing as npt

from omnigate.engines.base import (
    AudioChunk,
    Engine,
    EngineCapabilities,
    EngineInfo,
    EngineOutput,
    EngineStream,
    SegmentDone,
    SegmentStarted,
    StreamDone,
    SynthesisParams,
    VoiceInfo,
    speakable,
    validate_params,
)

MODEL_NAME = "synthetic"
TONE_VOICE = "tone"
NOISE_VOICE = "noise"
# A chunk is cut below chunk_ms to fit the credit only down to this length; tinier pieces wait for credit.
MIN_CUT_MS = 20
AMPLITUDE = 0.3
BASE_FREQUENCY_HZ = 220.0


class SyntheticConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Options of the synthetic engine; each may be given in the model spec as ``key=value``."""

    sample_rate: Annotated[int, msgspec.Meta(ge=8000, le=192_000)] = 24_000
    chunk_ms: Annotated[int, msgspec.Meta(ge=5, le=1000)] = 40
    ms_per_char: Annotated[float, msgspec.Meta(ge=0.0, le=10_000.0)] = 60.0
    rtf: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 0.0
    first_chunk_delay_ms: Annotated[float, msgspec.Meta(ge=0.0, le=60_000.0)] = 0.0
    max_sessions: Annotated[int, msgspec.Meta(ge=1)] = 1000
    max_batch: Annotated[int, msgspec.Meta(ge=1)] = 64
    seed: int = 0


class SyntheticSpecError(ValueError):
    """A synthetic model spec or option that does not parse or is out of range."""


def parse_spec(spec: str | None) -> dict[str, str]:
    """Split ``"rtf=0.5,chunk_ms=20"`` into raw options; None, ``""`` and ``"synthetic"`` give no options."""
    if spec is None or spec.strip() in ("", MODEL_NAME):
        return {}
    options: dict[str, str] = {}
    for item in spec.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key or not value:
            raise SyntheticSpecError(f"invalid synthetic spec item {item.strip()!r}: expected key=value")
        if key in options:
            raise SyntheticSpecError(f"synthetic spec sets {key!r} twice")
        options[key] = value
    return options


class SyntheticStream(EngineStream):
    """One utterance: the segment being generated and where the stream stands."""

    def __init__(self, params: SynthesisParams) -> None:
        super().__init__(params)
        self.next_index = 0
        self.segment_index = -1
        self.in_segment = False
        self.segment_samples = 0
        self.position = 0
        self.frequency_hz = BASE_FREQUENCY_HZ
        self.noise: np.random.Generator | None = None
        self.emitted_samples = 0
        self.finished = False

    @property
    def has_work(self) -> bool:
        if self.finished:
            return False
        return self.in_segment or bool(self.pending_text) or self.input_done


class SyntheticEngine(Engine):
    """Deterministic tone (``tone``) or seeded noise (``noise``) whose length follows the text."""

    def __init__(self, config: SyntheticConfig) -> None:
        self.config = config
        self._sample_rate = config.sample_rate
        self._chunk_samples = config.chunk_ms * config.sample_rate // 1000
        self._min_cut_samples = min(MIN_CUT_MS, config.chunk_ms) * config.sample_rate // 1000
        self.info = EngineInfo(
            family="synthetic",
            model=MODEL_NAME,
            sample_rate=config.sample_rate,
            voices=(
                VoiceInfo(id=TONE_VOICE, name="Tone", description="sine tone, pitch set by the segment index"),
                VoiceInfo(id=NOISE_VOICE, name="Noise", description="seeded uniform noise"),
            ),
            default_voice=TONE_VOICE,
            capabilities=EngineCapabilities(speed=True),
            max_sessions=config.max_sessions,
            max_batch=config.max_batch,
            workers=1,
            synthetic=True,
        )

    @classmethod
    def from_spec(cls, model: str | None = None, **options: Any) -> SyntheticEngine:
        """Build from a spec (``"rtf=0.5,sample_rate=22050"``) and keyword options; each key at most once."""
        raw: dict[str, Any] = dict(parse_spec(model))
        for key, value in options.items():
            if key in raw:
                raise SyntheticSpecError(f"synthetic option {key!r} is given both in the spec and as an option")
            raw[key] = value
        try:
            config = msgspec.convert(raw, SyntheticConfig, strict=False)
        except msgspec.ValidationError as exc:
            raise SyntheticSpecError(f"invalid synthetic option: {exc}") from None
        return cls(config)

    def open(self, params: SynthesisParams) -> SyntheticStream:
        validate_params(self.info, params)
        return SyntheticStream(params)

    def step(self, streams: Sequence[EngineStream], budget_ms: Sequence[float]) -> list[list[EngineOutput]]:
        outputs: list[list[EngineOutput]] = []
        longest_chunk = 0
        first_audio = False
        for stream, budget in zip(streams, budget_ms, strict=True):
            ss = _synthetic_stream(stream)
            had_audio = ss.emitted_samples > 0
            out, produced = self._step_one(ss, budget)
            outputs.append(out)
            longest_chunk = max(longest_chunk, produced)
            first_audio = first_audio or (produced > 0 and not had_audio)
        # Simulated compute: blocking is the point here, this runs on a scheduler thread.
        cost_ms = self.config.rtf * longest_chunk * 1000.0 / self._sample_rate
        if first_audio:
            cost_ms += self.config.first_chunk_delay_ms
        if cost_ms > 0.0:
            time.sleep(cost_ms / 1000.0)
        return outputs

    def close(self, stream: EngineStream) -> None:
        ss = _synthetic_stream(stream)
        ss.finished = True
        ss.in_segment = False
        ss.noise = None
        ss.pending_text.clear()

    def _step_one(self, stream: SyntheticStream, budget_ms: float) -> tuple[list[EngineOutput], int]:
        """Outputs of one stream for this step and the samples of audio among them."""
        out: list[EngineOutput] = []
        if stream.finished:
            return out, 0
        if not stream.in_segment:
            # input_done is read before pending_text: the pool appends text only before it sets input_done.
            ended = stream.input_done
            if stream.pending_text:
                self._start_segment(stream, stream.pending_text.pop(0), out)
            elif ended:
                out.append(StreamDone(reason="completed"))
                stream.finished = True
                return out, 0
            else:
                return out, 0
        produced = self._emit_chunk(stream, budget_ms, out)
        if not stream.in_segment and not stream.finished and stream.input_done and not stream.pending_text:
            out.append(StreamDone(reason="completed"))
            stream.finished = True
        return out, produced

    def _start_segment(self, stream: SyntheticStream, text: str, out: list[EngineOutput]) -> None:
        stream.segment_index = stream.next_index
        stream.next_index += 1
        stream.in_segment = True
        stream.position = 0
        spoken_chars = sum(1 for ch in text if not ch.isspace()) if speakable(text) else 0
        duration_ms = self.config.ms_per_char * spoken_chars / stream.params.speed
        stream.segment_samples = round(duration_ms * self._sample_rate / 1000.0)
        stream.frequency_hz = BASE_FREQUENCY_HZ * (1.0 + 0.25 * (stream.segment_index % 4))
        if stream.params.voice == NOISE_VOICE:
            stream.noise = np.random.default_rng([self.config.seed, stream.segment_index])
        out.append(SegmentStarted(index=stream.segment_index, text=text))

    def _emit_chunk(self, stream: SyntheticStream, budget_ms: float, out: list[EngineOutput]) -> int:
        """Emit at most one chunk of the current segment within the budget and the duration cap."""
        remaining = stream.segment_samples - stream.position
        if remaining > 0:
            cap = stream.params.max_audio_ms * self._sample_rate // 1000
            allowed = cap - stream.emitted_samples
            if allowed <= 0:
                out.append(SegmentDone(index=stream.segment_index, reason="max_duration"))
                out.append(StreamDone(reason="max_duration"))
                self.close(stream)
                return 0
            budget = int(budget_ms * self._sample_rate / 1000.0 + 1e-6)
            n = min(self._chunk_samples, remaining, allowed)
            if n > budget:
                if budget < self._min_cut_samples:
                    return 0
                n = budget
            out.append(
                AudioChunk(
                    segment_index=stream.segment_index,
                    pcm=self._samples(stream, n).astype("<i2").tobytes(),
                    sample_rate=self._sample_rate,
                )
            )
            stream.position += n
            stream.emitted_samples += n
            remaining -= n
        else:
            n = 0
        if remaining == 0:
            out.append(SegmentDone(index=stream.segment_index))
            stream.in_segment = False
            stream.noise = None
        return n

    def _samples(self, stream: SyntheticStream, n: int) -> npt.NDArray[np.float64]:
        """The next ``n`` samples, scaled to the int16 range; they depend on position, never on timing."""
        if stream.noise is not None:
            signal = stream.noise.random(n) * 2.0 - 1.0
        else:
            t = (stream.position + np.arange(n)) / self._sample_rate
            signal = np.sin(2.0 * math.pi * stream.frequency_hz * t)
        return np.round(signal * (AMPLITUDE * 32767.0))


def _synthetic_stream(stream: EngineStream) -> SyntheticStream:
    if not isinstance(stream, SyntheticStream):
        raise TypeError(f"not a synthetic stream: {type(stream).__name__}")
    return stream
