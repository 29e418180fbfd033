"""Engine families by name: ``omnigate serve --engine NAME --model SPEC`` resolves here.

Each loader imports its family lazily, so the gateway starts without torch unless a model engine is chosen; the
optional extra each family needs is in :mod:`omnigate.engines.extras`, which ``omnigate serve`` checks at startup.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from omnigate.engines.base import Engine

if TYPE_CHECKING:
    from omnigate.engines.video.engine import VideoEngine

EngineLoader = Callable[..., Engine]


def _load_hibari(model: str | None, **options: Any) -> Engine:
    from omnigate.engines.hibari import HibariEngine

    return HibariEngine.load(model, **options)


def _load_piper(model: str | None, **options: Any) -> Engine:
    from omnigate.engines.piper import PiperEngine

    return PiperEngine.load(model, **options)


def _load_synthetic(model: str | None, **options: Any) -> Engine:
    from omnigate.engines.synthetic import SyntheticEngine

    return SyntheticEngine.from_spec(model, **options)


def _load_talker(model: str | None, **options: Any) -> Engine:
    from omnigate.engines.talker.engine import TalkerEngine

    return TalkerEngine.load(model, **options)


def _load_duplex(model: str | None, **options: Any) -> Engine:
    from omnigate.engines.duplex.engine import DuplexEngine

    return DuplexEngine.load(model, **options)


def _load_qwen3_omni(model: str | None, **options: Any) -> Engine:
    from omnigate.engines.qwen3_omni.serving import Qwen3OmniServing

    return Qwen3OmniServing.load(model, **options)


LOADERS: dict[str, EngineLoader] = {
    "hibari": _load_hibari,
    "piper": _load_piper,
    "synthetic": _load_synthetic,
    "talker": _load_talker,
    "duplex": _load_duplex,
    "qwen3-omni": _load_qwen3_omni,
}

DEFAULT_ENGINE = "hibari"


def load_video_engine(model: str | None, **options: Any) -> VideoEngine:
    """The video engine (``--video-model``). It is not a speech engine, so it is loaded beside the one of LOADERS."""
    from omnigate.engines.video.engine import VideoEngine

    return VideoEngine.load(model, **options)


def load_engine(family: str, model: str | None = None, **options: Any) -> Engine:
    """Load an engine family; ``model`` is a path, a package voice name, or ``preset:NAME``."""
    try:
        loader = LOADERS[family]
    except KeyError:
        raise ValueError(f"unknown engine {family!r}; choose one of {', '.join(sorted(LOADERS))}") from None
    return loader(model, **options)
