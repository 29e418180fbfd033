"""``omnigate serve`` with the engine's steps under cProfile, to see where a server step's host time goes.

Usage: ``python benchmarks/profiled_server.py --profile-out FILE serve ...`` (the rest is ``omnigate``'s command
line). The profiler is switched on for the duration of each ``EnginePool._run_step`` call (the engine step and the
pool's bookkeeping around it). On Python 3.11 that profiles the scheduler thread alone; from 3.12 cProfile hooks every
thread while it is on, so the event loop's work during steps shows up too (read the engine's functions by name). On
exit the statistics are written to ``FILE`` (pstats) and the top functions by cumulative and by own time to
``FILE.txt``.
"""

from __future__ import annotations

import argparse
import atexit
import cProfile
import io
import pstats
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omnigate.engines.pool import EnginePool
from omnigate.gateway.cli.serve import main


def install(out: Path) -> None:
    """Wrap ``EnginePool._run_step`` so every call runs under one shared profiler (one worker thread at a time)."""
    profiler = cProfile.Profile()
    lock = threading.Lock()
    run_step = EnginePool._run_step

    def profiled(self: EnginePool, batch: Sequence[Any], budgets: Sequence[float]) -> None:
        with lock:
            profiler.enable()
            try:
                run_step(self, batch, budgets)
            finally:
                profiler.disable()

    EnginePool._run_step = profiled  # type: ignore[method-assign]

    def dump() -> None:
        profiler.dump_stats(out)
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(30)
        out.with_suffix(out.suffix + ".txt").write_text(text.getvalue())

    atexit.register(dump)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile-out", type=Path, required=True)
    known, rest = parser.parse_known_args()
    install(known.profile_out)
    sys.exit(main(rest))
