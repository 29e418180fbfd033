"""``omnigate serve`` with the engine's steps under cProfile, to see where a server step's host time goes.

Usage: ``python benchmarks/profiled_server.py --profile-out FILE serve ...`` (the rest is ``omnigate``'s command
line). The profiler is switched on for the duration of each ``EnginePool._run_step`` call (the engine step and the
pool's bookkeeping around it) in the process that runs the engine: the serve process itself with
``--engine-process inline``, else the engine core, which the serve supervisor then starts through this script
(``--core``). On Python 3.11 that profiles the scheduler thread alone; from 3.12 cProfile hooks every thread while
it is on, so the event loop's work during steps shows up too (read the engine's functions by name). On exit the
statistics are written to ``FILE`` (pstats) and the top functions by cumulative and by own time to ``FILE.txt``.
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


def install(out: Path) -> None:
    """Wrap ``EnginePool._run_step`` so every call runs under one shared profiler (one worker thread at a time)."""
    profiler = cProfile.Profile()
    lock = threading.Lock()
    run_step = EnginePool._run_step
    steps = [0]

    def profiled(self: EnginePool, *args: Any) -> None:
        with lock:
            steps[0] += 1
            profiler.enable()
            try:
                run_step(self, *args)
            finally:
                profiler.disable()

    EnginePool._run_step = profiled  # type: ignore[method-assign]

    def dump() -> None:
        if not steps[0]:
            return  # this process stepped no engine (the serve supervisor, with the engine in a core)
        profiler.dump_stats(out)
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(30)
        out.with_suffix(out.suffix + ".txt").write_text(text.getvalue())

    atexit.register(dump)


def start_cores_profiled(out: Path) -> None:
    """Have the serve supervisor start its engine core through this script, profiled into ``out``."""
    from omnigate.gateway.cli.supervisor import Supervisor

    init = Supervisor.__init__

    def profiled_core(self: Supervisor, serve_argv: Sequence[str], workers: int, socket_path: str) -> None:
        init(self, serve_argv, workers, socket_path)
        here = str(Path(__file__).resolve())
        self.core.argv = [sys.executable, here, "--profile-out", str(out), "--core", "--socket", socket_path]
        self.core.argv += list(serve_argv)

    Supervisor.__init__ = profiled_core  # type: ignore[method-assign]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile-out", type=Path, required=True)
    parser.add_argument("--core", action="store_true", help="run an engine core (as the supervisor starts it)")
    known, rest = parser.parse_known_args()
    if known.core:
        from omnigate.engines.core.__main__ import main as core_main

        install(known.profile_out)
        sys.exit(core_main(rest))
    from omnigate.gateway.cli.serve import main

    install(known.profile_out)  # with the engine inline; a core process is profiled instead, through --core
    start_cores_profiled(known.profile_out)
    sys.exit(main(rest))
