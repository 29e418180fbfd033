"""The hibari engine: the default offline voice, hibari's ``heart`` (Apache-2.0, 7.9 MB of ONNX in the
``hibari-tts`` wheel, distilled from Kokoro-82M, with its own grapheme-to-phoneme rules: no espeak, no GPL code).

Each text unit is phonemized by hibari's G2P and streamed per sentence by :mod:`omnigate.engines.unit_voice`:
pieces of at most ``piece_ms`` of audio, the first one short, handed out in chunks of at most ``chunk_ms`` as the
stream's credit allows. All workers share one ``InferenceSession`` held to one intra-op thread, so ``workers``
workers use that many cores. The model takes one sequence per call (its ``speed`` input has a fixed batch of one),
so a step synthesizes one stream's piece; it costs ~0.006 CPU seconds per second of audio at 24 kHz
(``benchmarks/voice_compare.py``). The spectral noise of each stream comes from its own generator, seeded, so a
text spoken twice is the same audio.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np
import numpy.typing as npt
from hibari import SAMPLE_RATE, Hibari

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

# The voice inside the wheel; hibari's other voices download from a hub on first use, which this server never does.
PACKAGE_VOICE = "heart"
MODEL_ID = "hibari-heart"
# Spoken at load to load the G2P's lexicons (~1 s), warm onnxruntime and measure the voice's cost per second of audio.
_WARM_UP_TEXT = "Hello, this is a short sentence to warm up the voice."


class HibariOptions(UnitVoiceOptions, frozen=True, forbid_unknown_fields=True):
    """Options of the hibari engine."""

    max_sessions: Annotated[int, msgspec.Meta(ge=1)] = 256
    seed: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Seed of each stream's noise generator."""


class HibariOptionError(ValueError):
    """A hibari engine option that does not parse or is out of range."""


class HibariStream(UnitVoiceStream):
    """One utterance of the hibari voice, with its own noise generator."""

    def __init__(self, params: SynthesisParams, seed: int) -> None:
        super().__init__(params)
        self.rng = np.random.default_rng(seed)


class HibariEngine(UnitVoiceEngine):
    """The hibari voice served to many streams by a pool of worker threads."""

    def __init__(self, tts: Any, info: EngineInfo, chunk_ms: int, piece_ms: int = 4000, seed: int = 0) -> None:
        super().__init__(info, chunk_ms, piece_ms)
        self.tts = tts
        self._seed = seed
        # Audio per phoneme at speed 1, measured by warm_up(); a conservative guess until then.
        self._ms_per_phoneme = 110.0

    @classmethod
    def load(cls, model: str | None = None, **options: int | str) -> HibariEngine:
        """Load the packaged voice (None or ``heart``) or an ``.onnx`` file of the same inputs and outputs.

        ``options`` are the fields of :class:`HibariOptions`; strings (from the command line) are converted.
        """
        settings = parse_options(HibariOptions, options, HibariOptionError, "hibari")
        model_path, model_id = _resolve_model(model)
        tts = Hibari(voice=PACKAGE_VOICE, model=model_path, threads=1)
        info = EngineInfo(
            family="hibari",
            model=model_id,
            sample_rate=SAMPLE_RATE,
            voices=(
                VoiceInfo(
                    id=PACKAGE_VOICE,
                    name="Heart",
                    language="en-US",
                    description="hibari voice heart: American English, female (distilled from Kokoro-82M af_heart)",
                ),
            ),
            default_voice=PACKAGE_VOICE,
            capabilities=EngineCapabilities(speed=True, languages=("en", "en-US")),
            max_sessions=settings.max_sessions,
            max_batch=1,
            workers=settings.workers or available_cpus(),
        )
        engine = cls(tts, info, settings.chunk_ms, settings.piece_ms, settings.seed)
        engine.warm_up()
        return engine

    def warm_up(self) -> None:
        """Synthesize once: it loads the G2P and its model of unknown words, onnxruntime's first run is slow, and it
        measures the voice's audio per phoneme and its cost per second of audio on this machine (``info.rtf_hint``,
        where headroom admission starts)."""
        # The G2P loads its model of out-of-vocabulary words at the first such word: here, not in a stream's step.
        self.tts.g2p.oov  # noqa: B018 - loaded by the property
        phonemes = "".join(self.tts.phonemize(_WARM_UP_TEXT))
        ids: list[int] = self.tts.ids(phonemes)
        stream = self.open(SynthesisParams(voice=PACKAGE_VOICE))
        self.synthesize_piece(stream, ids)
        started = time.perf_counter()
        audio = self.synthesize_piece(stream, ids)
        seconds = time.perf_counter() - started
        audio_s = len(audio) / self._sample_rate
        if audio_s > 0:
            self._ms_per_phoneme = audio_s * 1000.0 / len(phonemes)
            self.info = msgspec.structs.replace(self.info, rtf_hint=seconds / audio_s)

    def open(self, params: SynthesisParams) -> HibariStream:
        validate_params(self.info, params)
        return HibariStream(params, self._seed)

    def pieces(self, text: str, *, speed: float = 1.0, first_ms: float | None = None) -> list[list[int]]:
        """Phoneme ids of the onnxruntime calls that speak ``text``: one per sentence hibari finds in it, and a
        sentence longer than ``piece_ms`` of audio (``first_ms`` for the first piece) cut at a clause mark or word
        boundary."""
        if not speakable(text):
            return []
        first, limit = piece_limits(self._piece_ms, self._ms_per_phoneme, speed, first_ms)
        out: list[list[int]] = []
        for phonemes in self.tts.phonemize(text):
            for piece in split_pieces(phonemes, first if not out else limit, limit):
                out.append(self.tts.ids("".join(piece)))
        return out

    def synthesize_piece(self, stream: UnitVoiceStream, ids: list[int]) -> npt.NDArray[np.float32]:
        audio = self.tts.from_ids(ids, stream.params.speed, _hibari_stream(stream).rng)
        return np.asarray(audio, dtype=np.float32)

    def _unit_stream(self, stream: EngineStream) -> UnitVoiceStream:
        return _hibari_stream(stream)


def _hibari_stream(stream: EngineStream) -> HibariStream:
    if not isinstance(stream, HibariStream):
        raise TypeError(f"not a hibari stream: {type(stream).__name__}")
    return stream


def _resolve_model(model: str | None) -> tuple[str | None, str]:
    """The ONNX file hibari loads (None: the packaged voice) and the model id the server reports."""
    if model is None or model in (PACKAGE_VOICE, MODEL_ID):
        return None, MODEL_ID
    path = Path(model).expanduser()
    if path.suffix != ".onnx":
        raise ValueError(f"not a hibari model: {model!r} (give a .onnx file or {PACKAGE_VOICE!r})")
    if not path.is_file():
        raise FileNotFoundError(f"no hibari model at {path}")
    return str(path), path.stem
