"""The counters of the Qwen3-Omni input encoder's thread (:mod:`omnigate.engines.qwen3_omni.encoder`), free of model
imports so that ``/metrics`` reads them without loading torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EncoderStats:
    """What the encoder's thread did since it started: the calls of each encoder and what they carried (camera
    frames and the questions that asked for them, user turns' audio, the windows of turns heard ahead); per call is
    items over calls."""

    frame_calls: int = 0
    frames: int = 0
    frame_requests: int = 0
    largest_frame_call: int = 0
    audio_calls: int = 0
    audio_items: int = 0
    largest_audio_call: int = 0
    windows_ahead: int = 0  # windows of turns in progress encoded while they were heard (again when they changed)
    windows_kept: int = 0  # of those, windows whose tokens a turn's end used
    failed_calls: int = 0
