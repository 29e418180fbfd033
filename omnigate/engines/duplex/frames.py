"""One lockstep frame of a Moshi model for a batch of sessions: 80 ms of user audio in, 80 ms of model audio out.

Per step and session: the user's frame is encoded to Mimi codes; the temporal transformer reads the last text token,
the model's last audio codes and the user's codes; a text token is drawn, then the depth transformer draws the
model's audio codes. Moshi delays the acoustic codebooks (1..K-1) by one frame behind the semantic one (0), for the
user's stream and the model's alike, so a step's codes complete the *previous* output frame, which the streaming
Mimi decoder turns into PCM: a session's first step yields silence, and every later step one frame of audio.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.profiler import record_function

from omnigate.engines.codec.mimi_stream import MimiStreamDecoder
from omnigate.engines.duplex.backbone import SlotBackbone
from omnigate.engines.duplex.depth import DepthSampler
from omnigate.engines.duplex.graphs import CapturedCall, CapturedTick, batch_buckets, bucket_rows, prefix_batch
from omnigate.engines.duplex.mimi_encoder import MimiStreamEncoder
from omnigate.engines.duplex.model import DuplexModel
from omnigate.engines.duplex.ring_cache import RingStep
from omnigate.engines.duplex.sampling import SeededSampler

log = logging.getLogger(__name__)

_AUDIO_SEED_SALT = 0x5EED_A0D10

# Rows of a step's input table, each one value per computed row (the last two: one per stepped slot).
_ROW_SLOT, _ROW_LIVE, _ROW_ENCODE, _ROW_DECODE, _ROW_POSITION, _ROW_STEP, _ROW_SEED, _ROW_STEPPED, _ROW_PICKED = range(
    9
)
_TABLE_ROWS = 9


@dataclass(frozen=True)
class FrameSettings:
    """Sizes and sampling of a :class:`FrameModel` (plain values: benchmarks build one without the engine)."""

    slots: int
    context_frames: int | None = None  # attention window; None: the model's own
    text_temperature: float = 0.7
    text_top_k: int = 25
    audio_temperature: float = 0.8
    audio_top_k: int = 250
    cuda_graphs: bool = True  # on CUDA, replay a captured graph per batch size for batches of slots 0..B-1
    buckets: tuple[int, ...] = ()  # batch sizes graphs serve (default: powers of two below ``slots``, and it)
    masked_rows: bool = False  # plan bucket batches with masked rows even without graphs (how CPU tests see it)
    codec_graphs: bool = True  # with graphs, capture the Mimi encode and decode stages too


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for its rows: text ids ``[B]`` and s16 PCM ``[B, samples_per_frame]``."""

    text: list[int]
    pcm: np.ndarray
    rows: int  # rows the model computed: the stepped slots and any masked ones
    graph: bool  # the model ran as a captured graph
    captured: bool  # this step captured that graph first


