"""Audio encoding for the wire: served formats, streaming encoders and resampling of mono s16le PCM."""

from omnigate.codecs.encoder import AudioEncoder, encode_all
from omnigate.codecs.formats import FORMATS, AudioFormat, UnsupportedFormat, get_format
from omnigate.codecs.resample import StreamResampler

__all__ = [
    "FORMATS",
    "AudioEncoder",
    "AudioFormat",
    "StreamResampler",
    "UnsupportedFormat",
    "encode_all",
    "get_format",
]
