"""The engine contract: what every engine family implements and what the pool drives.

An engine serves *streams*: one stream per utterance. Text reaches a stream in units (the session's segmenter
decides when a unit is ready, or, for engines that take streaming text, as it arrives). The pool calls
:meth:`Engine.step` from a scheduler thread with a batch of runnable streams; each call advances every stream in the
batch by one bounded piece of work and returns what it produced. Engines never see sessions, transports or wire
formats.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec

StopReason = Literal["completed", "cancelled", "max_duration", "silence", "error"]

# OpenAI's voice names. Voice-agent frameworks send them whatever the server, so every engine takes them as
# aliases of its served voices (see :meth:`EngineInfo.voice_aliases`) and those clients work unchanged.
OPENAI_VOICES = (
    "alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse", "marin", "cedar",
)  # fmt: skip


class VoiceInfo(msgspec.Struct, frozen=True):
    """A voice an engine serves."""

    id: str
    name: str
    language: str = "en"
    description: str = ""


class EngineCapabilities(msgspec.Struct, frozen=True):
    """What an engine can honour; the gateway refuses requests for anything else."""

    streaming_text_input: bool = False
    duplex: bool = False
    speed: bool = False
    instructions: bool = False
    reference_audio: bool = False
    languages: tuple[str, ...] = ("en",)


class UnitTokens(msgspec.Struct, frozen=True):
    """How a caller turns a text unit into the token ids the engine would make of it, so that the tokenization runs
    where the text arrives (a gateway process) and the ids cross to the engine with the text.

    ``template`` is the prompt's layout (``csm``: ``<bos>[speaker]text<eos>``); ``tokenizer`` is ``bytes`` (each
    UTF-8 byte its own id) or the path of a ``tokenizer.json`` file; ids are below ``vocab_size``.
    """

    template: Literal["csm"]
    tokenizer: str
    bos_id: int
    eos_id: int
    vocab_size: int


class EngineInfo(msgspec.Struct, frozen=True):
    """Static facts about a loaded engine."""

    family: str
    model: str
    sample_rate: int
    voices: tuple[VoiceInfo, ...]
    default_voice: str
    capabilities: EngineCapabilities
    max_sessions: int
    max_batch: int = 1
    workers: int = 1
    channels: int = 1
    synthetic: bool = False
    # The least credit with which a step surely makes progress (a talker: one codec frame).
    min_credit_ms: float = 20.0
    # Worker seconds per second of audio measured when the engine loaded, or None: headroom admission starts from it
    # until the pool has observed steps of its own.
    rtf_hint: float | None = None
    # A batched engine's step time by batch size, measured when it loaded: (rows, seconds) pairs, rows ascending.
    # Headroom admission prices rows by it from the first session on, and never below it (each row of a step makes
    # ``min_credit_ms`` of audio).
    step_profile: tuple[tuple[int, float], ...] = ()
    # How callers may tokenize text units for the engine (:meth:`EngineStream.push_text`), or None.
    unit_tokens: UnitTokens | None = None

    def voice_ids(self) -> frozenset[str]:
        return frozenset(v.id for v in self.voices)

    def voice_aliases(self) -> dict[str, str]:
        """Each OpenAI voice name and the served voice id it speaks with: a stable spread over the served voices.
        A served voice of the same name (id or name, any case) is that voice, not an alias."""
        ids = sorted(self.voice_ids())
        if not ids:
            return {}
        served = {v.id.lower() for v in self.voices} | {v.name.lower() for v in self.voices}
        return {alias: ids[index % len(ids)] for index, alias in enumerate(OPENAI_VOICES) if alias not in served}


class SynthesisParams(msgspec.Struct, frozen=True):
    """Per-utterance parameters, validated by the session before they reach an engine."""

    voice: str
    speed: float = 1.0
    language: str | None = None
    instructions: str | None = None
    max_audio_ms: int = 120_000


class SegmentStarted(msgspec.Struct, frozen=True, tag="segment.started"):
    """The engine began producing audio for one text unit (a sentence for per-sentence engines)."""

    index: int
    text: str


class AudioChunk(msgspec.Struct, frozen=True, tag="audio"):
    """Mono signed 16-bit little-endian PCM at ``sample_rate``."""

    segment_index: int
    pcm: bytes
    sample_rate: int

    @property
    def duration_ms(self) -> float:
        return len(self.pcm) / 2 * 1000.0 / self.sample_rate


class SegmentDone(msgspec.Struct, frozen=True, tag="segment.done"):
    """All audio of one unit has been produced."""

    index: int
    reason: StopReason = "completed"
    error: str | None = None


class StreamDone(msgspec.Struct, frozen=True, tag="stream.done"):
    """The stream produced its last output. Exactly one per stream, and always the last output.

    A stream the engine tier ended or refused (``reason="error"``: the engine core or replica was lost, refused the
    stream, was drained) carries the typed ``code`` its session reports to the client (``engine_unavailable``,
    ``engine_busy``, ``shutting_down``); an engine failure has none (the session reports ``generation_failed``).
    """

    reason: StopReason = "completed"
    error: str | None = None
    code: str | None = None


def stream_failed(code: str, message: str) -> StreamDone:
    """The last output of a stream that failed with the typed error ``code`` (the message starts with it)."""
    return StreamDone(reason="error", error=f"{code}: {message}", code=code)


EngineOutput = SegmentStarted | AudioChunk | SegmentDone | StreamDone


class EngineStream(abc.ABC):
    """Engine-owned state of one utterance. The pool feeds it under its lock and steps it on a worker thread.

    ``pending_text`` holds units not yet consumed by the engine; ``input_done`` says no more text will come.
    """

    def __init__(self, params: SynthesisParams) -> None:
        self.params = params
        self.pending_text: list[str] = []
        self.input_done = False
        self.audio_ms = 0.0

    def push_text(self, text: str, tokens: list[int] | None = None) -> None:
        """Queue a text unit. ``tokens``: its ids as :attr:`EngineInfo.unit_tokens` makes them, where the caller
        computed them; an engine that tokenizes may use them instead of tokenizing the unit itself."""
        self.pending_text.append(text)

    @property
    @abc.abstractmethod
    def has_work(self) -> bool:
        """True when a step would make progress (pending text, buffered audio, or end of input to report)."""


class Engine(abc.ABC):
    """An engine family instance with loaded weights, shared by all its streams."""

    info: EngineInfo

    @abc.abstractmethod
    def open(self, params: SynthesisParams) -> EngineStream:
        """Create the state for one utterance. Cheap; called on the event loop thread."""

    @abc.abstractmethod
    def step(self, streams: Sequence[EngineStream], budget_ms: Sequence[float]) -> list[list[EngineOutput]]:
        """Advance each stream by one piece of work on a scheduler thread.

        ``budget_ms[i]`` is the media time stream ``i`` may still emit (its credit). Returns one list of outputs
        per stream, in order. An engine must not emit more audio than the budget allows, except a final chunk
        that ends a segment may round up to one engine frame.
        """

    @abc.abstractmethod
    def close(self, stream: EngineStream) -> None:
        """Release everything the stream holds (slot, caches). Idempotent; called on completion and abort."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release the engine's own resources."""

    def stage_seconds(self) -> dict[str, float]:
        """Seconds its steps spent in each stage since load (waiting on the device, each host stage), for engines
        that time them; read from any thread."""
        return {}


