"""Audio for a WebRTC track: mono s16le PCM at any rate in, 20 ms Opus packets at 48 kHz out.

WebRTC carries Opus in 20 ms frames of 960 samples at 48 kHz. :class:`RtcOpusStream` resamples one utterance,
cuts it into whole frames and encodes each into one packet, so a track can send packets without touching PCM.
A stream is created per utterance: its end pads the last frame and pushes out the encoder's lookahead, and a
cancelled utterance is simply dropped with its stream, so nothing of it leaks into the next one.
"""

from __future__ import annotations

import functools
from fractions import Fraction

import av
import numpy as np

from omnigate.codecs.resample import SAMPLE_WIDTH, StreamResampler

RTC_SAMPLE_RATE = 48_000
RTC_FRAME_SAMPLES = 960
RTC_FRAME_MS = 20
RTC_FRAME_BYTES = RTC_FRAME_SAMPLES * SAMPLE_WIDTH
RTC_TIME_BASE = Fraction(1, RTC_SAMPLE_RATE)
# Speech in mono Opus is transparent well below this; aiortc's own encoder sends 96 kbit/s stereo.
DEFAULT_OPUS_BITRATE = 32_000
# Frames of zeros after which a fresh encoder's packets no longer change.
SILENCE_SETTLE_FRAMES = 10


class RtcFramer:
    """Resamples mono s16le PCM to 48 kHz and cuts it into whole 960-sample frames."""

    def __init__(self, input_rate: int) -> None:
        self._resampler = StreamResampler(input_rate, RTC_SAMPLE_RATE)
        self._pending = b""

    def process(self, pcm: bytes) -> list[bytes]:
        """The whole frames ready after ``pcm``; a partial frame waits for the next piece."""
        data = self._pending + self._resampler.process(pcm)
        whole = len(data) - len(data) % RTC_FRAME_BYTES
        self._pending = data[whole:]
        return [data[i : i + RTC_FRAME_BYTES] for i in range(0, whole, RTC_FRAME_BYTES)]

    def finish(self) -> list[bytes]:
        """The remaining frames, the last one padded with silence; the framer is then finished."""
        data = self._pending + self._resampler.flush()
        self._pending = b""
        if len(data) % RTC_FRAME_BYTES:
            data += bytes(RTC_FRAME_BYTES - len(data) % RTC_FRAME_BYTES)
        return [data[i : i + RTC_FRAME_BYTES] for i in range(0, len(data), RTC_FRAME_BYTES)]


class OpusFrameEncoder:
    """libopus, mono, 48 kHz: one 20 ms frame in, one packet out."""

    def __init__(self, bitrate: int = DEFAULT_OPUS_BITRATE) -> None:
        codec = av.CodecContext.create("libopus", "w")
        codec.bit_rate = bitrate
        codec.format = "s16"
        codec.layout = "mono"
        codec.sample_rate = RTC_SAMPLE_RATE
        codec.time_base = RTC_TIME_BASE
        # "audio" (not "voip"): full-band fidelity for generated speech, and true digital silence for zeros where
        # voip mode's SILK layer sends comfort noise.
        codec.options = {"application": "audio"}
        codec.open()
        self._codec = codec
        self._pts = 0

    def encode(self, frame: bytes) -> list[bytes]:
        """Encode one 960-sample frame of mono s16le PCM; returns its packet (libopus does not buffer)."""
        if len(frame) != RTC_FRAME_BYTES:
            raise ValueError(f"an Opus frame is {RTC_FRAME_BYTES} bytes, got {len(frame)}")
        av_frame = av.AudioFrame.from_ndarray(
            np.frombuffer(frame, dtype="<i2").reshape(1, -1), format="s16", layout="mono"
        )
        av_frame.sample_rate = RTC_SAMPLE_RATE
        av_frame.time_base = RTC_TIME_BASE
        av_frame.pts = self._pts
        self._pts += RTC_FRAME_SAMPLES
        return [bytes(packet) for packet in self._codec.encode(av_frame)]


class RtcOpusStream:
    """One utterance of mono PCM at ``input_rate`` turned into 20 ms Opus packets, piece by piece.

    Not thread-safe, but it holds no loop state, so its methods may run in a worker thread (one call at a time).
    """

    def __init__(self, input_rate: int, bitrate: int = DEFAULT_OPUS_BITRATE) -> None:
        self._framer = RtcFramer(input_rate)
        self._encoder = OpusFrameEncoder(bitrate)
        self.packets_out = 0
        self.bytes_out = 0

    def encode(self, pcm: bytes) -> list[bytes]:
        """Packets for the whole frames ready after ``pcm``."""
        return self._encode_frames(self._framer.process(pcm))

    def finish(self) -> list[bytes]:
        """Packets for the rest of the utterance, including the encoder's lookahead (one extra silent frame)."""
        return self._encode_frames([*self._framer.finish(), bytes(RTC_FRAME_BYTES)])

    def _encode_frames(self, frames: list[bytes]) -> list[bytes]:
        packets = [packet for frame in frames for packet in self._encoder.encode(frame)]
        self.packets_out += len(packets)
        self.bytes_out += sum(len(p) for p in packets)
        return packets


@functools.cache
def silence_packet() -> bytes:
    """An Opus packet that decodes to 20 ms of digital silence (a settled encoder's output for zeros)."""
    encoder = OpusFrameEncoder()
    packets = [packet for _ in range(SILENCE_SETTLE_FRAMES) for packet in encoder.encode(bytes(RTC_FRAME_BYTES))]
    return packets[-1]
