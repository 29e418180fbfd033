"""Streaming audio encoders: mono s16le PCM in, the bytes of a served audio format out as they are ready."""

from __future__ import annotations

import struct
from typing import Protocol

import av
from av.audio.stream import AudioStream

from omnigate.codecs.formats import AudioFormat, get_format
from omnigate.codecs.resample import SAMPLE_WIDTH, StreamResampler, pcm_to_frame

_UNKNOWN_SIZE = 0xFFFFFFFF


WAV_HEADER_BYTES = 44


def streaming_wav_header(sample_rate: int) -> bytes:
    """A 44-byte mono s16le WAV header for a stream of unknown length (RIFF and data sizes 0xFFFFFFFF)."""
    byte_rate = sample_rate * SAMPLE_WIDTH
    return (
        struct.pack("<4sI4s", b"RIFF", _UNKNOWN_SIZE, b"WAVE")
        + struct.pack("<4sIHHIIHH", b"fmt ", 16, 1, 1, sample_rate, byte_rate, SAMPLE_WIDTH, 16)
        + struct.pack("<4sI", b"data", _UNKNOWN_SIZE)
    )


class _Backend(Protocol):
    def encode(self, pcm: bytes) -> bytes: ...
    def flush(self) -> bytes: ...
    def close(self) -> None: ...


class _RawBackend:
    """pcm and wav: plain bytes (an optional header, then the samples), resampled only when asked to."""

    def __init__(self, header: bytes, input_rate: int, output_rate: int) -> None:
        self._header = header
        self._resampler = StreamResampler(input_rate, output_rate) if input_rate != output_rate else None

    def _take_header(self) -> bytes:
        header, self._header = self._header, b""
        return header

    def encode(self, pcm: bytes) -> bytes:
        body = pcm if self._resampler is None else self._resampler.process(pcm)
        return self._take_header() + body if self._header else body

    def flush(self) -> bytes:
        tail = b"" if self._resampler is None else self._resampler.flush()
        return self._take_header() + tail

    def close(self) -> None:
        self._resampler = None


class _ChunkSink:
    """A write-only file for the muxer: collects what it writes until the encoder hands it out."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._chunks.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data


class _ContainerBackend:
    """Codec formats: a PyAV encoder muxed into a container that writes to memory as packets come out.

    PyAV's encoder converts each input frame to the codec's rate and sample format and cuts it into the
    codec's frame size (an ``av.AudioResampler`` inside the codec context), so pieces need no alignment.
    """

    def __init__(self, fmt: AudioFormat, input_rate: int, output_rate: int) -> None:
        assert fmt.container is not None
        assert fmt.codec is not None
        self._input_rate = input_rate
        self._pts = 0
        self._sink = _ChunkSink()
        self._container = av.open(self._sink, "w", format=fmt.container, options=dict(fmt.container_options))
        stream = self._container.add_stream(fmt.codec, rate=output_rate)
        if not isinstance(stream, AudioStream):
            raise TypeError(f"codec {fmt.codec!r} is not an audio codec")
        stream.layout = "mono"
        if fmt.sample_format is not None:
            stream.format = fmt.sample_format
        if fmt.bit_rate is not None:
            stream.bit_rate = fmt.bit_rate
        self._stream = stream

    def encode(self, pcm: bytes) -> bytes:
        if not pcm:
            return b""
        frame = pcm_to_frame(pcm, self._input_rate, self._pts)
        self._pts += frame.samples
        self._container.mux(self._stream.encode(frame))
        return self._sink.take()

    def flush(self) -> bytes:
        self._container.mux(self._stream.encode(None))
        self._container.close()
        return self._sink.take()

    def close(self) -> None:
        self._container.close()
        self._sink.take()


class AudioEncoder:
    """Encodes one utterance's mono s16le PCM stream into ``fmt``, returning bytes as soon as they are ready.

    Feed :meth:`encode` pieces of any length (odd byte counts too: a split sample is kept until its second
    byte arrives), then call :meth:`flush` once to drain the codec and end the container. Concatenating every
    returned piece gives a complete file. ``output_rate`` is a requested rate, resolved with
    :meth:`AudioFormat.output_rate`; the resolved rate is :attr:`output_rate`.
    """

    def __init__(self, fmt: AudioFormat | str, input_rate: int, output_rate: int | None = None) -> None:
        self.format = get_format(fmt) if isinstance(fmt, str) else fmt
        self.input_rate = input_rate
        self.output_rate = self.format.output_rate(input_rate, output_rate)
        self.encoded_bytes = 0
        """Bytes returned so far."""
        self.input_samples = 0
        """Whole input samples received so far."""
        self._odd_byte = b""
        self._finished = False
        self._backend: _Backend
        if self.format.raw:
            header = streaming_wav_header(self.output_rate) if self.format.name == "wav" else b""
            self._backend = _RawBackend(header, input_rate, self.output_rate)
        else:
            self._backend = _ContainerBackend(self.format, input_rate, self.output_rate)

    @property
    def costly(self) -> bool:
        """Whether :meth:`encode` does real CPU work (codec or resampling) and belongs off the event loop."""
        return not self.format.raw or self.input_rate != self.output_rate

    @property
    def finished(self) -> bool:
        """True after :meth:`flush` or :meth:`close`."""
        return self._finished

    def encode(self, pcm: bytes) -> bytes:
        """Take the next piece of mono s16le PCM; return the encoded bytes ready now (possibly none)."""
        if self._finished:
            raise RuntimeError(f"{self.format.name} encoder is finished; create a new one per stream")
        data = self._odd_byte + pcm if self._odd_byte else pcm
        whole = len(data) - len(data) % SAMPLE_WIDTH
        self._odd_byte = data[whole:]
        self.input_samples += whole // SAMPLE_WIDTH
        out = self._backend.encode(data[:whole] if self._odd_byte else data)
        self.encoded_bytes += len(out)
        return out

    def flush(self) -> bytes:
        """End the stream: drain the codec, write the container trailer, return the last bytes.

        A dangling half sample is dropped. The encoder is finished afterwards.
        """
        if self._finished:
            raise RuntimeError(f"{self.format.name} encoder was already finished")
        self._finished = True
        out = self._backend.flush()
        self.encoded_bytes += len(out)
        return out

    def close(self) -> None:
        """Abandon the stream without producing its tail (for a cancelled utterance). Safe to call twice."""
        if not self._finished:
            self._finished = True
            self._backend.close()


def complete_wav(data: bytes) -> bytes:
    """A whole streamed WAV file with its real RIFF and data sizes in place of the streaming 0xFFFFFFFF ones."""
    if len(data) < WAV_HEADER_BYTES or data[:4] != b"RIFF":
        raise ValueError("not a WAV stream")
    data_size = len(data) - WAV_HEADER_BYTES
    return b"".join(
        (
            data[:4],
            struct.pack("<I", 36 + data_size),
            data[8:40],
            struct.pack("<I", data_size),
            data[WAV_HEADER_BYTES:],
        )
    )


def encode_all(fmt: AudioFormat | str, pcm: bytes, input_rate: int, output_rate: int | None = None) -> bytes:
    """Encode a whole mono s16le clip into ``fmt`` in one call (the non-streaming path)."""
    encoder = AudioEncoder(fmt, input_rate, output_rate)
    return encoder.encode(pcm) + encoder.flush()
