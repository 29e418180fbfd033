"""The tiny duplex engine the duplex unit tests run on: two slots, one torch thread (the clock's steps are tiny, and
the machine's cores belong to the other tests)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from omnigate.engines.duplex.engine import DuplexEngine


@contextmanager
def tiny_duplex_engine() -> Iterator[DuplexEngine]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    duplex = DuplexEngine.load("preset:tiny", max_sessions=2, retry_after_s=3)
    try:
        yield duplex
    finally:
        duplex.shutdown()
        torch.set_num_threads(threads)
