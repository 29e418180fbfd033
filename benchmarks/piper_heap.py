"""The piper engine's heap under glibc: resident memory and glibc's in-use and free heap after N sentences on
``--threads`` threads, as the server's workers synthesize them, and the CPU time (user and system) they cost per
second of audio.

    python -m benchmarks.piper_heap [--sentences 300] [--threads 2] [--trim-every 0] [--mmap-threshold-mib 1]
        [--arena]
    MALLOC_ARENA_MAX=2 python -m benchmarks.piper_heap ...

``--trim-every K`` calls ``malloc_trim(0)`` after every K sentences (0: never). ``--mmap-threshold-mib M`` fixes
glibc's mmap threshold (mallopt ``M_MMAP_THRESHOLD``) at M MiB before the voice loads (default: glibc's dynamic
threshold, as the engine runs). ``--arena`` runs the voice with onnxruntime's CPU memory arena on. Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import threading
import time

import onnxruntime
import psutil

from omnigate.engines.piper import PiperEngine, _resolve_voice
from omnigate.loadtest.corpus import load_corpus

# glibc's M_MMAP_THRESHOLD parameter of mallopt(3).
_M_MMAP_THRESHOLD = -3


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
    parser.add_argument("--mmap-threshold-mib", type=int, default=0)
    parser.add_argument("--arena", action="store_true")
    args = parser.parse_args()
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    if args.mmap_threshold_mib:
        libc.mallopt(_M_MMAP_THRESHOLD, args.mmap_threshold_mib << 20)
    engine = PiperEngine.load(None, workers=args.threads)
    if args.arena:
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
        model_path, _, _ = _resolve_voice(None)
        engine.voice.session = onnxruntime.InferenceSession(
            str(model_path), sess_options=options, providers=["CPUExecutionProvider"]
        )
        engine.warm_up()
    texts = load_corpus(None)
    lock = threading.Lock()
    done = 0
    samples = 0

    def work(offset: int) -> None:
        nonlocal done, samples
        while True:
            with lock:
                if done >= args.sentences:
                    return
                done += 1
                index = done
            audio = engine.synthesize(texts[(index + offset) % len(texts)], speaker_id=None, speed=1.0)
            with lock:
                samples += len(audio)
            if args.trim_every and index % args.trim_every == 0:
                libc.malloc_trim(0)

    cpu_before = os.times()
    started = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    info = libc.mallinfo2()
    cpu_after = os.times()
    user = cpu_after.user - cpu_before.user
    system = cpu_after.system - cpu_before.system
    audio_s = samples / engine.info.sample_rate
    mib = 1024 * 1024
    print(
        json.dumps(
            {
                "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"),
                "trim_every": args.trim_every,
                "mmap_threshold_mib": args.mmap_threshold_mib or None,
                "arena": args.arena,
                "cpu_s_per_audio_s": round((user + system) / audio_s, 4),
                "system_share": round(system / (user + system), 2),
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
