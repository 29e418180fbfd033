"""Fuzz targets, one module per wire protocol; each module defines ``TARGET``. Adding a protocol is adding a file."""

from __future__ import annotations

import importlib
import pkgutil

from tests.fuzz.harness import HttpTarget, WsTarget


def all_targets() -> list[WsTarget | HttpTarget]:
    """Every ``TARGET`` of the modules in this package, in module-name order."""
    targets: list[WsTarget | HttpTarget] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        targets.append(module.TARGET)
    return targets
