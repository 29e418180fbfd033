"""The batched generation loop of Qwen3-Omni, without threads: every session's turn advances one step at a time.

A step (:meth:`TurnRunner.step`) admits waiting turns (their prompts prefilled into the thinker in ONE forward,
under a token budget, so answers in flight wait at most one such forward), advances every answer the thinker is
writing by one token in one padded decode step, starts the talker of every turn whose answer has its first token
(the talker's prompt needs only that one: the chunked handoff between the stages), and advances every talker that
has its next text row by one audio frame (first codebook, code predictor, talker) in one padded frame step. A
talker consumes the answer one token per frame; when it catches up with a thinker still writing, it waits a step.

A turn may carry credit (:attr:`TurnRequest.credit`, raised by :meth:`TurnRunner.grant`): the audio frames it may
make in all. A turn whose frames reached its credit is paused: neither its thinker nor its talker steps (its slot and
Code2Wav row stay) until credit returns, so a session whose client is behind holds a fixed amount of audio, not the
engine's lead over real time.

What a step returns (:class:`TurnEvent`) is what the engine hands to sessions: text tokens, codec frames, and one
:class:`TurnDone` per turn. Sampling draws from each turn's own seeded generator, so a turn's tokens do not depend
on which others share its steps.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from omnigate.engines.kv.slots import ContextFull
from omnigate.engines.qwen3_omni.model import Qwen3OmniModel
from omnigate.engines.qwen3_omni.vision import FrameTokens

# Prompt tokens prefilled per step (at least one turn's).
PREFILL_TOKENS_PER_STEP = 8192
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


@dataclass(frozen=True)
class TurnRequest:
    """One answer: the thinker's prompt (the conversation up to the open assistant turn) and how to answer."""

    prompt: list[int]
    audio: torch.Tensor | None = None  # audio tokens at the prompt's audio placeholders, in order
    frames: tuple[FrameTokens, ...] = ()  # vision tokens of the prompt's image placeholder runs, in order
    speak: bool = True
    speaker: str = "ethan"
    max_tokens: int = 512
    temperature: float = 0.0  # the thinker's; 0 is greedy
    talker_temperature: float = 0.0
    max_frames: int = 4096
    seed: int = 0
    credit: int | None = None  # audio frames it may make before a grant (None: unbounded)


@dataclass(frozen=True)
class TextToken:
    token: int


@dataclass(frozen=True, eq=False)
class AudioFrame:
    codes: list[int]  # one id per codebook
    audio: np.ndarray  # float32 [samples_per_frame] at 24 kHz: the stream's next samples


@dataclass(frozen=True)
class TurnDone:
    reason: str  # "stop", "length", "max_context", "cancelled", or an error code
    error: str | None = None


@dataclass(frozen=True)
class TurnEvent:
    turn: int
    event: TextToken | AudioFrame | TurnDone


@dataclass(eq=False)
class _Turn:
    id: int
    request: TurnRequest
    generator: torch.Generator
    slot: int = -1
    row: int = -1  # the Code2Wav row of a turn that speaks
    text: list[int] = field(default_factory=list)
    thinking: bool = True
    thinker_logits: torch.Tensor | None = None
    user_rows: torch.Tensor | None = None
    talker_logits: torch.Tensor | None = None
    talker_hidden: torch.Tensor | None = None
    frames: int = 0
    text_reason: str = "stop"
    voice_done: bool = False  # the talker said its end of speech (or ran out of frames) before the text ended
    cancelled: bool = False
    credit: int | None = None  # the frames it may make in all (None: unbounded)

    @property
    def paused(self) -> bool:
        """Its voice reached its credit: it waits for a grant."""
        return self.credit is not None and not self.voice_done and self.frames >= self.credit


