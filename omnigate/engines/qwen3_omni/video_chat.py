"""Live video chat on Qwen3-Omni (``serve --engine qwen3-omni``): camera frames and the microphone into the thinker,
the answer in text and the model's own voice, with no second speech engine.

:class:`Qwen3VideoChat` is the engine API the video-chat routes use (what :class:`~omnigate.engines.omni.engine.
OmniEngine` offers them), on the turns engine the realtime route shares (:class:`~omnigate.engines.qwen3_omni.engine.
Qwen3OmniEngine`). A question's frames are encoded by the thinker's vision encoder, except those whose vision tokens
the session's :class:`~omnigate.engines.omni.request.EncoderCache` holds (an unchanged camera picture is not encoded
again; the cache is bounded by its entries) or that an earlier question of the session is encoding still (awaited,
not encoded twice); its audio by the thinker's audio encoder; both on the turns engine's
:class:`~omnigate.engines.qwen3_omni.encoder.InputEncoder`, with every session's waiting inputs. The
prompt is the session's history (Qwen chat markup, :class:`Qwen3PromptFormat`), then the user turn: each frame as
``<|vision_start|>`` + its image placeholders + ``<|vision_end|>``, the audio as ``<|audio_start|>`` + its
placeholders + ``<|audio_end|>``, the question's text. The answer's text and voice stream back as
:class:`~omnigate.engines.omni.request.TextDelta` and :class:`~omnigate.engines.omni.request.AudioDelta`, and one
:class:`~omnigate.engines.omni.request.ThinkDone` once both have ended.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from omnigate.engines.base import EngineError
from omnigate.engines.omni.request import (
    AudioDelta,
    EncoderCache,
    FrameInput,
    OmniInfo,
    TextDelta,
    ThinkDone,
    ThinkOutput,
    ThinkRequest,
    ThinkSink,
    ThinkStop,
)
from omnigate.engines.qwen3_omni.engine import Qwen3OmniEngine, TurnAudio, TurnEnd, TurnOutput, TurnText
from omnigate.engines.qwen3_omni.runner import TurnRequest
from omnigate.engines.qwen3_omni.tokenizer import ChatTokenizer
from omnigate.engines.qwen3_omni.vision import FrameTokens

log = logging.getLogger(__name__)

FRAME_SIZE = 384  # frames are resized to this square: 12 x 12 merged patches, 144 vision tokens a frame
AUDIO_RATE = 16_000  # a question's audio (the video-chat protocol's microphone rate, the encoder's)
DEFAULT_SPEAKER = "ethan"
# Speech of a text token takes about 4 codec frames: twice that bounds an answer's voice (a random-weights voice
# may not end by itself), and no answer speaks longer than this many frames (164 s at 12.5 frames a second).
FRAMES_PER_TOKEN = 8
MAX_ANSWER_FRAMES = 2048
_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>\n", re.DOTALL)
_STOPS: dict[str, ThinkStop] = {"stop": "completed", "length": "max_tokens", "max_context": "max_context"}


class Qwen3PromptFormat:
    """The video-chat session's prompt text in Qwen's chat markup, and its ids for Qwen3-Omni's tokenizer (the
    markup's role and end ids are the model's own, whatever the tokenizer)."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tok = tokenizer

    def chat_prefix(self, system: str) -> str:
        return self.turn("system", system)

    def turn(self, role: str, text: str) -> str:
        return f"<|im_start|>{role}\n{text}<|im_end|>\n"

    def count(self, text: str) -> int:
        return len(self.ids(text))

    def ids(self, text: str) -> list[int]:
        """Ids of text written by :meth:`chat_prefix` and :meth:`turn` (text outside any turn as plain text)."""
        ids: list[int] = []
        start = 0
        for match in _TURN.finditer(text):
            ids += self._tok.encode(text[start : match.start()])
            role = match.group(1)
            if role in ("system", "user", "assistant"):
                ids += self._tok.turn(role, self._tok.encode(match.group(2)))
            else:
                ids += self._tok.encode(match.group(0))
            start = match.end()
        return ids + self._tok.encode(text[start:])


@dataclass(frozen=True)
class PromptView:
    """What the session's state machine reads of the model: how prompts are written and counted."""

    tokenizer: Qwen3PromptFormat


