"""Prometheus metrics: read from the live pool and registry at scrape time, plus histograms the routes feed.

Labels are bounded (transport, reason, engine family); no session ids.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import msgspec
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from omnigate.engines.duplex.stats import STEP_BUCKETS_S, ClockStats
from omnigate.engines.omni.stats import RATE_WINDOW_S, ThinkerStats
from omnigate.engines.qwen3_omni.encoder_stats import EncoderStats
from omnigate.engines.remote.pool import RemoteEnginePool
from omnigate.engines.remote.protocol import ReplicaStats
from omnigate.engines.step_stats import BATCH_BUCKETS
from omnigate.engines.step_stats import STEP_BUCKETS_S as ENGINE_STEP_BUCKETS_S
from omnigate.gateway.state import Gateway
from omnigate.sessions.realtime.responder import TurnTimings

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _GatewayCollector(Collector):
    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        gw = self._gateway
        reg = gw.registry
        active = GaugeMetricFamily("omnigate_sessions_active", "Live sessions", labels=["transport"])
        transports = (
            "ws-speech",
            "http-speech",
            "webrtc",
            "realtime",
            "video",
            "webrtc-video",
            "video-chat",
            "webrtc-video-chat",
            "robot",
        )
        for transport in transports:
            active.add_metric([transport], reg.active.get(transport, 0))
        yield active
        admitted = CounterMetricFamily("omnigate_sessions_admitted", "Sessions admitted", labels=["transport"])
        for transport, n in reg.admitted_total.items():
            admitted.add_metric([transport], n)
        yield admitted
        refused = CounterMetricFamily("omnigate_sessions_refused", "Sessions refused", labels=["reason"])
        for reason, n in reg.refused_total.items():
            refused.add_metric([reason], n)
        yield refused
        try:
            tasks = len(asyncio.all_tasks())
        except RuntimeError:  # scraped off the event loop (tests reading the registry directly)
            tasks = 0
        yield GaugeMetricFamily("omnigate_event_loop_tasks", "asyncio tasks alive on the server's loop", value=tasks)
        backlog = [lease.driver.outbox.media_ms for lease in reg.leases if lease.driver is not None]
        yield GaugeMetricFamily(
            "omnigate_outbox_backlog_seconds_max",
            "Largest amount of generated audio waiting unsent in one session (its lag behind generation)",
            value=max(backlog, default=0.0) / 1000.0,
        )
        yield GaugeMetricFamily(
            "omnigate_outbox_backlog_seconds_sum",
            "Generated audio waiting unsent over all sessions",
            value=sum(backlog) / 1000.0,
        )
        robot = gw.robot_pool
        if robot is not None:
            yield GaugeMetricFamily("omnigate_robot_sessions", "Robot policy sessions open", value=robot.active)
            yield GaugeMetricFamily(
                "omnigate_robot_observations_waiting", "Robot observations waiting for a policy step", robot.waiting
            )
            observations = CounterMetricFamily("omnigate_robot_observations", "Robot observations accepted")
            observations.add_metric([], robot.observations_total)
            yield observations
            replaced = CounterMetricFamily(
                "omnigate_robot_observations_replaced", "Waiting observations replaced by a newer one (latest-wins)"
            )
            replaced.add_metric([], robot.replaced_total)
            yield replaced
            robot_failed = CounterMetricFamily("omnigate_robot_failed_steps", "Policy steps that raised")
            robot_failed.add_metric([], robot.failed_steps_total)
            yield robot_failed
        if gw.duplex_stats is not None:
            yield from _duplex_metrics(gw.duplex_stats)
        if gw.omni_stats is not None:
            yield from _omni_metrics(gw.omni_stats)
        pool = gw.pool
        if pool is None:
            return
        yield GaugeMetricFamily("omnigate_engine_healthy", "1 while the engine steps succeed", value=int(pool.healthy))
        restarts = CounterMetricFamily("omnigate_engine_worker_restarts", "Engine workers restarted after a crash")
        restarts.add_metric([], pool.worker_restarts_total)
        yield restarts
        timeouts = CounterMetricFamily("omnigate_engine_step_timeouts", "Engine steps that overran the step timeout")
        timeouts.add_metric([], pool.step_timeouts_total)
        yield timeouts
        failed_steps = CounterMetricFamily("omnigate_engine_failed_steps", "Engine steps that raised or crashed")
        failed_steps.add_metric([], pool.failed_steps_total)
        yield failed_steps
        family = pool.info.family
        yield GaugeMetricFamily("omnigate_engine_streams_active", "Engine streams open", value=pool.active, labels=None)
        yield GaugeMetricFamily("omnigate_engine_free_slots", "Engine slots free", value=pool.free_slots)
        yield GaugeMetricFamily(
            "omnigate_engine_queue_depth",
            "Engine streams runnable and waiting for a worker",
            value=pool.queue_depth,
        )
        yield GaugeMetricFamily("omnigate_engine_last_batch_size", "Size of the last engine step", pool.last_batch_size)
        steps = CounterMetricFamily("omnigate_engine_steps", "Engine steps", labels=["engine"])
        steps.add_metric([family], pool.steps)
        yield steps
        step_s = CounterMetricFamily("omnigate_engine_step_seconds", "Time spent in engine steps", labels=["engine"])
        step_s.add_metric([family], pool.step_seconds_total)
        yield step_s
        gen = CounterMetricFamily(
            "omnigate_engine_generated_audio_seconds", "Audio produced by the engine", labels=["engine"]
        )
        gen.add_metric([family], pool.generated_ms_total / 1000.0)
        yield gen
        aborted = CounterMetricFamily("omnigate_engine_aborted", "Engine streams aborted", labels=["engine"])
        aborted.add_metric([family], pool.aborted_total)
        yield aborted
        failed = CounterMetricFamily("omnigate_engine_failed", "Engine streams failed", labels=["engine"])
        failed.add_metric([family], pool.failed_total)
        yield failed
        if isinstance(pool, RemoteEnginePool):
            yield from _remote_engine_metrics(list(pool.replica_stats().values()))
        if gw.encoder_stats is not None:
            yield from _encoder_metrics(gw.encoder_stats)


def _histogram(
    name: str, documentation: str, bounds: tuple[float, ...], counts: list[int], total: float
) -> HistogramMetricFamily:
    cumulative, buckets = 0, []
    for bound, count in zip((*bounds, float("inf")), counts, strict=True):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
    family = HistogramMetricFamily(name, documentation)
    family.add_metric([], buckets, sum_value=total)
    return family


def _remote_engine_metrics(
    stats: list[ReplicaStats],
) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
    """The steps of engines in other processes (the engine core, Ray replicas), summed over them as of their last
    stats: the same histograms an in-process pool feeds, the busy fraction and the engine's time by stage."""
    stats = [s for s in stats if len(s.step_counts) == len(ENGINE_STEP_BUCKETS_S) + 1]
    if not stats:
        return
    steps = [sum(column) for column in zip(*(s.step_counts for s in stats), strict=True)]
    yield _histogram(
        "omnigate_engine_step_duration_seconds",
        "Duration of one engine step",
        ENGINE_STEP_BUCKETS_S,
        steps,
        sum(s.step_seconds_total for s in stats),
    )
    batches = [sum(column) for column in zip(*(s.batch_counts for s in stats), strict=True)]
    yield _histogram(
        "omnigate_engine_batch_size",
        "Streams advanced by one engine step",
        tuple(float(b) for b in BATCH_BUCKETS),
        batches,
        sum(s.batch_total for s in stats),
    )
    yield GaugeMetricFamily(
        "omnigate_engine_busy_fraction",
        "Fraction of the last seconds the engine's workers spent stepping (mean over its replicas)",
        value=sum(s.busy_fraction for s in stats) / len(stats),
    )
    stages = CounterMetricFamily(
        "omnigate_engine_stage_seconds",
        "Time the engine's steps spent by stage (device wait, host stages)",
        labels=["stage"],
    )
    totals: dict[str, float] = {}
    for s in stats:
        for stage, seconds in s.stage_seconds.items():
            totals[stage] = totals.get(stage, 0.0) + seconds
    for stage, seconds in totals.items():
        stages.add_metric([stage], seconds)
    yield stages


