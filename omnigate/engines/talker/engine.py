"""The talker engine: CSM-style codec-token TTS with continuous batching and exact streaming codec decoding.

Each :meth:`TalkerEngine.step` advances every stream of the batch by at most one codec frame (80 ms for Mimi):

1. streams starting a text unit extend their slot's context with the unit's tokens, all of them in one prefill
   forward over the flattened tokens (on a GPU, a CUDA graph bucketed by token count);
2. one device step (:class:`~omnigate.engines.talker.frame_step.FrameStep`, a CUDA graph per batch-size bucket on a
   GPU) runs the backbone one position on for the streams mid-unit, samples codebook 0 and the residual codebooks for
   every row, decodes each new frame through the streaming Mimi decoder and converts it to s16 PCM;
3. frames collect per stream as PCM and leave in chunks that ramp 1, 2, 4, 8 frames.

With ``overlap_steps`` (the default on CUDA) a step's device work overlaps the host work around it: a call waits
for the device step the previous call launched, files only what the next plan depends on (end-of-audio flags, frame
counts), plans and launches the next device step, and only then turns the previous step's frames into PCM chunks
and events, while the device runs. Outputs therefore leave one call after the frame was launched; the frames, chunks
and events of every stream are the same as without overlap. With ``file_ahead`` (the default) the filing too runs
before the wait, while the device computes the frames filed: each as an audio frame whose PCM and level are copied
after the next launch; between the wait and the launch only the rows whose frame ends their segment (the end-of-audio
frame, a cap) are settled. With ``plan_ahead`` (the default) the next step is planned before the wait too, for every
row whose plan the frames on the device cannot change; the rows settled after the wait, and those starting a unit
(in row order, from the prefill budget), are planned after it. What stays between the wait and the launch: settling
the rows whose segment ended, their plan, the prefill and the launch itself.

A stream never generates audio its credit cannot take: it advances only when its budget covers the frames it holds
plus one more, and flushes what it holds when it cannot. One stream is one utterance; each text unit becomes a
CSM segment spoken with the earlier segments' text and audio as context.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch

from omnigate.engines.base import (
    AudioChunk,
    Engine,
    EngineCapabilities,
    EngineError,
    EngineInfo,
    EngineOutput,
    EngineStream,
    SegmentDone,
    SegmentStarted,
    StopReason,
    StreamDone,
    SynthesisParams,
    UnitTokens,
    VoiceInfo,
    validate_params,
)
from omnigate.engines.codec.mimi_stream import MimiStreamDecoder, cast_for_decoding
from omnigate.engines.talker.context import ContextSegment, validate_context
from omnigate.engines.talker.frame_step import FrameStep, StepResult, StepRows
from omnigate.engines.talker.frames import CLOSING, FrameModel
from omnigate.engines.talker.model import TalkerModel, clear_codebook_cache, load_talker_model
from omnigate.engines.talker.options import TORCH_DTYPES, TalkerOptions
from omnigate.engines.talker.sampling import TokenSampler
from omnigate.engines.talker.schedule import ChunkSchedule
from omnigate.engines.talker.stopping import SilenceDetector, frame_limit
from omnigate.engines.talker.stream import Segment, TalkerStream

FAMILY = "talker"
log = logging.getLogger(__name__)
_SEED_MASK = (1 << 62) - 1
PRESET_MS_PER_CHAR = 60.0
STAGES = ("device_wait", "file", "plan", "launch", "emit")
"""Where a step's time goes: waiting for the device step; filing its frames (ends, frame counts); planning the next
(text tokenization included); launching it (prefill and device step, plus the wait without overlap); turning
frames into PCM chunks and events."""


class TalkerEngine(Engine):
    """Serves up to ``max_sessions`` concurrent utterances from one CSM model."""

    def __init__(self, model: TalkerModel, options: TalkerOptions) -> None:
        self.options = options
        self.model = model
        if options.threads is not None:
            torch.set_num_threads(options.threads)
        dtype = TORCH_DTYPES[options.dtype]
        codec_dtype = dtype if options.codec_dtype is None else TORCH_DTYPES[options.codec_dtype]
        csm = model.csm.to(torch.device(options.device))
        for name, child in csm.named_children():
            if name == "codec_model":
                # The codebooks never pass through a lower precision; only the decoder's layers run in it.
                cast_for_decoding(child, codec_dtype)
            else:
                child.to(dtype)
        clear_codebook_cache(csm.codec_model)
        config = csm.config
        self.codec = MimiStreamDecoder(csm.codec_model, options.max_sessions)
        if self.codec.num_codebooks < config.num_codebooks:
            raise ValueError("the codec has fewer codebooks than the talker predicts")
        capacity = options.max_context or int(config.max_position_embeddings)
        sampler = TokenSampler(
            temperature=options.temperature,
            top_k=options.top_k,
            valid_ids=min(int(config.vocab_size), self.codec.codebook_size),
            eos_id=int(config.codebook_eos_token_id),
            eos_bias=options.eos_bias,
            top_p=options.top_p,
            repetition_penalty=options.repetition_penalty,
            repetition_window=options.repetition_window,
        )
        self.frames = FrameModel(
            model, max_slots=options.max_sessions, max_batch=options.max_batch, capacity=capacity, sampler=sampler
        )
        graphs = options.cuda_graphs and self.frames.device.type == "cuda"
        self.device_step = FrameStep(self.frames, self.codec, max_batch=options.max_batch, graphs=graphs)
        graph_tokens = prefill_graph_tokens(options)
        if graphs and graph_tokens:
            prefills = self.frames.capture_prefill(graph_tokens)
            log.info(
                "talker prefill graphs: %d sizes up to %d tokens (step budget %d), %.0f MiB, captured in %.1f s",
                len(prefills.buckets),
                graph_tokens,
                options.prefill_tokens_per_step,
                prefills.pool_bytes / 2**20,
                prefills.capture_s,
            )
        # Step time by batch size, for admission to price rows with before any session stepped. A GPU's only: a CPU
        # step shares its cores with the rest of the machine, and one measurement at load would price every later
        # admission by whatever else ran then (CPU engines are priced by the steps they run, as before).
        profile: tuple[tuple[int, float], ...] = ()
        if self.frames.device.type == "cuda":
            profile = tuple(self.device_step.time_steps(_profile_sizes(options.max_batch)))
            log.info("talker step time by batch size: %s", ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in profile))
        self.schedule = ChunkSchedule(first=options.chunk_first_frames, cap=options.chunk_max_frames)
        self.sample_rate = self.codec.sample_rate
        self.frame_ms = self.codec.samples_per_frame * 1000.0 / self.sample_rate
        ms_per_char = options.segment_ms_per_char
        if ms_per_char is None:
            ms_per_char = PRESET_MS_PER_CHAR if model.random_weights else 0.0
        self.segment_ms_per_char = ms_per_char
        # Also held while the outputs of a stream outside the calling batch are filed, which close() may race with.
        self._slot_lock = threading.RLock()
        self.overlap_steps = (
            options.overlap_steps if options.overlap_steps is not None else self.frames.device.type == "cuda"
        )
        self.file_ahead = self.overlap_steps and options.file_ahead
        self.plan_ahead = self.file_ahead and options.plan_ahead
        self._in_flight: _InFlight | None = None
        # seconds of the steps by stage (see stage_seconds); written by the stepping thread only
        self._stages = dict.fromkeys(STAGES, 0.0)
        self._waited_s = 0.0
        self._free_slots = list(range(options.max_sessions - 1, -1, -1))
        self._opened = itertools.count()
        voices = tuple(VoiceInfo(id=str(i), name=f"Speaker {i}") for i in range(options.speakers))
        self.info = EngineInfo(
            family=FAMILY,
            model=model.name,
            sample_rate=self.sample_rate,
            voices=voices,
            default_voice=voices[0].id,
            capabilities=EngineCapabilities(),
            max_sessions=options.max_sessions,
            max_batch=options.max_batch,
            workers=1,
            synthetic=model.random_weights,
            min_credit_ms=self.frame_ms,
            step_profile=profile,
            unit_tokens=self._unit_tokens(),
        )

    def _unit_tokens(self) -> UnitTokens | None:
        """How gateway processes may tokenize text units for this model (its tokenizer, readable there)."""
        segments = self.model.segments
        if segments.source is None:
            return None
        vocab = int(self.model.csm.embed_text_tokens.num_embeddings)
        return UnitTokens("csm", segments.source, segments.bos_id, segments.eos_id, vocab)

    @classmethod
    def load(cls, model: str | None, **options: Any) -> TalkerEngine:
        """Build from ``--model`` (``preset:NAME`` or a checkpoint directory) and string or typed options."""
        try:
            parsed = msgspec.convert(options, TalkerOptions, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid talker option: {exc}") from None
        return cls(load_talker_model(model, seed=parsed.seed, device=parsed.device), parsed)

    @property
    def free_slots(self) -> int:
        """Slots not held by a live stream."""
        with self._slot_lock:
            return len(self._free_slots)

    # ---- stream lifecycle -----------------------------------------------------------------------------------

    def open(
        self, params: SynthesisParams, *, seed: int | None = None, context: Sequence[ContextSegment] = ()
    ) -> TalkerStream:
        """Create an utterance stream; ``seed`` fixes its sampling (default: derived from the engine seed).

        ``context`` holds earlier speech the utterance continues from (CSM's voice and prosody reference).
        """
        validate_params(self.info, params)
        validate_context(
            context,
            speakers=self.info.voice_ids(),
            sample_rate=self.sample_rate,
            max_audio_s=self.options.max_context_audio_s,
        )
        if self._context_tokens(context) >= self.frames.cache.capacity:
            raise EngineError("invalid_context", "the context does not fit the model's context window", "context")
        if seed is None:
            seed = (self.options.seed * 1_000_003 + next(self._opened)) & _SEED_MASK
        return TalkerStream(
            params,
            seed=seed & _SEED_MASK,
            frame_limit=frame_limit(params.max_audio_ms, self.frame_ms),
            silence=SilenceDetector(
                threshold_dbfs=self.options.silence_dbfs, seconds=self.options.silence_s, frame_ms=self.frame_ms
            ),
            context=tuple(context),
            unit_tokens=self.info.unit_tokens,
        )

    def _context_tokens(self, context: Sequence[ContextSegment]) -> int:
        per_frame = self.codec.samples_per_frame
        return sum(
            len(self.model.segments.encode(seg.speaker, seg.text)) + -(-len(seg.pcm) // (2 * per_frame)) + 1
            for seg in context
        )

    def _context_embeddings(self, context: Sequence[ContextSegment]) -> torch.Tensor:
        """``[T, hidden]``: each context segment's text, its audio encoded to frames, and an end-of-audio frame."""
        parts = []
        for segment in context:
            parts.append(self.frames.embed_text(self.model.segments.encode(segment.speaker, segment.text)))
            frames = torch.cat((self._encode_audio(segment.pcm), self.frames.end_of_audio()[None]))
            parts.append(self.frames.embed_frames(frames))
        return torch.cat(parts)

    def _encode_audio(self, pcm: bytes) -> torch.Tensor:
        """Codec frames ``[T, N]`` of mono s16le PCM at the codec's rate."""
        codec = self.model.csm.codec_model
        param = next(codec.parameters())
        samples = torch.from_numpy(np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0)
        audio = samples.to(device=param.device, dtype=param.dtype)[None, None]
        codes: torch.Tensor = codec.encode(audio, num_quantizers=self.frames.num_codebooks).audio_codes
        return codes[0].T.to(self.frames.device)

    def close(self, stream: EngineStream) -> None:
        ts = _talker_stream(stream)
        with self._slot_lock:
            ts.closed = True
            ts.outbox.clear()
            self._release(ts)

    def _release(self, stream: TalkerStream) -> None:
        with self._slot_lock:
            stream.pending.clear()
            stream.pending_rms.clear()
            stream.forget_tokens()
            if stream.slot is not None:
                self._free_slots.append(stream.slot)
                stream.slot = None

    def _acquire(self, stream: TalkerStream) -> int:
        if stream.slot is None:
            with self._slot_lock:
                if not self._free_slots:
                    raise EngineError("no_slot", "every talker slot is taken")
                stream.slot = self._free_slots.pop()
            # The codec and sampling state of the slot start clean inside the stream's first device step.
            self.frames.cache.reset(stream.slot)
        return stream.slot

    def _finish(self, stream: TalkerStream, reason: StopReason) -> None:
        stream.outbox.append(StreamDone(reason=reason))
        stream.finished = True
        self._release(stream)

    # ---- the step -----------------------------------------------------------------------------------------------

    def stage_seconds(self) -> dict[str, float]:
        """Seconds the steps spent in each of :data:`STAGES` since load."""
        return dict(self._stages)

    def step(self, streams: Sequence[EngineStream], budget_ms: Sequence[float]) -> list[list[EngineOutput]]:
        stages = self._stages
        t0 = time.perf_counter()
        batch = [_talker_stream(s) for s in streams]
        if len(budget_ms) != len(batch):
            raise ValueError(f"{len(budget_ms)} budgets for {len(batch)} streams")
        with torch.no_grad():
            flight, self._in_flight = self._in_flight, None
            ahead = None
            collected: StepResult | None = None
            deferred: list[tuple[TalkerStream, int, int]] = []
            if flight is not None:
                collected, deferred, ahead = self._collect(flight, batch, budget_ms)
            t1 = time.perf_counter()
            waited_collect = self._waited_s
            endings: dict[int, StopReason] = {}
            advancing, starting = self._plan(batch, budget_ms, endings, ahead)
            t2 = time.perf_counter()
            if advancing or starting:
                self._generate(batch, advancing, starting, endings)
            t3 = time.perf_counter()
            if collected is not None and deferred:
                frames = _FrameViews(collected.pcm)
                ended = collected.ended.tolist()
                rms = collected.rms.tolist()
                for stream, index, k in deferred:
                    if not (stream.finished or stream.closed or ended[k]):
                        stream.pending[index] = frames[k]
                        stream.pending_rms[index] = rms[k]
            self._emit_audio(batch, budget_ms, endings)
        for row, reason in endings.items():
            self._end_segment(batch[row], reason)
        outputs = []
        for stream in batch:
            outputs.append(stream.outbox)
            stream.outbox = []
        t4 = time.perf_counter()
        planned_ahead_s = 0.0 if ahead is None else ahead.seconds
        stages["file"] += t1 - t0 - waited_collect - planned_ahead_s
        stages["plan"] += t2 - t1 + planned_ahead_s
        stages["launch"] += t3 - t2 - (self._waited_s - waited_collect)
        stages["emit"] += t4 - t3
        stages["device_wait"] += self._waited_s
        self._waited_s = 0.0
        return outputs

    def _collect(
        self, flight: _InFlight, batch: list[TalkerStream], budget_ms: Sequence[float]
    ) -> tuple[StepResult, list[tuple[TalkerStream, int, int]], _AheadPlan | None]:
        """Wait for the device step the previous call launched and file what the next plan depends on. Returns its
        result; the frames whose PCM and RMS are still to be copied into their stream's held frames, as (stream,
        index in its held frames, row of the result): copied after the next launch, all rows in one pass, from the
        other host buffer than the one the next step writes (an end-of-audio row among them is skipped there); and
        the plan made while the device computed, if one was (:meth:`_plan_ahead`)."""
        rows = {id(stream): row for row, stream in enumerate(batch)}
        ahead = None
        if self.file_ahead:
            filed, deferred, settle = self._file_ahead(flight, rows)
            if self.plan_ahead:
                ahead = self._plan_ahead(batch, budget_ms, {rows[id(flight.streams[k])] for k in settle if k in filed})
            result = self._wait_for(flight.buffer)
            # Only the rows whose frame ends their segment, and those outside this call, are filed before the plan.
            order: Sequence[int] = sorted({*settle, *np.flatnonzero(result.ended).tolist()})
        else:
            filed, deferred = {}, []
            result = self._wait_for(flight.buffer)
            order = range(len(flight.streams))
        ended = result.ended.tolist()
        rms = result.rms.tolist()
        for k in order:
            stream = flight.streams[k]
            stream.in_flight = False
            row = rows.get(id(stream))
            if row is None:
                # Not in this call (the batch was full): close() may run meanwhile, so file it whole, under the lock.
                with self._slot_lock:
                    if not (stream.closed or stream.finished):
                        self._file_ending(stream, self._file_frame(stream, ended[k], _le_bytes(result.pcm[k]), rms[k]))
                continue
            if stream.closed or stream.finished:
                continue  # aborted, or finished by silence after this frame was launched: the frame is dropped
            if ahead is not None:
                ahead.settled.add(row)
            if k not in filed:
                ending = self._file_frame(stream, ended[k], None, rms[k])
            elif ended[k]:
                _unfile_frame(stream)  # not audio: the frame filed ahead as audio ends the segment instead
                ending = "completed"
            else:
                ending = filed[k]
            if ending is None:
                deferred.append((stream, len(stream.pending) - 1, k))
                continue
            if not ended[k]:
                stream.pending[-1] = _le_bytes(result.pcm[k])  # the frame is sent now, with the segment's end
                stream.pending_rms[-1] = rms[k]
            self._file_ending(stream, ending)
        return result, deferred, ahead

    def _file_ahead(
        self, flight: _InFlight, rows: dict[int, int]
    ) -> tuple[dict[int, StopReason | None], list[tuple[TalkerStream, int, int]], list[int]]:
        """File the frames still on the device of this call's streams as audio frames (placeholders for their PCM
        and RMS), while the device computes them. Returns what each filing returned, by row of the flight; the
        frames to copy after the next launch (as :meth:`_collect`); and the rows to settle after the wait: those
        whose filing ends their segment (a cap) and those outside this call. Rows whose frame turns out to be the
        end-of-audio frame are settled too."""
        filed: dict[int, StopReason | None] = {}
        deferred: list[tuple[TalkerStream, int, int]] = []
        settle: list[int] = []
        for k, stream in enumerate(flight.streams):
            if id(stream) not in rows:
                settle.append(k)
                continue
            stream.in_flight = False  # the pool reads it only between steps, when the frame is filed
            if stream.closed or stream.finished:
                continue
            ending = filed[k] = self._file_frame(stream, False, None, 0.0)
            if ending is None:
                deferred.append((stream, len(stream.pending) - 1, k))
            else:
                settle.append(k)
        return filed, deferred, settle

    def _wait_for(self, buffer: int) -> StepResult:
        """The device step's result, the time waited for it counted as the step's device wait."""
        started = time.perf_counter()
        result = self.device_step.collect(buffer)
        self._waited_s += time.perf_counter() - started
        return result

    def _file_ending(self, stream: TalkerStream, ending: StopReason | None) -> None:
        """Send what a stream holds and end its segment, for a frame that ended it (``None``: nothing ends)."""
        if ending is None:
            return
        self._emit(stream, None, ending=True)
        self._end_segment(stream, ending)

    def _plan_ahead(self, batch: list[TalkerStream], budget_ms: Sequence[float], settling: set[int]) -> _AheadPlan:
        """Plan, while the device still computes the frames filed ahead, the rows whose plan those frames cannot
        change: a row keeps its segment unless its frame turns out to end it, and then it is planned again after the
        wait (as are ``settling``, whose filing ends their segment, and rows without a segment: they start a unit,
        in row order, from the prefill budget)."""
        started = time.perf_counter()
        ahead = _AheadPlan()
        for row, (stream, budget) in enumerate(zip(batch, budget_ms, strict=True)):
            if stream.finished or stream.closed:
                continue
            if stream.segment is None or row in settling:
                ahead.rest.append(row)
            elif budget >= (len(stream.pending) + 1) * self.frame_ms:
                if self.frames.cache.length(_slot(stream)) >= self.frames.cache.capacity:
                    ahead.endings[row] = "max_duration"
                else:
                    ahead.advancing.append(row)
        ahead.seconds = time.perf_counter() - started
        return ahead

    def _plan(
        self,
        batch: list[TalkerStream],
        budget_ms: Sequence[float],
        endings: dict[int, StopReason],
        ahead: _AheadPlan | None = None,
    ) -> tuple[list[int], list[tuple[int, _PrefillUnit]]]:
        """Rows that advance one frame, and rows that start a unit this step with what they prefill (with ``ahead``:
        its decisions, and the rows it left or whose frame settled after it, planned now)."""
        advancing: list[int] = []
        starting: list[tuple[int, _PrefillUnit]] = []
        prefill_tokens = 0
        rows: Sequence[int] = range(len(batch))
        if ahead is not None:
            settled = ahead.settled
            endings.update((row, end) for row, end in ahead.endings.items() if row not in settled)
            rows = sorted({*ahead.rest, *settled})
        for row in rows:
            stream, budget = batch[row], budget_ms[row]
            if stream.finished or stream.closed:
                continue
            if stream.segment is None:
                room = self.options.prefill_tokens_per_step - prefill_tokens if starting else None
                unit = self._start_segment(stream, budget, room)
                if unit is not None:
                    starting.append((row, unit))
                    prefill_tokens += unit.size
            elif budget >= (len(stream.pending) + 1) * self.frame_ms:
                if self.frames.cache.length(_slot(stream)) >= self.frames.cache.capacity:
                    endings[row] = "max_duration"  # the context window is full: nothing more can follow
                else:
                    advancing.append(row)
        if ahead is not None:
            settled = ahead.settled
            kept = [row for row in ahead.advancing if row not in settled] if settled else ahead.advancing
            advancing = sorted([*kept, *advancing]) if advancing else kept
        return advancing, starting

    def _start_segment(self, stream: TalkerStream, budget: float, room: int | None) -> _PrefillUnit | None:
        """Begin the next text unit when credit allows and its tokens fit in ``room`` (None: any size); returns
        what to prefill."""
        while stream.pending_text and not stream.pending_text[0].strip():
            stream.pending_text.pop(0)  # a blank unit has nothing to say
        if not stream.pending_text:
            if stream.input_done:
                self._finish(stream, "completed")
            return None
        if budget < self.frame_ms:
            return None
        if stream.audio_frames >= stream.frame_limit:
            self._finish(stream, "max_duration")
            return None
        text = stream.pending_text[0]
        if stream.head_tokens is None or stream.head_tokens[0] is not text:
            given = stream.take_tokens(text)
            if given is None:
                given = self.model.segments.encode(stream.params.voice, text)
            stream.head_tokens = (text, given)
        tokens = stream.head_tokens[1]
        if room is not None and len(tokens) + 1 > room:
            return None  # this step's prefill is full; the unit starts next step, its tokens kept
        slot = self._acquire(stream)
        stream.pending_text.pop(0)
        stream.head_tokens = None
        context = None
        if stream.has_context:
            tokens = [CLOSING, *tokens]
        elif stream.context:
            context = self._context_embeddings(stream.context)
            stream.context = ()
        unit = _PrefillUnit(context, tokens)
        if self.frames.cache.length(slot) + unit.size > self.frames.cache.capacity:
            self._finish(stream, "max_duration")
            return None
        cap = None
        if self.segment_ms_per_char:
            cap = max(1, frame_limit(len(text) * self.segment_ms_per_char, self.frame_ms))
        stream.segment = Segment(index=stream.next_segment, text=text, frame_limit=cap)
        stream.next_segment += 1
        stream.silence.reset()
        if stream.restart_ramp:
            stream.chunk = 0
            stream.restart_ramp = False
        stream.outbox.append(SegmentStarted(index=stream.segment.index, text=text))
        stream.has_context = True
        return unit

    def _generate(
        self,
        batch: list[TalkerStream],
        advancing: list[int],
        starting: list[tuple[int, _PrefillUnit]],
        endings: dict[int, StopReason],
    ) -> None:
        """Prefill the starting rows, run the device step for all rows, and file each row's frame of audio."""
        prefill_hidden = None
        if starting:
            units = [unit for _, unit in starting]
            prefill_slots = [_slot(batch[row]) for row, _ in starting]
            if any(unit.context is not None for unit in units):
                embeddings = self._prefill_embeddings(units)
                prefill_hidden = self.frames.prefill_flat(prefill_slots, [unit.size for unit in units], embeddings)
            else:
                prefill_hidden = self.frames.prefill_ids(prefill_slots, [unit.tokens for unit in units])
        rows = advancing + [row for row, _ in starting]
        streams = [batch[row] for row in rows]
        slots = [_slot(stream) for stream in streams]
        window = self.device_step.window
        codebooks = self.frames.num_codebooks
        step_rows = StepRows(
            slots=slots,
            positions=[self.frames.cache.length(slot) for slot in slots[: len(advancing)]],
            seeds=[stream.seed for stream in streams],
            counters=[stream.draws * codebooks for stream in streams],
            rings=[stream.draws % window if window else 0 for stream in streams],
            fresh=[int(stream.audio_frames == 0) for stream in streams],
            decoding=len(advancing),
        )
        try:
            buffer = self.device_step.launch(step_rows, prefill_hidden)
        except BaseException:
            self.device_step.discard()
            raise
        self.frames.cache.commit(slots[: len(advancing)], [1] * len(advancing))
        for stream in streams:
            stream.draws += 1
        if self.overlap_steps:
            for stream in streams:
                stream.in_flight = True
            self._in_flight = _InFlight(buffer, streams)
            return
        result = self._wait_for(buffer)
        ended = result.ended.tolist()
        rms = result.rms.tolist()
        frames = _FrameViews(result.pcm)
        for k, row in enumerate(rows):
            ending = self._file_frame(batch[row], ended[k], frames[k], rms[k])
            if ending is not None:
                endings[row] = ending

    def _prefill_embeddings(self, units: Sequence[_PrefillUnit]) -> torch.Tensor:
        """``[sum(size), hidden]``: every unit's reference audio and tokens in order (the tokens of all units
        embedded at once)."""
        ids = torch.tensor([token for unit in units for token in unit.tokens], device=self.frames.device)
        text = self.frames.embed_ids(ids)
        pieces: list[torch.Tensor] = []
        offset = 0
        for unit in units:
            if unit.context is not None:
                pieces.append(unit.context.to(text.dtype))
            pieces.append(text[offset : offset + len(unit.tokens)])
            offset += len(unit.tokens)
        return torch.cat(pieces)

    def _file_frame(
        self,
        stream: TalkerStream,
        ended: bool,
        pcm: bytes | memoryview | None,
        rms: float,
    ) -> StopReason | None:
        """Hold a stream's new frame (its PCM, or an empty placeholder for it when ``pcm`` is None); returns why the
        frame ends the segment, if it does (an end-of-audio frame is no audio and completes it)."""
        segment = _segment(stream)
        if ended:
            return "completed"
        stream.pending.append(b"" if pcm is None else pcm)
        stream.pending_rms.append(rms)
        stream.audio_frames += 1
        segment.frames += 1
        if stream.audio_frames >= stream.frame_limit or segment.frames == segment.frame_limit:
            return "max_duration"
        return None

    def _emit_audio(
        self, batch: list[TalkerStream], budget_ms: Sequence[float], endings: dict[int, StopReason]
    ) -> None:
        """Send the held frames of every stream whose chunk is due, ends, or has no credit for more."""
        for row, stream in enumerate(batch):
            if self._emit(stream, budget_ms[row], ending=row in endings) and row not in endings:
                endings[row] = "silence"

    def _emit(self, stream: TalkerStream, budget: float | None, *, ending: bool) -> bool:
        """Send the stream's held frames as one chunk if it is due (``budget`` None: only when ``ending``); returns
        whether the chunk ends in silence."""
        held = len(stream.pending)
        if not held or stream.finished:
            return False
        full = held >= self.schedule.frames(stream.chunk)
        # A frame still on the device is paid for too: flush when the credit cannot take one more after it.
        starved = budget is not None and budget < (held + int(stream.in_flight) + 1) * self.frame_ms
        if not (ending or (budget is not None and full) or starved):
            return False
        pcm = b"".join(stream.pending)
        rms = list(stream.pending_rms)
        stream.pending.clear()
        stream.pending_rms.clear()
        stream.chunk += 1
        stream.outbox.append(AudioChunk(segment_index=_segment(stream).index, pcm=pcm, sample_rate=self.sample_rate))
        return stream.silence.feed(rms)

    def _end_segment(self, stream: TalkerStream, reason: StopReason) -> None:
        stream.outbox.append(SegmentDone(index=_segment(stream).index, reason=reason))
        stream.segment = None
        stream.pending.clear()
        stream.pending_rms.clear()
        # Silence, the utterance's duration cap and a full context window end the stream; a unit's own cap only it.
        context_full = self.frames.cache.length(_slot(stream)) >= self.frames.cache.capacity
        if reason == "silence" or stream.audio_frames >= stream.frame_limit or context_full:
            self._finish(stream, reason)
        elif not stream.pending_text:
            if stream.input_done:
                self._finish(stream, "completed")
            else:
                stream.restart_ramp = True


@dataclass(frozen=True)
class _InFlight:
    """A launched device step not yet collected: its host buffer and its rows' streams, in row order."""

    buffer: int
    streams: list[TalkerStream]


@dataclass
class _AheadPlan:
    """A step's plan made before the wait (:meth:`TalkerEngine._plan_ahead`): rows that advance, rows whose context
    is full, rows left to plan after the wait, and the rows settled after the wait (their decisions void)."""

    advancing: list[int] = field(default_factory=list)
    endings: dict[int, StopReason] = field(default_factory=dict)
    rest: list[int] = field(default_factory=list)
    settled: set[int] = field(default_factory=set)
    seconds: float = 0.0


@dataclass(frozen=True)
class _PrefillUnit:
    """What a starting text unit adds to its stream's context: reference audio embeddings (the first unit of a
    stream given some), then its tokens (led by :data:`CLOSING` after an earlier segment)."""

    context: torch.Tensor | None  # [P, hidden]
    tokens: Sequence[int]

    @property
    def size(self) -> int:
        return (0 if self.context is None else int(self.context.shape[0])) + len(self.tokens)


def prefill_graph_tokens(options: TalkerOptions) -> int:
    """Token counts up to which the prefill graphs are captured (0: none): by default the per-step prefill budget,
    so that every step's prefill replays one graph (a lone unit longer than the budget replays them in pieces)."""
    if options.prefill_graph_tokens is None:
        return options.prefill_tokens_per_step
    return options.prefill_graph_tokens


def _profile_sizes(max_batch: int) -> list[int]:
    """Batch sizes whose step time is measured at load: powers of two below ``max_batch``, and ``max_batch``."""
    sizes = [1 << k for k in range(max_batch.bit_length()) if 1 << k < max_batch]
    return [*sizes, max_batch]


def _unfile_frame(stream: TalkerStream) -> None:
    """Undo :meth:`TalkerEngine._file_frame` of an audio frame (the last one the stream holds)."""
    stream.pending.pop()
    stream.pending_rms.pop()
    stream.audio_frames -= 1
    _segment(stream).frames -= 1


def _talker_stream(stream: EngineStream) -> TalkerStream:
    if not isinstance(stream, TalkerStream):
        raise TypeError(f"the talker engine cannot serve {type(stream).__name__}")
    return stream


def _segment(stream: TalkerStream) -> Segment:
    if stream.segment is None:
        raise RuntimeError("stream has no segment in progress")
    return stream.segment


def _slot(stream: TalkerStream) -> int:
    if stream.slot is None:
        raise RuntimeError("stream holds no slot")
    return stream.slot


class _FrameViews:
    """A step's PCM table ``[rows, samples]`` copied off the host buffer in one pass, little-endian; row ``k`` is a
    view of that copy (a stream's held frames keep it alive until they are sent)."""

    def __init__(self, pcm: np.ndarray[Any, np.dtype[np.int16]]) -> None:
        self._blob = memoryview(_le_bytes(pcm))
        self._stride = int(pcm.shape[1]) * 2 if pcm.ndim == 2 else 0

    def __getitem__(self, row: int) -> memoryview:
        return self._blob[row * self._stride : (row + 1) * self._stride]


def _le_bytes(samples: np.ndarray[Any, np.dtype[np.int16]]) -> bytes:
    """Little-endian s16 bytes, whatever the host byte order."""
    if sys.byteorder == "little":
        return samples.tobytes()
    return samples.byteswap().tobytes()
