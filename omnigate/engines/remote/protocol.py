"""Messages between a gateway and an engine replica, encoded with msgpack.

A session may first hold a place on a replica: a :class:`ReserveSession` streaming call, answered with
:class:`Opened` or :class:`Refused` and then nothing until the gateway cancels it (the session ended) or the
replica ends it; while it lasts, the session's streams name it (``OpenStream.held``) and open on its place. So the
replica decides which sessions it admits, exactly, however many gateway processes ask at once.

One stream per utterance is a streaming call: the gateway sends :class:`OpenStream`, the replica answers with
:class:`Opened` or :class:`Refused` and then :class:`Outputs` until a ``StreamDone`` among them ends the call.
Everything else the gateway tells a replica travels in :class:`ControlBatch` unary calls, one in flight per
replica, carrying per-stream :class:`StreamOps`. Credit is a cumulative limit (``credit_limit_ms``: media time the
stream may have produced in total), so control messages coalesce and a repeated one changes nothing.

Every call names the gateway process (``gateway``: an id per pool instance). A replica that has not heard from a
gateway for its lease ends that gateway's streams: a gateway that dies would otherwise leave parked streams
holding slots forever, since a parked stream sends nothing that could fail.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from omnigate.engines.base import EngineInfo, EngineOutput, SynthesisParams


class OpenStream(msgspec.Struct, frozen=True, tag="open"):
    """Admit one stream. Text and end of input known before the call was sent ride along; ``tokens``, when not
    empty, holds each text unit's token ids (:attr:`EngineInfo.unit_tokens`), made by the gateway."""

    stream_id: str
    gateway: str
    params: SynthesisParams
    credit_limit_ms: float
    texts: list[str] = []
    tokens: list[list[int]] = []
    input_done: bool = False
    held: str = ""  # the session's place (a ReserveSession's id) to open on, if it holds one


class ReserveSession(msgspec.Struct, frozen=True, tag="reserve"):
    """Hold a place for a session until this call is cancelled; answered with ``Opened`` or ``Refused``."""

    reservation_id: str
    gateway: str


StreamRequest = OpenStream | ReserveSession


class Opened(msgspec.Struct, frozen=True, tag="opened"):
    """The replica admitted the stream; control for it may follow."""

    replica: str
    free_slots: int


RefusalCode = Literal["engine_busy", "draining", "shutting_down"]


class Refused(msgspec.Struct, frozen=True, tag="refused"):
    """The replica did not admit the stream: ``engine_busy``/``draining``/``shutting_down`` send the gateway to
    another replica; any other code is the engine's own typed refusal (a bad voice) and goes to the client."""

    replica: str
    code: str
    message: str
    retry_after_s: float
    free_slots: int


class Outputs(msgspec.Struct, frozen=True, tag="outputs"):
    """Engine outputs in order; ``handed_at`` is the replica's ``time.monotonic()`` when it sent them."""

    items: list[EngineOutput]
    handed_at: float


StreamMessage = Opened | Refused | Outputs


class StreamOps(msgspec.Struct, frozen=True):
    """What changed for one stream since the last batch, applied in this order: text, end of input, credit.
    ``tokens`` as in :class:`OpenStream`."""

    stream_id: str
    texts: list[str] = []
    tokens: list[list[int]] = []
    input_done: bool = False
    credit_limit_ms: float = 0.0


class ControlBatch(msgspec.Struct, frozen=True):
    gateway: str
    ops: list[StreamOps]


class ReplicaReport(msgspec.Struct, frozen=True):
    """A replica's state as of one reply: what the gateway's router chooses by."""

    replica: str
    free_slots: int
    max_sessions: int
    active: int
    draining: bool = False


class ReplicaStats(msgspec.Struct, frozen=True):
    """The answer to a stats call: the report, the engine served, and the pool's counters."""

    report: ReplicaReport
    info: EngineInfo
    pid: int
    queue_depth: int
    healthy: bool
    health_problem: str | None
    steps: int
    step_seconds_total: float
    last_batch_size: int
    generated_ms_total: float
    failed_steps_total: int
    worker_restarts_total: int
    step_timeouts_total: int
    # the step-time and batch-size histograms' bucket counts (bounds: omnigate.engines.step_stats), the fraction of
    # the last seconds the workers spent stepping, and the engine's seconds by stage (Engine.stage_seconds)
    step_counts: list[int] = []
    batch_counts: list[int] = []
    batch_total: int = 0
    busy_fraction: float = 0.0
    stage_seconds: dict[str, float] = {}


class DrainResult(msgspec.Struct, frozen=True):
    """How a drain ended: streams that finished in time, and streams cut at the deadline."""

    replica: str
    finished: int
    cut: int


_stream_decoder: msgspec.msgpack.Decoder[StreamMessage] = msgspec.msgpack.Decoder(StreamMessage)
_report_decoder = msgspec.msgpack.Decoder(ReplicaReport)
_stats_decoder = msgspec.msgpack.Decoder(ReplicaStats)
_drain_decoder = msgspec.msgpack.Decoder(DrainResult)
_open_decoder: msgspec.msgpack.Decoder[StreamRequest] = msgspec.msgpack.Decoder(StreamRequest)
_control_decoder = msgspec.msgpack.Decoder(ControlBatch)
_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_stream_message(data: bytes) -> StreamMessage:
    return _stream_decoder.decode(data)


def decode_report(data: bytes) -> ReplicaReport:
    return _report_decoder.decode(data)


def decode_stats(data: bytes) -> ReplicaStats:
    return _stats_decoder.decode(data)


def decode_drain(data: bytes) -> DrainResult:
    return _drain_decoder.decode(data)


def decode_open(data: bytes) -> StreamRequest:
    return _open_decoder.decode(data)


def decode_control(data: bytes) -> ControlBatch:
    return _control_decoder.decode(data)
