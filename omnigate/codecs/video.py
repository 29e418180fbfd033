"""Streaming H.264 in fragmented MP4: RGB frame groups in, an init segment and then one fragment per group out.

libx264 (through PyAV) encodes with ``tune=zerolatency`` (no B-frames, no lookahead), so every frame's packet
leaves the encoder as the frame goes in. FFmpeg's MP4 muxer, even with ``empty_moov+default_base_moof``, writes a
fragment only when the *next* packet arrives, which would hold each group back until the following one exists;
so the boxes are written here: one ``moof``+``mdat`` per pushed group, out the moment the group is encoded. The
layout is the one FFmpeg writes for ``movflags=empty_moov+default_base_moof`` (what Media Source Extensions take):
an init segment (``ftyp`` + ``moov`` with an ``avcC`` and ``mvex``, no samples), then fragments whose ``tfhd``
has default-base-is-moof and whose ``tfdt`` carries the decode time.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from fractions import Fraction

import av
import numpy as np
import numpy.typing as npt
from av.codec.context import Flags
from av.stream import Stream
from av.video.codeccontext import VideoCodecContext

# Per-sample ticks: the track's timescale is fps * TICKS_PER_FRAME, so every integer rate is exact.
TICKS_PER_FRAME = 1000
_TRACK_ID = 1
_UNITY_MATRIX = struct.pack(">9I", 0x00010000, 0, 0, 0, 0x00010000, 0, 0, 0, 0x40000000)
_SYNC_SAMPLE = 0x02000000  # sample_depends_on = 2: an I-frame
_NON_SYNC_SAMPLE = 0x01010000  # sample_depends_on = 1, sample_is_non_sync_sample = 1
_TRUN_FLAGS = 0x000001 | 0x000100 | 0x000200 | 0x000400  # data offset; per-sample duration, size and flags
_DEFAULT_BASE_IS_MOOF = 0x020000
_HIGH_PROFILES = frozenset({100, 110, 122, 144})  # their avcC carries the chroma and bit-depth fields
_NAL_SPS, _NAL_PPS, _NAL_AUD = 7, 8, 9

RgbFrames = npt.NDArray[np.uint8]
"""``(frames, height, width, 3)`` uint8 RGB."""


class VideoEncodeError(ValueError):
    """Frames or settings the encoder cannot take."""


def _box(kind: bytes, *payload: bytes) -> bytes:
    body = b"".join(payload)
    return struct.pack(">I4s", 8 + len(body), kind) + body


def _full_box(kind: bytes, version: int, flags: int, *payload: bytes) -> bytes:
    return _box(kind, struct.pack(">I", (version << 24) | flags), *payload)


def _nal_units(annex_b: bytes) -> Iterator[bytes]:
    """The NAL units of an Annex B byte stream (3- or 4-byte start codes)."""
    starts: list[tuple[int, int]] = []  # (start code offset, payload offset)
    i = annex_b.find(b"\x00\x00\x01")
    while i >= 0:
        code_at = i - 1 if i > 0 and annex_b[i - 1] == 0 else i
        starts.append((code_at, i + 3))
        i = annex_b.find(b"\x00\x00\x01", i + 3)
    for n, (_, payload_at) in enumerate(starts):
        end = starts[n + 1][0] if n + 1 < len(starts) else len(annex_b)
        if end > payload_at:
            yield annex_b[payload_at:end]


def _length_prefixed(annex_b: bytes) -> bytes:
    """An access unit as MP4 stores it: each NAL unit behind a 4-byte big-endian length (no access unit delimiters)."""
    return b"".join(struct.pack(">I", len(nal)) + nal for nal in _nal_units(annex_b) if nal[0] & 0x1F != _NAL_AUD)


def avc_decoder_config(extradata: bytes) -> bytes:
    """The ``avcC`` payload (AVCDecoderConfigurationRecord) from the encoder's global header.

    libx264 writes its global header in Annex B form (SPS and PPS behind start codes); a header that already is an
    avcC record (first byte 1) passes through.
    """
    if extradata[:1] == b"\x01":
        return extradata
    nals = list(_nal_units(extradata))
    sps = [nal for nal in nals if nal[0] & 0x1F == _NAL_SPS]
    pps = [nal for nal in nals if nal[0] & 0x1F == _NAL_PPS]
    if not sps or not pps:
        raise VideoEncodeError("the H.264 encoder header lacks an SPS or a PPS")
    profile, compatibility, level = sps[0][1], sps[0][2], sps[0][3]
    record = bytes([1, profile, compatibility, level, 0xFC | 3, 0xE0 | len(sps)])
    record += b"".join(struct.pack(">H", len(nal)) + nal for nal in sps)
    record += bytes([len(pps)]) + b"".join(struct.pack(">H", len(nal)) + nal for nal in pps)
    if profile in _HIGH_PROFILES:
        # 4:2:0, 8-bit luma and chroma, no SPS extensions: what the encoder is set up for below.
        record += bytes([0xFC | 1, 0xF8, 0xF8, 0])
    return record


class FragmentedMp4Writer:
    """One H.264 fMP4 stream of fixed size and rate. Not thread-safe: one caller at a time (any thread).

    :attr:`init_segment` exists from construction (the browser's ``SourceBuffer`` takes it first): :meth:`begin`
    hands it out, or the first :meth:`push` puts it before its fragment. Each :meth:`push` returns one
    ``moof``+``mdat`` holding exactly that group of frames. :meth:`finish` drains the encoder (nothing, with
    zerolatency).
    """

    def __init__(
        self,
        width: int,
        height: int,
        fps: int,
        *,
        preset: str = "veryfast",
        crf: int = 23,
        keyframe_interval: int | None = None,
    ) -> None:
        if width <= 0 or height <= 0 or width % 2 or height % 2:
            raise VideoEncodeError(f"H.264 4:2:0 needs an even, positive size; got {width}x{height}")
        if not 1 <= fps <= 240:
            raise VideoEncodeError(f"fps must be within 1..240; got {fps}")
        self.width = width
        self.height = height
        self.fps = fps
        self.timescale = fps * TICKS_PER_FRAME
        encoder = av.CodecContext.create("libx264", "w")
        if not isinstance(encoder, VideoCodecContext):
            raise VideoEncodeError("libx264 is not a video encoder in this PyAV build")
        encoder.width = width
        encoder.height = height
        encoder.pix_fmt = "yuv420p"
        encoder.time_base = Fraction(1, fps)
        encoder.framerate = Fraction(fps)
        encoder.gop_size = keyframe_interval or 2 * fps
        encoder.max_b_frames = 0
        encoder.flags |= Flags.global_header  # SPS/PPS in extradata, for the avcC of the init segment
        encoder.options = {"preset": preset, "tune": "zerolatency", "crf": str(crf)}
        encoder.open()
        if not encoder.extradata:
            raise VideoEncodeError("libx264 produced no global header")
        self._encoder = encoder
        self._avcc = avc_decoder_config(encoder.extradata)
        self.init_segment = self._build_init_segment()
        self.frames_in = 0
        self.samples_out = 0
        self.fragments = 0
        self.bytes_out = 0
        self._init_sent = False
        self._finished = False

    @property
    def codec_string(self) -> str:
        """RFC 6381 codec of the stream, e.g. ``avc1.64001f``."""
        return f"avc1.{self._avcc[1]:02x}{self._avcc[2]:02x}{self._avcc[3]:02x}"

    @property
    def mime(self) -> str:
        """The MIME type a browser's ``MediaSource.addSourceBuffer`` takes."""
        return f'video/mp4; codecs="{self.codec_string}"'

    def begin(self) -> bytes:
        """The init segment, if it has not gone out yet (then :meth:`push` returns fragments only)."""
        return self._emit([])

    def push(self, frames: RgbFrames | Sequence[RgbFrames]) -> bytes:
        """Encode a group of ``(H, W, 3)`` uint8 RGB frames; return the bytes to send now (init segment first)."""
        if self._finished:
            raise VideoEncodeError("the stream is finished")
        packets: list[av.Packet[Stream]] = []
        for rgb in frames:
            if rgb.shape != (self.height, self.width, 3) or rgb.dtype != np.uint8:
                raise VideoEncodeError(
                    f"expected ({self.height}, {self.width}, 3) uint8 RGB frames; got {rgb.shape} {rgb.dtype}"
                )
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24").reformat(format="yuv420p")
            frame.pts = self.frames_in
            self.frames_in += 1
            packets.extend(self._encoder.encode(frame))
        return self._emit(packets)

    def finish(self) -> bytes:
        """Drain the encoder; returns a last fragment if it held any frames back (zerolatency holds none)."""
        if self._finished:
            return b""
        packets = list(self._encoder.encode(None))
        self._finished = True
        return self._emit(packets)

    def _emit(self, packets: list[av.Packet[Stream]]) -> bytes:
        out = b""
        if not self._init_sent:
            self._init_sent = True
            out = self.init_segment
        if packets:
            out += self._fragment(packets)
        self.bytes_out += len(out)
        return out

    def _fragment(self, packets: list[av.Packet[Stream]]) -> bytes:
        samples = [_length_prefixed(bytes(packet)) for packet in packets]
        entries = b"".join(
            struct.pack(
                ">III",
                TICKS_PER_FRAME,
                len(sample),
                _SYNC_SAMPLE if packet.is_keyframe else _NON_SYNC_SAMPLE,
            )
            for packet, sample in zip(packets, samples, strict=True)
        )
        # No B-frames, so the n-th packet is the n-th frame: decode time is the running sample count.
        base_time = self.samples_out * TICKS_PER_FRAME
        self.fragments += 1

        def moof(data_offset: int) -> bytes:
            return _box(
                b"moof",
                _full_box(b"mfhd", 0, 0, struct.pack(">I", self.fragments)),
                _box(
                    b"traf",
                    _full_box(b"tfhd", 0, _DEFAULT_BASE_IS_MOOF, struct.pack(">I", _TRACK_ID)),
                    _full_box(b"tfdt", 1, 0, struct.pack(">Q", base_time)),
                    _full_box(b"trun", 0, _TRUN_FLAGS, struct.pack(">Ii", len(samples), data_offset), entries),
                ),
            )

        header = moof(0)
        header = moof(len(header) + 8)  # samples start right after the mdat header
        self.samples_out += len(samples)
        return header + _box(b"mdat", *samples)

    def _build_init_segment(self) -> bytes:
        ftyp = _box(b"ftyp", b"isom", struct.pack(">I", 0x200), b"isom", b"iso6", b"iso2", b"avc1", b"mp41")
        mvhd = _full_box(
            b"mvhd",
            0,
            0,
            struct.pack(">IIII", 0, 0, self.timescale, 0),
            struct.pack(">IH", 0x00010000, 0x0100),
            bytes(10),
            _UNITY_MATRIX,
            bytes(24),
            struct.pack(">I", _TRACK_ID + 1),
        )
        tkhd = _full_box(
            b"tkhd",
            0,
            0x000003,  # enabled, in movie
            struct.pack(">IIIII", 0, 0, _TRACK_ID, 0, 0),
            bytes(8),
            struct.pack(">hhhH", 0, 0, 0, 0),
            _UNITY_MATRIX,
            struct.pack(">II", self.width << 16, self.height << 16),
        )
        mdhd = _full_box(b"mdhd", 0, 0, struct.pack(">IIIIHH", 0, 0, self.timescale, 0, 0x55C4, 0))  # 'und'
        hdlr = _full_box(b"hdlr", 0, 0, struct.pack(">I4s", 0, b"vide"), bytes(12), b"VideoHandler\x00")
        name = b"omnigate h264"
        compressor = (bytes([len(name)]) + name).ljust(32, b"\x00")
        avc1 = _box(
            b"avc1",
            bytes(6),
            struct.pack(">H", 1),  # data reference index
            bytes(16),
            struct.pack(">HH", self.width, self.height),
            struct.pack(">II", 0x00480000, 0x00480000),  # 72 dpi
            struct.pack(">IH", 0, 1),  # one frame per sample
            compressor,
            struct.pack(">Hh", 0x0018, -1),
            _box(b"avcC", self._avcc),
        )
        stbl = _box(
            b"stbl",
            _full_box(b"stsd", 0, 0, struct.pack(">I", 1), avc1),
            _full_box(b"stts", 0, 0, struct.pack(">I", 0)),
            _full_box(b"stsc", 0, 0, struct.pack(">I", 0)),
            _full_box(b"stsz", 0, 0, struct.pack(">II", 0, 0)),
            _full_box(b"stco", 0, 0, struct.pack(">I", 0)),
        )
        minf = _box(
            b"minf",
            _full_box(b"vmhd", 0, 1, bytes(8)),
            _box(b"dinf", _full_box(b"dref", 0, 0, struct.pack(">I", 1), _full_box(b"url ", 0, 1))),
            stbl,
        )
        trak = _box(b"trak", tkhd, _box(b"mdia", mdhd, hdlr, minf))
        trex = _full_box(b"trex", 0, 0, struct.pack(">IIIII", _TRACK_ID, 1, 0, 0, 0))
        return ftyp + _box(b"moov", mvhd, trak, _box(b"mvex", trex))


def top_level_boxes(data: bytes) -> list[tuple[str, int]]:
    """``(type, size)`` of each top-level box of an ISO BMFF byte string (to inspect segments)."""
    boxes: list[tuple[str, int]] = []
    offset = 0
    while offset + 8 <= len(data):
        size, kind = struct.unpack_from(">I4s", data, offset)
        if size < 8:
            raise ValueError(f"malformed box at offset {offset}")
        boxes.append((kind.decode("latin-1"), size))
        offset += size
    if offset != len(data):
        raise ValueError("trailing bytes after the last box")
    return boxes