def _encoder_metrics(stats: EncoderStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The Qwen3-Omni input encoder's thread: its calls and what each carried (the batching of a burst)."""
    calls = CounterMetricFamily(
        "omnigate_qwen3_omni_encoder_calls", "Encoder forwards of the input encoder's thread", labels=["input"]
    )
    calls.add_metric(["frames"], stats.frame_calls)
    calls.add_metric(["audio"], stats.audio_calls)
    yield calls
    items = CounterMetricFamily(
        "omnigate_qwen3_omni_encoder_items",
        "Inputs those forwards encoded: camera frames, user turns",
        labels=["input"],
    )
    items.add_metric(["frames"], stats.frames)
    items.add_metric(["audio"], stats.audio_items)
    yield items
    yield _counter(
        "omnigate_qwen3_omni_encoder_frame_requests", "Questions whose frames the encoder's forwards carried",
        stats.frame_requests,
    )  # fmt: skip
    largest = GaugeMetricFamily(
        "omnigate_qwen3_omni_encoder_largest_call", "Most inputs one encoder forward carried", labels=["input"]
    )
    largest.add_metric(["frames"], stats.largest_frame_call)
    largest.add_metric(["audio"], stats.largest_audio_call)
    yield largest
    yield _counter("omnigate_qwen3_omni_encoder_failed_calls", "Encoder forwards that raised", stats.failed_calls)
    yield _counter(
        "omnigate_qwen3_omni_encoder_windows_ahead",
        "8-s windows of user turns encoded while the user still spoke (again when a louder frame changed them)",
        stats.windows_ahead,
    )
    yield _counter(
        "omnigate_qwen3_omni_encoder_windows_kept",
        "Windows encoded ahead whose tokens a turn's end used (their features equal to the whole turn's)",
        stats.windows_kept,
    )


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation)
    family.add_metric([], value)
    return family


