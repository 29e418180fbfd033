"""Streaming sample-rate conversion of mono s16le PCM, bytes in and bytes out."""

from __future__ import annotations

import errno
from fractions import Fraction

import av
import numpy as np
from av.error import FFmpegError
from av.filter import Graph

SAMPLE_WIDTH = 2
"""Bytes per mono s16le sample."""


def pcm_to_frame(pcm: bytes, sample_rate: int, pts: int) -> av.AudioFrame:
    """Wrap whole mono s16le samples in a PyAV frame stamped ``pts`` in units of 1/``sample_rate``."""
    samples = np.frombuffer(pcm, dtype="<i2").reshape(1, -1)
    frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
    frame.sample_rate = sample_rate
    frame.time_base = Fraction(1, sample_rate)
    frame.pts = pts
    return frame


class StreamResampler:
    """Converts a stream of mono s16le PCM from ``in_rate`` to ``out_rate``, one piece at a time.

    Pieces may have any length (whole samples). The filter keeps a short history between pieces, so the output
    of many small pieces equals that of one large piece; :meth:`flush` returns the tail it still holds. Equal
    rates pass bytes through untouched.

    The filter graph is the one ``av.AudioResampler`` builds (``abuffer -> aformat -> abuffersink``, same output),
    made with one thread: FFmpeg's default starts a pool of one thread per core for every graph, so each live
    stream held that many idle threads.
    """

    def __init__(self, in_rate: int, out_rate: int) -> None:
        if in_rate <= 0 or out_rate <= 0:
            raise ValueError(f"sample rates must be positive, got {in_rate} -> {out_rate}")
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._graph: Graph | None = None
        self._pts = 0
        self._flushed = False

    @property
    def passthrough(self) -> bool:
        """True when the rates are equal and bytes go through unchanged."""
        return self.in_rate == self.out_rate

    def process(self, pcm: bytes) -> bytes:
        """Resample a piece of whole s16le samples; returns the output samples ready so far (may be empty)."""
        if len(pcm) % SAMPLE_WIDTH:
            raise ValueError(f"s16le PCM must hold whole samples, got {len(pcm)} bytes")
        if self._flushed:
            raise RuntimeError("StreamResampler was flushed; create a new one for a new stream")
        if self.passthrough or not pcm:
            return pcm
        frame = pcm_to_frame(pcm, self.in_rate, self._pts)
        self._pts += frame.samples
        return self._filter(frame)

    def flush(self) -> bytes:
        """End the stream and return the samples the filter still holds; the resampler is then finished."""
        if self._flushed:
            raise RuntimeError("StreamResampler was already flushed")
        self._flushed = True
        if self.passthrough or self._graph is None:
            return b""
        return self._filter(None)

    def _filter(self, frame: av.AudioFrame | None) -> bytes:
        graph = self._graph
        if graph is None:
            graph = self._graph = _single_thread_graph(self.in_rate, self.out_rate)
        graph.push(frame)
        frames: list[av.AudioFrame] = []
        while True:
            try:
                out = graph.pull()
            except EOFError:
                break
            except FFmpegError as exc:
                if exc.errno != errno.EAGAIN:
                    raise
                break
            assert isinstance(out, av.AudioFrame)
            frames.append(out)
        return _frames_to_pcm(frames)


def _single_thread_graph(in_rate: int, out_rate: int) -> Graph:
    graph = Graph()
    graph.threads = 1  # before any filter is added
    source = graph.add(
        "abuffer", sample_rate=str(in_rate), sample_fmt="s16", channel_layout="mono", time_base=f"1/{in_rate}"
    )
    convert = graph.add("aformat", sample_rates=str(out_rate), sample_fmts="s16", channel_layouts="mono")
    sink = graph.add("abuffersink")
    source.link_to(convert)
    convert.link_to(sink)
    graph.configure()
    return graph


def _frames_to_pcm(frames: list[av.AudioFrame]) -> bytes:
    # to_ndarray trims the plane to the frame's samples; the raw plane buffer may carry alignment padding.
    return b"".join(frame.to_ndarray().tobytes() for frame in frames)
