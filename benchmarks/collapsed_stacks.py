"""Summarize py-spy's collapsed stacks (``--format raw``): samples per process and thread, and the functions that
take the most samples, by their own time and with what they call.

    python -m benchmarks.collapsed_stacks OUT/gil.txt [--top 25]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

FRAME = re.compile(r"^(?P<name>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def _function(frame: str) -> str:
    match = FRAME.match(frame)
    if match is None:
        return frame
    file = match["file"]
    for marker in ("site-packages/", "omnigate/", "lib/python3"):
        if marker in file:
            file = file[file.index(marker) :]
            break
    return f"{match['name']} ({file})"


def _role(process: str) -> str:
    if "omnigate.engines.core" in process:
        return "engine core"
    if "--attach-core" in process:
        return "gateway worker"
    if "loadtest" in process:
        return "load test"
    return "serve"


def summarize(path: Path, top: int) -> str:
    by_thread: Counter[tuple[str, str]] = Counter()
    own: dict[str, Counter[str]] = {}
    inclusive: dict[str, Counter[str]] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        processes = [f for f in frames if f.startswith("process ")]
        role = _role(processes[-1]) if processes else "serve"
        threads = [f for f in frames if f.startswith("thread ")]
        thread = threads[-1] if threads else "?"
        code = [_function(f) for f in frames if not f.startswith(("process ", "thread "))]
        total += count
        by_thread[(role, thread)] += count
        if code:
            own.setdefault(role, Counter())[code[-1]] += count
            for name in {name for name in code if "(omnigate/" in name}:
                inclusive.setdefault(role, Counter())[name] += count
    lines = [f"{path}: {total} samples"]
    for (role, thread), count in by_thread.most_common():
        lines.append(f"  {role:15s} {thread:50s} {count:7d} {100 * count / total:5.1f} %")
    for role in own:
        role_total = sum(c for (r, _), c in by_thread.items() if r == role)
        lines.append(f"\n{role}: own time, top {top} ({role_total} samples)")
        lines += [f"  {100 * c / role_total:5.1f} %  {name}" for name, c in own[role].most_common(top)]
        lines.append(f"{role}: omnigate functions with what they call, top {top}")
        lines += [f"  {100 * c / role_total:5.1f} %  {name}" for name, c in inclusive[role].most_common(top)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stacks", type=Path, nargs="+")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for path in args.stacks:
        print(summarize(path, args.top))


if __name__ == "__main__":
    main()
