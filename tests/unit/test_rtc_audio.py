"""48 kHz, 20 ms Opus packets for WebRTC tracks: framing, encoding, silence."""

from __future__ import annotations

import av
import numpy as np
import pytest

from omnigate.codecs.rtc_audio import (
    RTC_FRAME_BYTES,
    RTC_SAMPLE_RATE,
    OpusFrameEncoder,
    RtcFramer,
    RtcOpusStream,
    silence_packet,
)


def tone(rate: int, seconds: float, hz: float = 440.0, amplitude: float = 0.3) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    return (np.sin(2 * np.pi * hz * t) * amplitude * 32767).astype("<i2").tobytes()


def decode(packets: list[bytes]) -> np.ndarray:
    """Decode with libopus as a WebRTC receiver does (stereo s16), downmixed to mono floats."""
    decoder = av.CodecContext.create("libopus", "r")
    decoder.format = "s16"
    decoder.layout = "stereo"
    decoder.sample_rate = RTC_SAMPLE_RATE
    parts = []
    for packet in packets:
        for frame in decoder.decode(av.Packet(packet)):
            parts.append(frame.to_ndarray().reshape(-1, 2).mean(axis=1) / 32768.0)
    return np.concatenate(parts)


@pytest.mark.parametrize("rate", [16_000, 22_050, 24_000, 48_000])
def test_framer_cuts_whole_20ms_frames_and_pieces_equal_the_whole(rate: int) -> None:
    pcm = tone(rate, 1.0)
    whole = RtcFramer(rate)
    frames = whole.process(pcm) + whole.finish()
    assert all(len(f) == RTC_FRAME_BYTES for f in frames)
    assert len(frames) == 50  # one second, padded up to a whole frame at most
    pieced = RtcFramer(rate)
    step = 2 * 333  # odd sample counts, unrelated to the frame size
    out = [f for i in range(0, len(pcm), step) for f in pieced.process(pcm[i : i + step])] + pieced.finish()
    assert b"".join(out) == b"".join(frames)


def test_one_packet_per_frame_and_the_tone_survives() -> None:
    encoder = OpusFrameEncoder()
    frames = RtcFramer(RTC_SAMPLE_RATE).process(tone(RTC_SAMPLE_RATE, 0.5))
    packets = [p for f in frames for p in encoder.encode(f)]
    assert len(packets) == len(frames) == 25
    samples = decode(packets)[4800:]  # past the codec's start-up
    spectrum = np.abs(np.fft.rfft(samples))
    peak_hz = np.argmax(spectrum) * RTC_SAMPLE_RATE / samples.size
    assert abs(peak_hz - 440.0) < 5.0
    assert 0.15 < np.sqrt(np.mean(samples**2)) < 0.25  # a 0.3 sine has RMS 0.21


def test_encoder_refuses_partial_frames() -> None:
    with pytest.raises(ValueError, match="1920 bytes"):
        OpusFrameEncoder().encode(bytes(100))


def test_stream_finish_pads_the_last_frame() -> None:
    stream = RtcOpusStream(22_050)
    packets = stream.encode(tone(22_050, 0.31)) + stream.finish()  # 15.5 frames at 48 kHz
    # 16 frames of audio (the last padded with silence) and the frame that carries the lookahead out.
    assert len(packets) == 17 == stream.packets_out
    assert stream.bytes_out == sum(len(p) for p in packets)


def test_stream_finish_flushes_the_encoder_lookahead() -> None:
    stream = RtcOpusStream(RTC_SAMPLE_RATE)
    packets = stream.encode(tone(RTC_SAMPLE_RATE, 0.3)) + stream.finish()  # exactly 15 frames
    samples = decode(packets)
    # libopus delays its output by 312 samples: the last 6.5 ms of audio only leave in the extra frame.
    audible = np.flatnonzero(np.abs(samples) > 0.01)
    assert audible[-1] > 15 * 960 + 200


def test_silence_packet_decodes_to_digital_silence() -> None:
    assert not np.any(decode([silence_packet()] * 5))
