"""The piper engine's heap under glibc: resident memory and glibc's in-use and free heap after N sentences on
``--threads`` threads, as the server's workers synthesize them.

    python -m benchmarks.piper_heap [--sentences 300] [--threads 2] [--trim-every 0]
    MALLOC_ARENA_MAX=2 python -m benchmarks.piper_heap ...

``--trim-every K`` calls ``malloc_trim(0)`` after every K sentences (0: never). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import threading
import time

import psutil

from omnigate.engines.piper import PiperEngine
from omnigate.loadtest.corpus import load_corpus


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--trim-every", type=int, default=0)
    args = parser.parse_args()
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    engine = PiperEngine.load(None, workers=args.threads)
    texts = load_corpus(None)
    lock = threading.Lock()
    done = 0

    def work(offset: int) -> None:
        nonlocal done
        while True:
            with lock:
                if done >= args.sentences:
                    return
                done += 1
                index = done
            engine.synthesize(texts[(index + offset) % len(texts)], speaker_id=None, speed=1.0)
            if args.trim_every and index % args.trim_every == 0:
                libc.malloc_trim(0)

    started = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    info = libc.mallinfo2()
    mib = 1024 * 1024
    print(
        json.dumps(
            {
                "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"),
                "trim_every": args.trim_every,
                "utterances": args.sentences,
                "threads": args.threads,
                "seconds": round(time.perf_counter() - started, 1),
                "rss_mib": round(psutil.Process().memory_info().rss / mib, 1),
                "heap_in_use_mib": round(info.uordblks / mib, 1),
                "heap_free_kept_mib": round(info.fordblks / mib, 1),
                "mmapped_mib": round(info.hblkhd / mib, 1),
                "load_average": os.getloadavg(),
            }
        )
    )


if __name__ == "__main__":
    main()
