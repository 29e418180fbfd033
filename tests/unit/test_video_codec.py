"""The streaming H.264 fMP4 writer: init segment first, one fragment per pushed group, and a playable result."""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import pytest

from omnigate.codecs.video import FragmentedMp4Writer, VideoEncodeError, avc_decoder_config, top_level_boxes


def noise_frames(count: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


def decode(data: bytes) -> list[av.VideoFrame]:
    with av.open(io.BytesIO(data)) as container:
        return list(container.decode(video=0))


def test_init_segment_then_exactly_one_fragment_per_group_and_it_plays() -> None:
    writer = FragmentedMp4Writer(64, 48, 16)
    init = writer.begin()
    assert [kind for kind, _ in top_level_boxes(init)] == ["ftyp", "moov"]
    assert writer.begin() == b""
    stream = init
    for n, count in enumerate([1, 4, 4, 4]):
        fragment = writer.push(noise_frames(count, 48, 64, seed=n))
        assert [kind for kind, _ in top_level_boxes(fragment)] == ["moof", "mdat"]
        stream += fragment
    stream += writer.finish()
    frames = decode(stream)
    assert len(frames) == 13
    assert {(f.width, f.height) for f in frames} == {(64, 48)}
    assert [f.time for f in frames] == pytest.approx([i / 16 for i in range(13)])
    assert writer.bytes_out == len(stream)
    assert writer.fragments == 4


def test_the_first_push_carries_the_init_segment_when_begin_was_not_called() -> None:
    writer = FragmentedMp4Writer(32, 32, 8)
    first = writer.push(noise_frames(1, 32, 32))
    assert [kind for kind, _ in top_level_boxes(first)] == ["ftyp", "moov", "moof", "mdat"]
    assert len(decode(first + writer.finish())) == 1


def test_colours_survive_the_rgb_to_yuv_round_trip() -> None:
    writer = FragmentedMp4Writer(64, 64, 8)
    frame = np.zeros((1, 64, 64, 3), dtype=np.uint8)
    frame[..., 0], frame[..., 1], frame[..., 2] = 200, 50, 100
    [decoded] = decode(writer.push(frame) + writer.finish())
    assert decoded.to_ndarray(format="rgb24").reshape(-1, 3).mean(axis=0) == pytest.approx([200, 50, 100], abs=4)


def test_the_mime_names_the_profile_and_level_of_the_init_segment() -> None:
    writer = FragmentedMp4Writer(64, 64, 8)
    init = writer.init_segment
    record = init[init.index(b"avcC") + 4 :]
    assert record[0] == 1
    assert writer.codec_string == f"avc1.{record[1]:02x}{record[2]:02x}{record[3]:02x}"
    assert writer.mime == f'video/mp4; codecs="{writer.codec_string}"'


def test_avc_decoder_config_from_an_annex_b_header() -> None:
    sps = bytes([0x67, 100, 0, 31, 0xAC])  # High profile (100), level 3.1
    pps = bytes([0x68, 0xEE, 0x3C, 0x80])
    record = avc_decoder_config(b"\x00\x00\x00\x01" + sps + b"\x00\x00\x01" + pps)
    expected = bytes([1, 100, 0, 31, 0xFF, 0xE1]) + struct.pack(">H", 5) + sps + b"\x01" + struct.pack(">H", 4) + pps
    assert record == expected + bytes([0xFD, 0xF8, 0xF8, 0])  # High profile: 4:2:0, 8-bit, no SPS extensions
    assert avc_decoder_config(record) == record
    with pytest.raises(VideoEncodeError):
        avc_decoder_config(b"\x00\x00\x01" + pps)


def test_bad_sizes_and_frames_are_refused() -> None:
    with pytest.raises(VideoEncodeError):
        FragmentedMp4Writer(63, 64, 8)
    with pytest.raises(VideoEncodeError):
        FragmentedMp4Writer(64, 64, 0)
    writer = FragmentedMp4Writer(64, 64, 8)
    with pytest.raises(VideoEncodeError):
        writer.push(noise_frames(1, 32, 64))
    writer.finish()
    with pytest.raises(VideoEncodeError):
        writer.push(noise_frames(1, 64, 64))
