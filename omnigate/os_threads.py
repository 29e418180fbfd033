"""Threads the project starts carry their name down to the OS, so ``top -H``, ``ps -L`` and py-spy show it.

Python's thread names stay inside the interpreter (3.11 does not pass them to the OS). Linux keeps 15 bytes of a
thread's name; longer names are cut there. Elsewhere naming is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

OS_NAME_BYTES = 15
_PR_SET_NAME = 15

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread ``name`` (default: its Python name) at the OS level."""
    if _libc is None:
        return
    raw = (name or threading.current_thread().name).encode("ascii", "replace")[:OS_NAME_BYTES]
    _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0)


def os_thread_name(native_id: int) -> str:
    """The OS name of a thread of this process (Linux), as ``top -H`` shows it."""
    with open(f"/proc/self/task/{native_id}/comm") as comm:
        return comm.read().strip()


def named_executor(max_workers: int, prefix: str) -> ThreadPoolExecutor:
    """A thread pool whose threads are named ``prefix_N`` in Python and at the OS level."""
    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=prefix, initializer=name_os_thread)