class EngineError(Exception):
    """A typed engine failure that fails only the affected streams; ``param`` names the offending parameter."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


MIN_SPEED = 0.25
MAX_SPEED = 4.0


def unknown_voice_message(voice: str, served: Iterable[str], aliases: Iterable[str]) -> str:
    """What an ``unknown_voice`` error says: the voices served and the OpenAI names that are aliases of them."""
    message = f"voice {voice!r} is not served; available: {', '.join(sorted(served))}"
    alias_names = ", ".join(aliases)
    if alias_names:
        message += f"; aliases of these (OpenAI's voice names): {alias_names}"
    return message


def speakable(text: str) -> bool:
    """Whether ``text`` has anything to speak: a letter or a digit (punctuation, symbols and spaces alone are not)."""
    return any(ch.isalnum() for ch in text)


def validate_params(info: EngineInfo, params: SynthesisParams) -> None:
    """Refuse what the engine cannot honour instead of ignoring it. Raises :class:`EngineError`.

    The session calls this before any engine work, and engines call it again in ``open`` as their own guard.
    """
    caps = info.capabilities
    if params.voice not in info.voice_ids():
        raise EngineError(
            "unknown_voice", unknown_voice_message(params.voice, info.voice_ids(), info.voice_aliases()), "voice"
        )
    if not MIN_SPEED <= params.speed <= MAX_SPEED:
        raise EngineError("invalid_speed", f"speed must be within {MIN_SPEED}..{MAX_SPEED}", "speed")
    if params.speed != 1.0 and not caps.speed:
        raise EngineError("unsupported", f"the {info.family} engine cannot change speed", "speed")
    if params.max_audio_ms <= 0:
        raise EngineError("invalid_value", "max_audio_ms must be positive", "max_audio_ms")
    if params.instructions and not caps.instructions:
        raise EngineError("unsupported", f"the {info.family} engine takes no instructions", "instructions")
    if params.language is not None:
        tag = params.language.replace("_", "-").lower()
        supported = {lang.lower() for lang in caps.languages}
        if tag not in supported and tag.partition("-")[0] not in supported:
            raise EngineError(
                "unsupported_language",
                f"language {params.language!r} is not served; available: {', '.join(caps.languages)}",
                "language",
            )