@dataclass(eq=False)
class VideoChatTurn:
    """One question being answered; ``cancel`` stops it at once (nothing more reaches its sink)."""

    sink: ThinkSink
    cancelled: bool = False
    handle: Any = None  # the turns engine's TurnHandle once submitted
    task: asyncio.Task[None] | None = None
    deltas: int = 0
    ended: bool = False

    def cancel(self) -> None:
        self.cancelled = True
        if self.handle is not None:
            self.handle.cancel()
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def end(self, done: ThinkDone) -> None:
        if not (self.cancelled or self.ended):
            self.ended = True
            self.sink([done])

    def deliver(self, outputs: list[TurnOutput]) -> None:
        if self.cancelled or self.ended:
            return
        out: list[ThinkOutput] = []
        for output in outputs:
            if isinstance(output, TurnText):
                self.deltas += 1
                out.append(TextDelta(output.text))
            elif isinstance(output, TurnAudio):
                out.append(AudioDelta(output.pcm, output.sample_rate))
            elif isinstance(output, TurnEnd):
                self.ended = True
                reason: ThinkStop = _STOPS.get(output.reason, "error")
                error = None if reason != "error" else (output.message or "the answer failed")
                # ``tokens``: the text pieces streamed (a piece is a token, or a few that made whole characters).
                out.append(ThinkDone(reason, output.text, self.deltas, error, output.code))
        if out:
            self.sink(out)