def _omni_metrics(stats: ThinkerStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The omni thinker's worker loop (video chat): its decode steps, the answers each advances, the prompt tokens
    each loop prefills; totals since load, and rates over the last ``RATE_WINDOW_S`` seconds."""
    rates = stats.rates()
    window = f"over the last {RATE_WINDOW_S:g} s"
    yield GaugeMetricFamily(
        "omnigate_omni_steps_per_second", f"Thinker decode steps per second {window}", value=rates.steps_per_s
    )
    yield GaugeMetricFamily(
        "omnigate_omni_rows_per_step", f"Answers advanced per thinker decode step {window}", value=rates.rows_per_step
    )
    yield GaugeMetricFamily(
        "omnigate_omni_prefill_tokens_per_step",
        f"Prompt tokens prefilled per thinker worker loop {window}",
        value=rates.prefill_tokens_per_step,
    )
    yield _counter("omnigate_omni_steps", "Thinker decode steps (one forward over every answer in flight)", stats.steps)
    yield _counter(
        "omnigate_omni_padded_steps",
        "Thinker decode steps padded to a batch bucket (replayed from a captured CUDA graph on the GPU)",
        stats.padded_steps,
    )
    yield _counter(
        "omnigate_omni_decode_rows", "Answers advanced, summed over the thinker's decode steps", stats.decode_rows
    )
    yield _counter("omnigate_omni_prefill_tokens", "Prompt tokens the thinker prefilled", stats.prefill_tokens)
    yield _counter(
        "omnigate_omni_prefill_forwards",
        "Thinker prefill forwards (each of one or more prompts)",
        stats.prefill_forwards,
    )
    yield _counter("omnigate_omni_prefilled_prompts", "Prompts the thinker prefilled", stats.prefilled_prompts)


def _duplex_metrics(stats: ClockStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
    """The duplex engine's tick clock: whether ticks keep the 80 ms frame, how they ran, what they carried. With an
    engine core the clock's counters are engine-wide (every gateway worker gets them), the sessions gauge is the
    scraped process's own."""
    yield GaugeMetricFamily(
        "omnigate_duplex_sessions",
        "Live duplex sessions of this gateway process (with several gateway workers, each counts its own; the "
        "clock's other counters are engine-wide)",
        value=stats.sessions,
    )
    ticks = CounterMetricFamily(
        "omnigate_duplex_ticks", "Ticks of the duplex clock, by how the model ran", labels=["mode"]
    )
    ticks.add_metric(["graph"], stats.graph_ticks)
    ticks.add_metric(["eager"], stats.eager_ticks)
    yield ticks
    yield _counter("omnigate_duplex_late_ticks", "Ticks that ended after the next tick was due", stats.late_ticks)
    yield _counter(
        "omnigate_duplex_late_seconds", "How far past their due time late ticks ended, summed", stats.late_seconds_total
    )
    yield _counter(
        "omnigate_duplex_missed_ticks",
        "Ticks dropped because the clock fell more than a tick behind",
        stats.missed_ticks,
    )
    yield _counter(
        "omnigate_duplex_graph_captures",
        "CUDA graphs captured on a live tick (after the warm-up)",
        stats.graph_captures,
    )
    yield _counter("omnigate_duplex_frames", "Session frames produced (committed session steps)", stats.frames)
    yield _counter("omnigate_duplex_rows", "Rows the model computed: session frames plus masked rows", stats.rows)
    yield _counter("omnigate_duplex_sat_out", "Session-ticks a live session sat out for lack of credit", stats.sat_out)
    yield GaugeMetricFamily("omnigate_duplex_last_batch_size", "Rows of the last tick", value=stats.last_batch)
    yield GaugeMetricFamily("omnigate_duplex_last_frames", "Session frames of the last tick", value=stats.last_frames)
    yield GaugeMetricFamily(
        "omnigate_duplex_step_seconds_max", "Longest model step since load", value=stats.step_seconds_max
    )
    yield _counter(
        "omnigate_duplex_tick_seconds", "Wall time of ticks (input, step, hand-off)", stats.tick_seconds_total
    )
    yield _counter(
        "omnigate_duplex_clock_cpu_seconds",
        "CPU time of the clock thread in ticks (well below tick time: it waited, for the GIL or the OS)",
        stats.clock_cpu_seconds_total,
    )
    cumulative, buckets = 0, []
    for bound, count in zip((*STEP_BUCKETS_S, float("inf")), stats.step_counts, strict=True):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
    step = HistogramMetricFamily("omnigate_duplex_step_seconds", "Duration of one model step of the duplex clock")
    step.add_metric([], buckets, sum_value=stats.step_seconds_total)
    yield step


class Metrics:
    """One registry per gateway (so several apps can live in one process, as tests do)."""

    def __init__(self, gateway: Gateway) -> None:
        # With the engine in other processes, the collector reports their step histograms under these names.
        settings = gateway.settings
        remote_engine = settings.core_socket is not None or settings.engine_pool == "ray"
        self.registry = CollectorRegistry()
        self.registry.register(_GatewayCollector(gateway))
        ProcessCollector(registry=self.registry)  # resident memory, open fds, CPU of the server process
        self.ttfa = Histogram(
            "omnigate_ttfa_seconds",
            "Server-side time from a unit reaching the engine to its first audio leaving the session",
            ["transport"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0),
            registry=self.registry,
        )
        self.outbox_lag = Histogram(
            "omnigate_outbox_media_seconds",
            "Generated audio waiting in a session outbox when a chunk is sent",
            ["transport"],
            buckets=(0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 4.0),
            registry=self.registry,
        )
        self.chunk_gap = Histogram(
            "omnigate_chunk_gap_seconds",
            "Time between consecutive media sends of one response or WebSocket",
            ["transport"],
            buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.12, 0.2, 0.3, 0.5, 1.0, 2.0),
            registry=self.registry,
        )
        self.refusals = Counter(
            "omnigate_requests_refused",
            "Requests and sessions refused before reaching a route (auth, rate, per-key limits)",
            ["reason"],
            registry=self.registry,
        )
        engine_registry = None if remote_engine else self.registry
        self.engine_step = Histogram(
            "omnigate_engine_step_duration_seconds",
            "Duration of one engine step",
            buckets=ENGINE_STEP_BUCKETS_S,
            registry=engine_registry,
        )
        self.engine_batch = Histogram(
            "omnigate_engine_batch_size",
            "Streams advanced by one engine step",
            buckets=BATCH_BUCKETS,
            registry=engine_registry,
        )
        self.loop_lag = Histogram(
            "omnigate_event_loop_lag_seconds",
            "How late the server's event loop woke a task from a timed sleep",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=self.registry,
        )

        self.robot_inference = Histogram(
            "omnigate_robot_inference_seconds",
            "Server-side time from a robot observation received to its actions sent (queue and policy step)",
            buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0),
            registry=self.registry,
        )
        self.robot_step = Histogram(
            "omnigate_robot_step_duration_seconds",
            "Duration of one batched policy step",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0),
            registry=self.registry,
        )
        self.robot_batch = Histogram(
            "omnigate_robot_batch_size",
            "Robot observations served by one policy step",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=self.registry,
        )
        self.robot_refusals = Counter(
            "omnigate_robot_observations_refused",
            "Robot observations answered with a typed error instead of actions",
            ["code"],
            registry=self.registry,
        )

        self.responder_turn = Histogram(
            "omnigate_responder_turn_seconds",
            "Steps of a realtime turn answered by the LLM: from the end of the user's speech to the transcript, the "
            "first token and the first reply audio; the services' own times (asr, llm, tts); omnigate's overhead",
            ["step"],
            buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0),
            registry=self.registry,
        )
        self.responder_failures = Counter(
            "omnigate_responder_failures",
            "Realtime responses failed by the LLM or transcription service (llm_timeout, asr_unavailable, ...)",
            ["code"],
            registry=self.registry,
        )

    def observe_responder_turn(self, timings: TurnTimings) -> None:
        """One answered turn's timings (milliseconds in, seconds out); steps that did not happen are skipped."""
        for field, value in msgspec.structs.asdict(timings).items():
            if value is not None:
                self.responder_turn.labels(field.removesuffix("_ms")).observe(max(0.0, value) / 1000.0)

    def observe_robot_step(self, seconds: float, batch_size: int) -> None:
        """The policy scheduler's step observer (on its thread)."""
        self.robot_step.observe(seconds)
        self.robot_batch.observe(batch_size)

    def observe_step(self, seconds: float, batch_size: int) -> None:
        """The pool's step observer (called on a scheduler thread; prometheus_client is thread-safe)."""
        self.engine_step.observe(seconds)
        self.engine_batch.observe(batch_size)

    def render(self) -> bytes:
        return generate_latest(self.registry)
