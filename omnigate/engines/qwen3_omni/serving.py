"""Qwen3-Omni as the gateway serves it: ``omnigate serve --engine qwen3-omni`` answers ``/v1/realtime`` sessions.

:class:`Qwen3OmniServing` is the engine the pool holds. The model answers a conversation by itself (text and its own
voice), so the speech stream contract (text in, speech out) is refused, typed, naming the route it serves; realtime
sessions call :meth:`Qwen3OmniServing.answer` (the :class:`~omnigate.engines.answering.AnsweringEngine` API), through
:mod:`omnigate.gateway.realtime.answer_backend`: a conversation (text, and user audio encoded by
:meth:`Qwen3OmniServing.encode_audio`, batched with the other sessions' turns) becomes a thinker prompt for the
turns' worker (:class:`~omnigate.engines.qwen3_omni.engine.Qwen3OmniEngine`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from omnigate.engines.answering import AnswerHandle, AnswerSink, PromptTurn, TurnHearing
from omnigate.engines.base import (
    Engine,
    EngineCapabilities,
    EngineError,
    EngineInfo,
    EngineOutput,
    EngineStream,
    SynthesisParams,
    VoiceInfo,
)
from omnigate.engines.qwen3_omni.audio_ahead import TurnAhead
from omnigate.engines.qwen3_omni.encoder_stats import EncoderStats
from omnigate.engines.qwen3_omni.engine import Qwen3OmniEngine, TurnAudio, TurnEnd, TurnOutput, TurnText
from omnigate.engines.qwen3_omni.runner import TurnRequest

FAMILY = "qwen3-omni"
DEFAULT_SPEAKER = "ethan"
INPUT_RATE = 24_000  # a realtime session's user audio
NOT_TEXT = (
    "the qwen3-omni engine answers a conversation in its own voice: it serves WS /v1/realtime (spoken and text "
    "turns), not text-to-speech (/v1/audio/speech, /v1/audio/speech/stream)"
)


class Qwen3OmniServing(Engine):
    """The loaded Qwen3-Omni engine, started; sessions submit turns to :attr:`turns`."""

    def __init__(self, turns: Qwen3OmniEngine) -> None:
        self.turns = turns
        model = turns.model
        speakers = sorted(model.speakers) or [DEFAULT_SPEAKER]
        default = DEFAULT_SPEAKER if DEFAULT_SPEAKER in speakers else speakers[0]
        self.info = EngineInfo(
            family=FAMILY,
            model=model.name,
            sample_rate=turns.sample_rate,
            voices=tuple(VoiceInfo(id=s, name=s, description=f"{model.name} speaker") for s in speakers),
            default_voice=default,
            capabilities=EngineCapabilities(),
            max_sessions=turns.max_sessions,
            max_batch=turns.max_sessions,
            synthetic=model.random_weights,
        )
        thinker = model.config.thinker_config
        self._audio_start = int(thinker.audio_start_token_id)
        self._audio_token = int(thinker.audio_token_id)
        turns.start()

    @classmethod
    def load(cls, model: str | None, **options: str) -> Qwen3OmniServing:
        """``--model`` (``preset:NAME`` or a checkpoint directory) with the engine's ``-E`` options."""
        if model is None:
            raise ValueError("--engine qwen3-omni needs --model: preset:tiny, preset:qwen3-omni-30b-a3b or a directory")
        return cls(Qwen3OmniEngine.load(model, **options))

    # ---- the speech stream contract: refused ------------------------------------------------------------------

    def open(self, params: SynthesisParams) -> EngineStream:
        raise EngineError("unsupported", NOT_TEXT)

    def step(self, streams: Sequence[EngineStream], budget_ms: Sequence[float]) -> list[list[EngineOutput]]:
        raise EngineError("unsupported", NOT_TEXT)

    def close(self, stream: EngineStream) -> None:
        """Speech streams are never opened: nothing to release."""

    def shutdown(self) -> None:
        self.turns.stop()

    @property
    def encoder_stats(self) -> EncoderStats:
        """The input encoder's counters (``/metrics``): calls, and the frames and turns they carried."""
        return self.turns.encoder.stats

    # ---- conversations ----------------------------------------------------------------------------------------

    async def encode_audio(self, pcm: bytes) -> torch.Tensor:
        """Audio tokens of a user turn's 24 kHz s16le speech, encoded with the other sessions' waiting turns
        (:class:`~omnigate.engines.qwen3_omni.encoder.InputEncoder`); raises EngineError ``engine_busy`` when too
        many wait."""
        return await self.turns.encoder.audio(pcm, INPUT_RATE)

    def turn_ahead(self) -> TurnAhead | None:
        """A realtime user turn heard as it comes, its whole 8-s windows encoded meanwhile (-E audio_ahead=false:
        None, each turn encoded at its end)."""
        return self.turns.encoder.turn_ahead(INPUT_RATE) if self.turns.audio_ahead else None

    async def finish_turn(self, ahead: TurnHearing, pcm: bytes) -> torch.Tensor:
        """Audio tokens of the turn ``ahead`` heard, whose whole speech is ``pcm``: equal to :meth:`encode_audio` of
        ``pcm``."""
        assert isinstance(ahead, TurnAhead)
        return await self.turns.encoder.finish_turn(ahead, pcm)

    def answer(
        self,
        turns: Sequence[PromptTurn],
        sink: AnswerSink,
        *,
        instructions: str,
        speaker: str,
        max_tokens: int,
        max_frames: int,
        credit: int | None = None,
    ) -> AnswerHandle:
        """Submit the conversation's answer (at most ``max_tokens`` of text, ``max_frames`` codec frames of voice,
        ``credit`` frames before a grant: one audio chunk is one frame); raises EngineError ``engine_busy`` when every
        slot answers."""
        request = self.prompt(
            turns, instructions=instructions, speaker=speaker, max_tokens=max_tokens, max_frames=max_frames
        )
        return self.turns.submit(dataclasses.replace(request, credit=credit), lambda outputs: _deliver(outputs, sink))

    def prompt(
        self, turns: Sequence[PromptTurn], *, instructions: str, speaker: str, max_tokens: int, max_frames: int
    ) -> TurnRequest:
        """The thinker's prompt of a conversation, the assistant's answer opened, and how to answer it."""
        tok = self.turns.model.tokenizer
        ids: list[int] = []
        audio: list[torch.Tensor] = []
        if instructions:
            ids += tok.turn("system", tok.encode(instructions))
        for role, text, tokens in turns:
            content: list[int] = []
            if tokens is not None and tokens.shape[0]:
                # Qwen3-Omni's vocabulary puts <|audio_end|> right after <|audio_start|>.
                content += [self._audio_start, *[self._audio_token] * tokens.shape[0], self._audio_start + 1]
                audio.append(tokens)
            content += tok.encode(text)
            ids += tok.turn(role, content)
        ids += tok.open_assistant()
        return TurnRequest(
            prompt=ids,
            audio=torch.cat(audio) if audio else None,
            speaker=speaker,
            max_tokens=max_tokens,
            max_frames=max_frames,
        )


def _deliver(outputs: list[TurnOutput], sink: AnswerSink) -> None:
    for output in outputs:
        if isinstance(output, TurnText):
            sink.text(output.text)
        elif isinstance(output, TurnAudio):
            sink.audio(output.pcm, output.sample_rate)
        elif isinstance(output, TurnEnd):
            sink.end(output.reason, output.code, output.message)