class Qwen3VideoChat:
    """Video-chat questions answered by a running :class:`Qwen3OmniEngine` (owned by the engine pool: this object
    neither starts nor stops it)."""

    def __init__(self, turns: Qwen3OmniEngine, *, frame_size: int = FRAME_SIZE) -> None:
        model = turns.model
        side = model.patch * model.merge
        if frame_size < side or frame_size % side:
            raise ValueError(f"frame_size {frame_size} must be a positive multiple of {side} pixels")
        self.turns = turns
        self.grid = (frame_size // side, frame_size // side)
        self.info = OmniInfo(
            model=model.name,
            max_sessions=turns.max_sessions,
            frame_size=frame_size,
            tokens_per_frame=self.grid[0] * self.grid[1],
            random_weights=model.random_weights,
            voiced=True,
        )
        self.model = PromptView(Qwen3PromptFormat(model.tokenizer))
        self.stats = None  # the thinker's loop is the turns engine's, reported with the realtime route's
        thinker = model.config.thinker_config
        self._image = int(thinker.image_token_id)
        self._vision_start = int(thinker.vision_start_token_id)
        self._audio = int(thinker.audio_token_id)
        self._audio_start = int(thinker.audio_start_token_id)
        self.frames_encoded_total = 0
        self.frames_reused_total = 0  # from a session's cache, or from its earlier question's encode in flight
        # Per session (its cache), the frames being encoded: a digest's task gives the frame's vision tokens.
        self._encoding: weakref.WeakKeyDictionary[EncoderCache, dict[bytes, asyncio.Task[torch.Tensor]]] = (
            weakref.WeakKeyDictionary()
        )

    def start(self) -> None:
        """The turns engine runs already (the pool started it)."""

    def stop(self) -> None:
        """The pool stops the turns engine."""

    def encode_ahead(self, frame: FrameInput, cache: EncoderCache) -> None:
        """Nothing ahead: a question's missing frames are encoded when it is asked, with every session's waiting
        inputs."""

    def forget_frames(self, cache: EncoderCache) -> None:
        """No frames wait to be encoded ahead (see :meth:`encode_ahead`)."""

    def submit(self, request: ThinkRequest, sink: ThinkSink) -> VideoChatTurn:
        """Start answering ``request`` (its frames and audio are encoded first, off the loop); a refusal
        (``engine_busy``, an unknown voice, a prompt longer than the context) comes to ``sink`` as a typed
        :class:`ThinkDone` error."""
        turn = VideoChatTurn(sink)
        turn.task = asyncio.create_task(self._answer(turn, request), name="qwen3-video-chat-question")
        turn.task.add_done_callback(lambda task: self._ended(turn, task))
        return turn

    @staticmethod
    def _ended(turn: VideoChatTurn, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        log.error("a qwen3-omni video-chat question failed", exc_info=error)
        turn.end(ThinkDone("error", "", 0, f"{type(error).__name__}: {error}", "internal_error"))

    async def _answer(self, turn: VideoChatTurn, request: ThinkRequest) -> None:
        model = self.turns.model
        speaker = (request.voice or DEFAULT_SPEAKER).lower()
        if request.speak and speaker not in model.speakers:
            voices = ", ".join(sorted(model.speakers))
            turn.end(
                ThinkDone("error", "", 0, f"unknown voice {request.voice!r}; choose one of {voices}", "invalid_voice")
            )
            return
        try:
            found, audio = await asyncio.gather(self._frame_tokens(request), self._audio_tokens(request.audio))
        except EngineError as exc:
            turn.end(ThinkDone("error", "", 0, exc.message, exc.code))
            return
        if turn.cancelled:
            return
        frames = tuple(FrameTokens(t, self.grid) for t in found)
        tok = model.tokenizer
        content: list[int] = []
        for frame in frames:
            # Qwen3-Omni's vocabulary puts <|vision_end|> right after <|vision_start|>, <|audio_end|> after
            # <|audio_start|>.
            content += [self._vision_start, *[self._image] * frame.count, self._vision_start + 1]
        if audio is not None:
            content += [self._audio_start, *[self._audio] * audio.shape[0], self._audio_start + 1]
        content += tok.encode(request.question)
        prompt = self.model.tokenizer.ids(request.context) + tok.turn("user", content) + tok.open_assistant()
        images = sum(f.count for f in frames)
        sounds = 0 if audio is None else int(audio.shape[0])
        if prompt.count(self._image) != images or prompt.count(self._audio) != sounds:
            # A tokenizer that reads special tokens in text turned the question or history into media placeholders.
            message = "the question or the history holds the model's image or audio placeholder tokens"
            turn.end(ThinkDone("error", "", 0, message, "invalid_request"))
            return
        answer = TurnRequest(
            prompt=prompt,
            audio=audio,
            frames=frames,
            speak=request.speak,
            speaker=speaker,
            max_tokens=request.max_new_tokens,
            temperature=request.temperature,
            max_frames=min(FRAMES_PER_TOKEN * request.max_new_tokens, MAX_ANSWER_FRAMES),
            seed=request.seed,
        )
        try:
            turn.handle = self.turns.submit(answer, turn.deliver)
        except EngineError as exc:
            turn.end(ThinkDone("error", "", 0, exc.message, exc.code))

    async def _frame_tokens(self, request: ThinkRequest) -> list[torch.Tensor]:
        """Vision tokens of the question's frames: from the session's cache, from an encode of the session in flight,
        or encoded now (the frames no one encodes yet, in one request)."""
        cache = request.cache
        encoding = self._encoding.setdefault(cache, {}) if cache is not None else {}
        cached = [cache.get(f.digest) if cache is not None else None for f in request.frames]
        new = {f.digest: f.pixels for f, t in zip(request.frames, cached, strict=True) if t is None}
        new = {digest: pixels for digest, pixels in new.items() if digest not in encoding}
        if new:
            batch = asyncio.ensure_future(self.turns.encoder.frames(list(new.values())))
            for k, digest in enumerate(new):
                task = asyncio.create_task(self._one_frame(batch, k, cache, digest), name="qwen3-video-chat-frame")
                task.add_done_callback(functools.partial(self._encoded, encoding, digest))
                encoding[digest] = task
        sources: list[torch.Tensor | asyncio.Task[torch.Tensor]] = []
        for frame, held in zip(request.frames, cached, strict=True):
            if held is None and new.pop(frame.digest, None) is not None:
                self.frames_encoded_total += 1
            else:
                self.frames_reused_total += 1
            sources.append(held if held is not None else encoding[frame.digest])
        # Shielded: this question giving up does not cancel an encode another question of the session awaits.
        return [s if isinstance(s, torch.Tensor) else await asyncio.shield(s) for s in sources]

    @staticmethod
    async def _one_frame(
        batch: asyncio.Future[list[torch.Tensor]], k: int, cache: EncoderCache | None, digest: bytes
    ) -> torch.Tensor:
        tokens = (await batch)[k]
        if cache is not None:
            cache.put(digest, tokens)
        return tokens

    @staticmethod
    def _encoded(
        encoding: dict[bytes, asyncio.Task[torch.Tensor]], digest: bytes, task: asyncio.Task[torch.Tensor]
    ) -> None:
        if encoding.get(digest) is task:
            del encoding[digest]
        if not task.cancelled():
            task.exception()  # (retrieved: the questions awaiting it, if any still do, raise it themselves)

    async def _audio_tokens(self, pcm: bytes) -> torch.Tensor | None:
        """Audio tokens of the question's 16 kHz s16le audio (None without any)."""
        if not pcm:
            return None
        return await self.turns.encoder.audio(pcm, AUDIO_RATE)