class TurnRunner:
    """Runs turns on ``model``; not thread-safe (one worker thread calls everything)."""

    def __init__(self, model: Qwen3OmniModel, *, prefill_tokens: int = PREFILL_TOKENS_PER_STEP) -> None:
        self.model = model
        self.prefill_tokens = prefill_tokens
        self._ids = itertools.count()
        self._pending: list[_Turn] = []
        self._running: list[_Turn] = []
        self._free = list(range(model.slots))[::-1]
        self.steps = 0

    @property
    def busy(self) -> bool:
        return bool(self._pending or self._running)

    @property
    def ready(self) -> bool:
        """A step would do something: a turn waits to start, or one running is not paused."""
        return bool(self._pending) or any(not t.paused for t in self._running)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def submit(self, request: TurnRequest) -> int:
        """Queue a turn; its id names its events."""
        generator = torch.Generator()
        generator.manual_seed(request.seed)
        turn = _Turn(id=next(self._ids), request=request, generator=generator, credit=request.credit)
        self._pending.append(turn)
        return turn.id

    def cancel(self, turn_id: int) -> None:
        """Stop a turn at once: it produces nothing more, not even its :class:`TurnDone`."""
        for turn in itertools.chain(self._pending, self._running):
            if turn.id == turn_id:
                turn.cancelled = True

    def grant(self, turn_id: int, frames: int) -> None:
        """Let a turn make ``frames`` audio frames in all (a cumulative limit: a lower one changes nothing)."""
        for turn in itertools.chain(self._pending, self._running):
            if turn.id == turn_id and turn.credit is not None:
                turn.credit = max(turn.credit, frames)

    @torch.inference_mode()  # where the captured graphs' buffers and the codec's row states were made
    def drop_all(self) -> None:
        """Forget every turn (after a failed step), returning their slots and Code2Wav rows."""
        for turn in [*self._pending, *self._running]:
            self._release(turn)
        self._pending = []

    @torch.inference_mode()  # as drop_all: the Code2Wav push and close write buffers made in inference mode
    def step(self) -> list[TurnEvent]:
        """One step of every turn; the events it made, in order."""
        events: list[TurnEvent] = []
        self._drop_cancelled()
        self._admit(events)
        self._think(events)
        self._start_talkers(events)
        self._speak(events)
        self.steps += 1
        return events

    # ------------------------------------------------------------------

    def _release(self, turn: _Turn) -> None:
        if turn in self._running:
            self._running.remove(turn)
        if turn.slot >= 0:
            self._free.append(turn.slot)
            turn.slot = -1
        if turn.row >= 0:
            self.model.code2wav.close(turn.row)
            turn.row = -1

    def _finish(self, turn: _Turn, done: TurnDone, events: list[TurnEvent]) -> None:
        self._release(turn)
        events.append(TurnEvent(turn.id, done))

    def _drop_cancelled(self) -> None:
        self._pending = [t for t in self._pending if not t.cancelled]
        for turn in [t for t in self._running if t.cancelled]:
            self._release(turn)

    def _admit(self, events: list[TurnEvent]) -> None:
        model = self.model
        batch: list[_Turn] = []
        budget = self.prefill_tokens
        while self._pending and self._free:
            turn = self._pending[0]
            length = len(turn.request.prompt)
            if length + 1 > model.max_context:
                self._pending.pop(0)
                message = f"the turn's prompt is {length} tokens; the context holds {model.max_context}"
                events.append(TurnEvent(turn.id, TurnDone(CONTEXT_LENGTH_EXCEEDED, message)))
                continue
            if batch and length > budget:
                break
            self._pending.pop(0)
            turn.slot = self._free.pop()
            budget -= length
            batch.append(turn)
        if not batch:
            return
        inputs = [model.prompt_inputs(t.request.prompt, t.request.audio, t.request.frames) for t in batch]
        keep = any(t.request.speak and (t.request.audio is not None or t.request.frames) for t in batch)
        logits, hidden = model.thinker_prefill([t.slot for t in batch], inputs, keep=keep)
        for i, turn in enumerate(batch):
            turn.thinker_logits = logits[i]
            if turn.request.speak:
                turn.row = model.code2wav.open()
                turn.user_rows = model.talker_user_rows(
                    turn.request.prompt, inputs[i].rows, None if hidden is None else hidden[i]
                )
            self._running.append(turn)

    def _uniform(self, turn: _Turn, count: int = 1) -> list[float]:
        values: list[float] = torch.rand(count, generator=turn.generator, dtype=torch.float64).tolist()
        return values

    def _think(self, events: list[TurnEvent]) -> None:
        model = self.model
        thinking = [t for t in self._running if t.thinking and not t.paused]
        if not thinking:
            return
        targets: list[int | None] = []
        for turn in thinking:
            room = model.thinker_cache.length(turn.slot) + 1 < model.max_context
            more = len(turn.text) + 1 < turn.request.max_tokens
            targets.append(turn.slot if room and more else None)
        logits = [t.thinker_logits for t in thinking if t.thinker_logits is not None]
        uniforms = [self._uniform(t)[0] for t in thinking]
        ids, following = model.thinker_step(logits, [t.request.temperature for t in thinking], uniforms, targets)
        going: list[int] = []
        for i, (turn, token) in enumerate(zip(thinking, ids, strict=True)):
            turn.text.append(token)
            events.append(TurnEvent(turn.id, TextToken(token)))
            if token == model.tokenizer.im_end:
                turn.text_reason = "stop"
            elif targets[i] is None:
                turn.text_reason = "length" if len(turn.text) >= turn.request.max_tokens else "max_context"
            else:
                going.append(turn.slot)
                turn.thinker_logits = following[i]
                continue
            turn.thinking = False
            turn.thinker_logits = None
            if not turn.request.speak or turn.voice_done:
                self._finish(turn, TurnDone(turn.text_reason), events)
        model.thinker_cache.commit(going, [1] * len(going))

    def _start_talkers(self, events: list[TurnEvent]) -> None:
        model = self.model
        starting = [t for t in self._running if t.request.speak and t.user_rows is not None and t.text]
        if not starting:
            return
        prompts = []
        for turn in starting:
            assert turn.user_rows is not None
            prompts.append(
                model.talker_prompt(turn.user_rows, [*turn.request.prompt[-3:], turn.text[0]], turn.request.speaker)
            )
        ready: list[_Turn] = []
        ready_prompts: list[torch.Tensor] = []
        for turn, prompt in zip(starting, prompts, strict=True):
            turn.user_rows = None
            if prompt.shape[0] + 1 > model.max_context:
                message = f"the talker's prompt is {prompt.shape[0]} rows; the context holds {model.max_context}"
                self._finish(turn, TurnDone(CONTEXT_LENGTH_EXCEEDED, message), events)
            else:
                ready.append(turn)
                ready_prompts.append(prompt)
        if not ready:
            return
        positions = [
            model.talker_positions(t.request.prompt, t.request.frames, int(p.shape[0])) if t.request.frames else None
            for t, p in zip(ready, ready_prompts, strict=True)
        ]
        try:
            logits, hidden = model.talker_prefill([t.slot for t in ready], ready_prompts, positions)
        except ContextFull as exc:  # checked above; a defensive end rather than a dead worker
            for turn in ready:
                self._finish(turn, TurnDone(CONTEXT_LENGTH_EXCEEDED, str(exc)), events)
            return
        for i, turn in enumerate(ready):
            turn.talker_logits, turn.talker_hidden = logits[i], hidden[i]

    def _text_row(self, turn: _Turn) -> torch.Tensor | None:
        """The text row of the turn's next frame, or None while the thinker has not written it yet."""
        index = turn.frames + 1
        if index < len(turn.text):
            return self.model.trailing_text(turn.text[index], end=False)
        if turn.thinking:
            return None
        return self.model.trailing_text(None, end=index == len(turn.text))

    def _speak(self, events: list[TurnEvent]) -> None:
        model = self.model
        speaking: list[_Turn] = []
        rows: list[torch.Tensor] = []
        for turn in self._running:
            if turn.talker_logits is None or turn.paused:
                continue
            row = self._text_row(turn)
            if row is not None:
                speaking.append(turn)
                rows.append(row)
        if not speaking:
            return
        targets: list[int | None] = []
        for turn in speaking:
            room = model.talker_cache.length(turn.slot) + 1 < model.max_context
            targets.append(turn.slot if room and turn.frames + 1 < turn.request.max_frames else None)
        padded = model.pad_frame_rows(
            [t.request.talker_temperature for t in speaking],
            [self._uniform(t, model.groups) for t in speaking],
            targets,
        )
        logits = [t.talker_logits for t in speaking if t.talker_logits is not None]
        hidden = [t.talker_hidden for t in speaking if t.talker_hidden is not None]
        codes, following, normed = model.talker_frame(logits, hidden, rows, padded)
        voiced = [i for i in range(len(speaking)) if codes[i][0] != model.codec_eos]
        audio = np.zeros((0, 0), np.float32)
        if voiced:
            frame_codes = torch.tensor([codes[i] for i in voiced], dtype=torch.long)[:, :, None]
            audio = model.code2wav.push([speaking[i].row for i in voiced], frame_codes).float().cpu().numpy()
        at = {i: n for n, i in enumerate(voiced)}
        going: list[int] = []
        for i, turn in enumerate(speaking):
            if codes[i][0] == model.codec_eos:
                self._end_voice(turn, turn.text_reason, events)
                continue
            events.append(TurnEvent(turn.id, AudioFrame(codes[i], audio[at[i]])))
            turn.frames += 1
            if targets[i] is None:
                self._end_voice(turn, "max_context" if turn.frames < turn.request.max_frames else "length", events)
                continue
            going.append(turn.slot)
            turn.talker_logits, turn.talker_hidden = following[i], normed[i]
        model.talker_cache.commit(going, [1] * len(going))

    def _end_voice(self, turn: _Turn, reason: str, events: list[TurnEvent]) -> None:
        """The talker is done; the turn ends with it unless the thinker is still writing the transcript (the
        answer's text is kept whole, as transformers' ``generate`` writes it before the talker starts)."""
        turn.voice_done = True
        turn.talker_logits = turn.talker_hidden = None
        if turn.row >= 0:
            self.model.code2wav.close(turn.row)
            turn.row = -1
        if not turn.thinking:
            self._finish(turn, TurnDone(reason), events)
