"""Prometheus metrics of WebRTC calls, registered in the gateway's metrics registry (bounded labels only)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from omnigate.gateway.ops.metrics import Metrics
from omnigate.gateway.webrtc.track import SpeechTrack

TRANSPORT = "webrtc"
END_REASONS = frozenset(
    {
        "client_closed",
        "client_disconnected",
        "ice_timeout",
        "config_timeout",
        "idle_timeout",
        "max_duration",
        "stalled",
        "shutting_down",
        "backlog",
    }
)


class WebRtcTelemetry:
    """Counters and histograms every call of one gateway feeds."""

    def __init__(self, metrics: Metrics) -> None:
        self._ttfa = metrics.ttfa.labels(TRANSPORT)
        registry = metrics.registry
        self.connect_seconds = Histogram(
            "omnigate_webrtc_connect_seconds",
            "Time from the offer to the peer connection being connected (ICE and DTLS)",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=registry,
        )
        self.frames = Counter(
            "omnigate_webrtc_frames",
            "20 ms frames sent on WebRTC audio tracks: audio, silence, underrun (silence while an utterance was "
            "speaking), skipped (the clock was moved past a stalled loop)",
            ["kind"],
            registry=registry,
        )
        self.calls_ended = Counter("omnigate_webrtc_calls_ended", "WebRTC calls ended", ["reason"], registry=registry)
        self.ice_timeouts = Counter(
            "omnigate_webrtc_ice_timeouts", "Calls closed because ICE did not connect in time", registry=registry
        )
        self.cancels = Counter("omnigate_webrtc_cancels", "input.cancel received on WebRTC calls", registry=registry)

    def observe_first_audio(self, ms: float) -> None:
        self._ttfa.observe(ms / 1000.0)

    def call_ended(self, reason: str, track: SpeechTrack) -> None:
        self.calls_ended.labels(reason if reason in END_REASONS else "other").inc()
        audio = track.audio_frames_sent
        self.frames.labels("audio").inc(audio)
        self.frames.labels("silence").inc(track.frames_sent - audio)
        self.frames.labels("underrun").inc(track.underrun_frames)
        self.frames.labels("skipped").inc(track.skipped_frames)
