"""The audio formats the gateway serves and the rules that pick each one's output sample rate."""

from __future__ import annotations

import msgspec

OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
MP3_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
AAC_RATES = (7350, 8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)


class AudioFormat(msgspec.Struct, frozen=True):
    """One served audio format: what the client sees (name, MIME type, extension) and how it is produced.

    ``container`` and ``codec`` name the PyAV muxer and encoder; both are None for the raw formats (pcm, wav),
    which are produced as plain bytes.
    """

    name: str
    content_type: str
    extension: str
    sample_rates: tuple[int, ...] | None
    """Rates the codec accepts; None means any positive rate."""
    default_rate: int | None = None
    """Rate used when none is requested, and when the wanted rate is not accepted; None means the input rate
    when nothing is requested and the nearest accepted rate otherwise."""
    container: str | None = None
    codec: str | None = None
    sample_format: str | None = None
    """The encoder's input sample format (PyAV name)."""
    bit_rate: int | None = None
    container_options: tuple[tuple[str, str], ...] = ()

    @property
    def raw(self) -> bool:
        """True for formats written as plain PCM bytes, without an encoder."""
        return self.codec is None

    def accepts(self, rate: int) -> bool:
        """Whether the codec can encode at ``rate`` without resampling to another rate."""
        return rate > 0 and (self.sample_rates is None or rate in self.sample_rates)

    def output_rate(self, input_rate: int, requested: int | None = None) -> int:
        """The rate this format's stream will have for audio arriving at ``input_rate``.

        A requested rate the codec accepts wins. Otherwise the format's default rate applies if it has one
        (Opus: 48 kHz), else the input rate if accepted, else the accepted rate nearest to the wanted one.
        """
        if input_rate <= 0:
            raise ValueError(f"input sample rate must be positive, got {input_rate}")
        if requested is not None and requested <= 0:
            raise ValueError(f"requested sample rate must be positive, got {requested}")
        if requested is not None and self.accepts(requested):
            return requested
        if self.default_rate is not None:
            return self.default_rate
        wanted = input_rate if requested is None else requested
        if self.accepts(wanted):
            return wanted
        assert self.sample_rates is not None  # accepts() is only False for a finite rate list
        # Ties go to the higher rate, which keeps more of the signal.
        return min(self.sample_rates, key=lambda rate: (abs(rate - wanted), -rate))


class UnsupportedFormat(ValueError):
    """An audio format name the gateway does not serve."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.valid = tuple(FORMATS)
        super().__init__(f"unsupported audio format {name!r}; expected one of: {', '.join(self.valid)}")


# Flush the output after every packet so each encoded packet reaches the sink (and the client) at once.
_FLUSH_EVERY_PACKET = ("flush_packets", "1")

FORMATS: dict[str, AudioFormat] = {
    fmt.name: fmt
    for fmt in (
        AudioFormat(name="pcm", content_type="audio/pcm", extension="pcm", sample_rates=None),
        AudioFormat(name="wav", content_type="audio/wav", extension="wav", sample_rates=None),
        AudioFormat(
            name="opus",
            content_type="audio/ogg",
            extension="opus",
            sample_rates=OPUS_RATES,
            default_rate=48000,
            container="ogg",
            codec="libopus",
            sample_format="s16",
            bit_rate=32_000,
            # One Ogg page per 20 ms packet instead of ~1 s pages: latency over a few bytes of page overhead.
            container_options=(("page_duration", "20000"), _FLUSH_EVERY_PACKET),
        ),
        AudioFormat(
            name="mp3",
            content_type="audio/mpeg",
            extension="mp3",
            sample_rates=MP3_RATES,
            container="mp3",
            codec="libmp3lame",
            sample_format="s16p",
            bit_rate=64_000,
            # A bare MPEG frame stream: no ID3 tag in front, so streams concatenate and play from any cut.
            container_options=(("id3v2_version", "0"), ("write_xing", "0"), _FLUSH_EVERY_PACKET),
        ),
        AudioFormat(
            name="aac",
            content_type="audio/aac",
            extension="aac",
            sample_rates=AAC_RATES,
            container="adts",
            codec="aac",
            sample_format="fltp",
            bit_rate=64_000,
            container_options=(_FLUSH_EVERY_PACKET,),
        ),
        AudioFormat(
            name="flac",
            content_type="audio/flac",
            extension="flac",
            sample_rates=None,
            container="flac",
            codec="flac",
            sample_format="s16",
            # No 8 KiB padding block after the header: nothing can seek back to fill it in a stream.
            container_options=(("metadata_header_padding", "0"), _FLUSH_EVERY_PACKET),
        ),
    )
}


def get_format(name: str) -> AudioFormat:
    """The served format called ``name`` (case-insensitive); raises :class:`UnsupportedFormat` otherwise."""
    fmt = FORMATS.get(name.lower())
    if fmt is None:
        raise UnsupportedFormat(name)
    return fmt
