"""``python -m omnigate.engines.core --socket PATH serve [serve options]``: run one engine core.

``omnigate serve`` starts it (and restarts it) when the engine runs in a core process; it takes the same serve
options, so the engine, its model and its limits are those the gateway was asked for. It exits on SIGTERM and
ignores SIGINT: an interrupt goes to the serve supervisor, which drains the gateways before stopping the core.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from omnigate.engines.admission import AdmissionSettings
from omnigate.engines.answering import ANSWERING_FAMILY, AnsweringEngine
from omnigate.engines.base import Engine
from omnigate.engines.core.server import serve_core
from omnigate.engines.registry import load_engine
from omnigate.engines.remote.replica import ReplicaCore
from omnigate.gateway.cli.serve import build_parser, settings_from_args
from omnigate.gateway.ops.logging import configure_logging
from omnigate.gateway.settings import Settings

if TYPE_CHECKING:
    from omnigate.engines.duplex.engine import DuplexEngine

log = logging.getLogger("omnigate.engines.core")


async def _serve(
    core: ReplicaCore, socket_path: str, duplex: DuplexEngine | None, answering: AnsweringEngine | None
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await serve_core(core, socket_path, stop, duplex=duplex, answering=answering)


def core_for(engine: Engine, settings: Settings) -> ReplicaCore:
    """The core serving ``engine`` with the limits and admission policy ``omnigate serve`` was given."""
    return ReplicaCore(
        engine,
        f"core-{os.getpid()}-{uuid.uuid4().hex[:8]}",  # a new name per start: gateways see a restart as one
        ttfa_target_s=settings.ttfa_target_s,
        retry_after_s=settings.retry_after_s,
        step_timeout_s=settings.engine_step_timeout_s,
        failure_threshold=settings.engine_failure_threshold,
        admission=AdmissionSettings(policy=settings.admission, target_load=settings.admission_target_load),
    )


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    own = argparse.ArgumentParser(prog="python -m omnigate.engines.core", description=__doc__)
    own.add_argument("--socket", required=True, help="the Unix socket path to serve on")
    known, rest = own.parse_known_args(argv)
    settings = settings_from_args(build_parser().parse_args(rest))
    configure_logging(settings.log_level, settings.log_json)
    engine = load_engine(settings.engine, settings.model, **settings.engine_options)
    core = core_for(engine, settings)
    log.info(
        "engine core pid %d: %s model %s, %d slots",
        os.getpid(),
        engine.info.family,
        engine.info.model,
        engine.info.max_sessions,
    )
    duplex = None
    if engine.info.capabilities.duplex:
        # A duplex engine also serves its sessions here: its tick clock away from the gateways' event loops.
        from omnigate.engines.duplex.engine import DuplexEngine

        duplex = engine if isinstance(engine, DuplexEngine) else None
    # An engine that answers conversations itself (qwen3-omni) serves the gateways' realtime answers here.
    answering = cast(AnsweringEngine, engine) if engine.info.family == ANSWERING_FAMILY else None
    gc.collect()
    gc.freeze()  # the loaded model's objects stay out of the collector's walks (as in the gateway)
    try:
        import uvloop

        uvloop.run(_serve(core, known.socket, duplex, answering))
    finally:
        core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