class FrameModel:
    """A Moshi model with per-slot state (caches, codec state, last tokens) for ``slots`` sessions."""

    def __init__(self, model: DuplexModel, settings: FrameSettings) -> None:
        moshi = model.moshi
        config = moshi.config
        self.slots = settings.slots
        self.num_codebooks = int(config.num_codebooks)
        window = settings.context_frames or int(config.sliding_window)
        self.backbone = SlotBackbone(moshi, slots=self.slots, window=window)
        self.depth = DepthSampler(moshi.depth_decoder, self.num_codebooks)
        self.encoder = MimiStreamEncoder(moshi.audio_encoder, self.slots, self.num_codebooks)
        self.decoder = MimiStreamDecoder(moshi.audio_encoder, self.slots)
        if self.decoder.samples_per_frame != self.encoder.samples_per_frame:
            raise ValueError("the Mimi encoder and decoder disagree on the frame length")
        self.sample_rate = self.encoder.sample_rate
        self.samples_per_frame = self.encoder.samples_per_frame
        self.device = self.backbone.device
        self.text_sampler = SeededSampler(
            temperature=settings.text_temperature, top_k=settings.text_top_k, valid_ids=self.backbone.vocab_size
        )
        self.audio_sampler = SeededSampler(
            temperature=settings.audio_temperature,
            top_k=settings.audio_top_k,
            valid_ids=self.backbone.audio_vocab_size,
        )
        k = self.num_codebooks
        start_audio = self.backbone.audio_vocab_size  # the "no token yet" id of every audio stream
        self._start_text = self.backbone.vocab_size
        self._start_audio = start_audio
        self.last_text = torch.full((self.slots,), self._start_text, dtype=torch.long, device=self.device)
        self.last_model = torch.full((self.slots, k), start_audio, dtype=torch.long, device=self.device)
        self.last_user = torch.full((self.slots, k), start_audio, dtype=torch.long, device=self.device)
        self.pending_semantic = torch.zeros(self.slots, dtype=torch.long, device=self.device)
        self.steps = [0] * self.slots
        self.seeds = [0] * self.slots
        self.use_graphs = settings.cuda_graphs and self.device.type == "cuda"
        self.masked_rows = settings.masked_rows
        self.codec_graphs = settings.codec_graphs
        self.buckets = batch_buckets(self.slots, settings.buckets)
        self._graphs: dict[int, CapturedTick] = {}
        self._codec_graphs: dict[tuple[str, int], CapturedCall] = {}
        self._codec_eager: set[tuple[str, int]] = set()
        # A step's host inputs go to the device in two copies from pinned memory, without waiting: a copy from
        # pageable memory waits for the GPU to finish all queued work, a wait (and a GIL hand-off) per input.
        # Reusing the buffers is safe: a step ends by reading its output, after which its copies are done.
        pinned = self.device.type == "cuda"
        self._table_host = torch.zeros((_TABLE_ROWS, self.slots), dtype=torch.long, pin_memory=pinned)
        self._table = torch.zeros((_TABLE_ROWS, self.slots), dtype=torch.long, device=self.device)
        self._audio_host = torch.zeros((self.slots, self.samples_per_frame), dtype=torch.float32, pin_memory=pinned)
        self._audio = torch.zeros((self.slots, self.samples_per_frame), dtype=torch.float32, device=self.device)

    def rows_for(self, slots: Sequence[int]) -> tuple[int, ...]:
        """The rows a step of ``slots`` computes: a bucket's ``0..B-1`` when graphs (or masked rows) are in use,
        else exactly ``slots``."""
        if self.use_graphs or self.masked_rows:
            return bucket_rows(slots, self.buckets)
        return tuple(slots)

    def reset(self, slot: int, seed: int) -> None:
        """Start a new session in ``slot``: nothing of the previous session's state remains."""
        self.backbone.cache.reset(slot)
        self.encoder.reset(slot)
        self.decoder.reset(slot)
        self.last_text[slot] = self._start_text
        self.last_model[slot] = self._start_audio
        self.last_user[slot] = self._start_audio
        self.pending_semantic[slot] = 0
        self.steps[slot] = 0
        self.seeds[slot] = seed

    def _think(
        self, x: torch.Tensor, plan: RingStep, steps: torch.Tensor, seeds: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The temporal transformer, then a text token and the audio codes of every row (device work only)."""
        with record_function("duplex/temporal"):
            hidden = self.backbone.layers_forward(x, plan)
        with record_function("duplex/text"):
            text = self.text_sampler(self.backbone.text_logits(hidden), seeds, steps)
        with record_function("duplex/depth"):
            audio_seeds = seeds ^ _AUDIO_SEED_SALT
            base = steps * self.num_codebooks
            codes = self.depth.sample(hidden, text, lambda logits, k: self.audio_sampler(logits, audio_seeds, base + k))
        return text, codes

    @torch.no_grad()
    def step(self, slots: Sequence[int], pcm: np.ndarray) -> StepOutput:
        """Advance ``slots`` by one frame; ``pcm`` is s16 ``[B, samples_per_frame]`` user audio.

        The model computes :meth:`rows_for` ``slots``; a computed row that is not one of ``slots`` is masked: its
        outputs are dropped and none of its state moves (its codec rows go to the codecs' scratch slots; its last
        tokens, draw counter and cache position stay; the cache entry it wrote is the one its next real step writes).
        So a session that sits a tick out, or a free slot, costs a row of the batch a captured graph serves, never a
        different batch. With graphs, the codec stages are captured per bucket too: a tick then launches a few
        graphs instead of thousands of kernels, so its host time barely depends on other threads holding the GIL.

        Each stage is a named profiler range (``duplex/...``), so a profile splits a tick's time by stage.
        """
        slots = list(slots)
        if len(set(slots)) != len(slots):
            raise ValueError("a step takes each slot at most once")
        rows = self.rows_for(slots)
        count = len(rows)
        stepping = set(slots)
        at = {slot: row for row, slot in enumerate(rows)}
        live_rows = [at[slot] for slot in slots]  # each stepped slot's row, in the order of ``slots``
        graph = self.use_graphs and prefix_batch(rows)
        # The host inputs of every stage, one row of the table each (see _TABLE_ROWS), in one copy.
        table = self._table_host.numpy()
        table[_ROW_SLOT, :count] = rows
        table[_ROW_LIVE, :count] = [slot in stepping for slot in rows]
        table[_ROW_ENCODE, :count] = [slot if slot in stepping else self.encoder.scratch for slot in rows]
        # A session's first step completes no frame (the acoustic delay): like masked rows, it decodes into the
        # decoder's scratch slot.
        table[_ROW_DECODE, :count] = [
            slot if slot in stepping and self.steps[slot] > 0 else self.decoder.scratch for slot in rows
        ]
        table[_ROW_POSITION, :count] = [self.backbone.cache.position(slot) for slot in rows]
        table[_ROW_STEP, :count] = [self.steps[slot] for slot in rows]
        table[_ROW_SEED, :count] = [self.seeds[slot] for slot in rows]
        table[_ROW_STEPPED, : len(slots)] = slots
        table[_ROW_PICKED, : len(slots)] = live_rows
        audio = self._audio_host.numpy()
        audio[:count] = 0.0
        audio[live_rows] = pcm.astype(np.float32) / 32768.0
        # Whole buffers (a few hundred KiB at most): contiguous, so the copies stay pinned and asynchronous.
        self._table.copy_(self._table_host, non_blocking=True)
        self._audio.copy_(self._audio_host, non_blocking=True)
        inputs = self._table[:, :count]
        row_index = inputs[_ROW_SLOT]
        live = inputs[_ROW_LIVE] != 0
        index = inputs[_ROW_STEPPED, : len(slots)]
        picked = inputs[_ROW_PICKED, : len(slots)]
        with record_function("duplex/encode"):
            encode_in = (self._audio[:count], inputs[_ROW_ENCODE])
            (user,), captured_encode = self._stage("encode", self._encode, encode_in, graph)
        with record_function("duplex/think"):
            # The user's semantic codebook is current; its acoustic codebooks are the previous frame's. Masked rows
            # read their own last codes: valid ids, results dropped.
            last_user = self.last_user.index_select(0, row_index)
            user_in = torch.where(live[:, None], torch.cat((user[:, :1], last_user[:, 1:]), dim=1), last_user)
            x = self.backbone.embed(
                self.last_text.index_select(0, row_index), self.last_model.index_select(0, row_index), user_in
            )
            plan = self.backbone.cache.step_at(rows, row_index, inputs[_ROW_POSITION])
            steps, seeds = inputs[_ROW_STEP], inputs[_ROW_SEED]
            captured_think = False
            if graph:
                tick = self._graphs.get(len(rows))
                if tick is None:
                    captured_think = True
                    tick = self._graphs[len(rows)] = CapturedTick(self._think, x, plan, steps, seeds)
                text, codes = tick.run(x, plan, steps, seeds)
            else:
                text, codes = self._think(x, plan, steps, seeds)
            self.backbone.cache.commit(plan, slots)
        with record_function("duplex/decode"):
            frame = torch.cat((self.pending_semantic.index_select(0, row_index)[:, None], codes[:, 1:]), dim=1)
            decode_in = (frame[:, :, None].contiguous(), inputs[_ROW_DECODE])
            (pcm_out,), captured_decode = self._stage("decode", self._decode, decode_in, graph)
        step_text = text.index_select(0, picked)
        step_codes = codes.index_select(0, picked)
        self.last_text.index_copy_(0, index, step_text)
        self.last_model.index_copy_(0, index, step_codes)
        self.last_user.index_copy_(0, index, user.index_select(0, picked))
        self.pending_semantic.index_copy_(0, index, step_codes[:, 0])
        with record_function("duplex/to_host"):
            out = pcm_out.cpu().numpy()[live_rows]
            tokens = step_text.tolist()
        for row, slot in enumerate(slots):
            if self.steps[slot] == 0:
                out[row] = 0
            self.steps[slot] += 1
        return StepOutput(
            text=tokens,
            pcm=out,
            rows=len(rows),
            graph=graph,
            captured=captured_encode or captured_think or captured_decode,
        )

    def _encode(self, audio: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.encoder.encode_rows(audio, index),)

    def _decode(self, frame: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor]:
        audio = self.decoder.decode_frames(frame, index).clamp(-1.0, 1.0)
        return ((audio.float() * 32767.0).round().to(torch.int16),)

    def _stage(
        self,
        name: str,
        call: Callable[..., tuple[torch.Tensor, ...]],
        inputs: tuple[torch.Tensor, ...],
        graph: bool,
    ) -> tuple[tuple[torch.Tensor, ...], bool]:
        """Run a codec stage: replayed from its graph for this bucket (captured on first use, on inputs that point
        every row at the scratch slot, so capturing touches no session), else eagerly. A stage whose capture fails
        runs eagerly from then on, with a warning: slower, never wrong."""
        if not graph or not self.codec_graphs:
            return call(*inputs), False
        key = (name, inputs[0].shape[0])
        captured = self._codec_graphs.get(key)
        fresh = False
        if captured is None and key not in self._codec_eager:
            scratch = self.encoder.scratch if name == "encode" else self.decoder.scratch
            harmless = (torch.zeros_like(inputs[0]), torch.full_like(inputs[1], scratch))
            try:
                captured = self._codec_graphs[key] = CapturedCall(call, harmless)
                fresh = True
            except Exception:
                log.exception("capturing the duplex %s stage for %d rows failed; it runs eagerly", name, key[1])
                self._codec_eager.add(key)
                torch.cuda.synchronize(self.device)
        if captured is None:
            return call(*inputs), fresh
        return captured.run(inputs), fresh
