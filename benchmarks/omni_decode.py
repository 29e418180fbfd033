"""The omni thinker's decode rate at N answers at once: the engine alone, no gateway, no frames.

At each level N answers (a prompt of ``--prompt-chars`` characters each, ``--max-new-tokens`` at most, sampled at
temperature 0.7) are submitted before the worker starts, so every step decodes all that are still running. Each
level runs twice, side by side: decode steps replayed from CUDA graphs (``padded``: the step with its sampling, rows
padded to a batch bucket; eager on the CPU) and the eager step. Reports
the tokens per second of all answers together (the wall time includes the first step's prefills), the decode steps
per second and the mean answers per step. First it checks the slot-cache forward (the Triton kernels on CUDA) against
the transformers thinker's own forward on the same device: a prompt, then decode tokens beside a neighbour at
another length; the report's ``matches_transformers`` gives the largest logit difference relative to the largest
logit, and whether the top token agrees.

CPU, tiny preset (seconds)::

    python -m benchmarks.omni_decode --levels 1,16,64 --out /tmp/omni_decode.json

GPU, the 3B shape (random weights)::

    python -m benchmarks.omni_decode --model preset:qwen2.5-omni-3b --device cuda --dtype bfloat16 \\
        --levels 1,16,64 --out $OUT/omni_decode.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from omnigate.engines.omni.engine import OmniEngine
from omnigate.engines.omni.model import OmniModel, load_omni_model
from omnigate.engines.omni.request import ThinkDone, ThinkOutput, ThinkRequest


@torch.inference_mode()
def check_against_transformers(model: OmniModel, prompt_tokens: int = 96, decode_tokens: int = 8) -> dict[str, Any]:
    """The slot forward against the thinker's own forward (a ``DynamicCache``, sequential positions in all three
    rotary sections) on the model's device: slot 1 is checked while slot 0 holds a shorter neighbour. Below float32
    both are also compared with a float32 copy of the thinker, which says how much of a difference is the dtype's."""
    import copy

    from transformers.cache_utils import DynamicCache

    generator = torch.Generator().manual_seed(0)
    vocab = model.vocab_limit or int(model.thinker.config.text_config.vocab_size)
    ids = torch.randint(0, vocab, (prompt_tokens + decode_tokens,), generator=generator).tolist()
    pieces = [ids[:prompt_tokens]] + [[i] for i in ids[prompt_tokens:]]

    def transformers_logits(thinker: Any) -> list[torch.Tensor]:
        cache = DynamicCache(config=thinker.config.text_config)
        embed = thinker.get_input_embeddings()
        out_logits = []
        for piece in pieces:
            start = cache.get_seq_length()
            positions = torch.arange(start, start + len(piece), device=model.device).view(1, 1, -1).expand(3, 1, -1)
            embeds = embed(torch.tensor([piece], device=model.device))
            out = thinker.model(inputs_embeds=embeds, position_ids=positions, cache=cache, use_cache=True)
            out_logits.append(thinker.lm_head(out.last_hidden_state[0, -1]).float()[:vocab])
        return out_logits

    model.prefill(0, model.embed(ids[: prompt_tokens // 3]))  # a neighbour at another length shares every step
    slots = [model.prefill(1, model.embed(pieces[0])).float()[:vocab]]
    for piece in pieces[1:]:
        slots.append(model.decode([0, 1], torch.tensor([ids[0], piece[0]]))[1].float()[:vocab])
    for slot in (0, 1):
        model.cache.reset(slot)

    def compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict[str, Any]:
        worst = max(float((g - w).abs().max() / w.abs().max().clamp_min(1e-6)) for g, w in zip(got, want, strict=True))
        agree = sum(int(g.argmax()) == int(w.argmax()) for g, w in zip(got, want, strict=True))
        return {"relative_max_logit_difference": round(worst, 5), "top_token_agrees": f"{agree}/{len(got)}"}

    same_dtype = transformers_logits(model.thinker)
    report: dict[str, Any] = {"slots_vs_transformers": compare(slots, same_dtype)}
    if model.dtype != torch.float32:
        reference = copy.deepcopy(model.thinker).float()
        full = transformers_logits(reference)
        del reference
        report["slots_vs_transformers_float32"] = compare(slots, full)
        report["transformers_vs_transformers_float32"] = compare(same_dtype, full)
    return report


@torch.inference_mode()
def check_graphs_against_eager(model: OmniModel, answers: int, steps: int = 16) -> dict[str, Any]:
    """The padded decode step (a captured graph on CUDA) against the eager step, greedy, from the same prefilled
    state: ``answers`` prompts of different lengths prefilled in one forward, then ``steps`` steps each way. Reports
    whether every step chose the same ids, and the largest logit difference relative to the largest logit (on CUDA
    the graph's GEMMs run at the bucket's batch, the eager ones at the answers', so bfloat16 sums may differ)."""
    generator = torch.Generator().manual_seed(1)
    vocab = model.vocab_limit or int(model.thinker.config.text_config.vocab_size)
    prompts = [
        model.embed(torch.randint(0, vocab, (24 + 3 * i,), generator=generator).tolist()) for i in range(answers)
    ]
    slots = list(range(answers))

    def run(padded: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
        logits = model.prefill_many(slots, prompts)
        ids: list[list[int]] = []
        seen: list[torch.Tensor] = []
        for _ in range(steps):
            if padded:
                chosen, logits = model.sample_decode(list(logits), [0.0] * answers, [0.0] * answers, slots)
                model.commit_decoded(slots)
                logits = logits.clone()
            else:
                tokens = logits.argmax(dim=-1)
                chosen = tokens.tolist()
                logits = model.decode(slots, tokens)
            ids.append(chosen)
            seen.append(logits.float())
        return ids, seen

    eager_ids, eager_logits = run(False)
    graph_ids, graph_logits = run(True)
    for slot in slots:
        model.cache.reset(slot)
    worst = max(
        float((g - e).abs().max() / e.abs().max().clamp_min(1e-6))
        for g, e in zip(graph_logits, eager_logits, strict=True)
    )
    same_steps = next((k for k, (g, e) in enumerate(zip(graph_ids, eager_ids, strict=True)) if g != e), steps)
    return {
        "answers": answers,
        "steps": steps,
        "graphs_captured": model.decode_steps.captured,
        "identical_ids_for_steps": f"{same_steps}/{steps}",
        "relative_max_logit_difference": round(worst, 6),
    }


async def level(engine: OmniEngine, answers: int, args: argparse.Namespace) -> dict[str, Any]:
    ended = asyncio.Event()
    open_answers = [answers]
    reasons: dict[str, int] = {}

    def sink(batch: list[ThinkOutput]) -> None:
        for out in batch:
            if isinstance(out, ThinkDone):
                reasons[out.reason] = reasons.get(out.reason, 0) + 1
                open_answers[0] -= 1
                if not open_answers[0]:
                    ended.set()

    context = "history " * (args.prompt_chars // 8)
    tokens, steps, rows = engine.tokens_total, engine.steps, engine.decode_rows_total
    padded_steps = engine.stats.padded_steps
    for i in range(answers):
        request = ThinkRequest(context, "what now?", max_new_tokens=args.max_new_tokens, temperature=0.7, seed=i)
        engine.submit(request, sink)
    started = time.perf_counter()
    engine.start()
    await ended.wait()
    wall = time.perf_counter() - started
    await asyncio.to_thread(engine.stop)
    made, stepped = engine.tokens_total - tokens, engine.steps - steps
    return {
        "answers": answers,
        "tokens": made,
        "steps": stepped,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(made / wall, 1),
        "steps_per_s": round(stepped / wall, 1),
        "answers_per_step": round((engine.decode_rows_total - rows) / max(1, stepped), 2),
        "padded_steps": engine.stats.padded_steps - padded_steps,
        "reasons": reasons,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="preset:tiny", help="--omni-model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--levels", default="1,16,64", help="answers at once, comma-separated")
    parser.add_argument("--prompt-chars", type=int, default=160)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument(
        "--modes",
        default="padded,eager",
        help="decode steps to time at each level: padded (CUDA graphs on the GPU) and/or eager",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "omni_decode.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.levels.split(",")]
    model = load_omni_model(args.model, device=args.device, dtype=args.dtype, slots=max(levels))
    report: dict[str, Any] = {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "max_context": model.max_context,
        "prompt_chars": args.prompt_chars,
        "max_new_tokens": args.max_new_tokens,
        "levels": [],
    }
    report["matches_transformers"] = check_against_transformers(model)
    print(json.dumps({"matches_transformers": report["matches_transformers"]}), flush=True)
    started = time.perf_counter()
    model.warm_up()  # as the engine loads: every stage once, and on CUDA the decode graphs captured
    report["warm_up_s"] = round(time.perf_counter() - started, 2)
    modes = [m for m in args.modes.split(",") if m]
    if "padded" in modes:
        padded = model.padded_decode
        model.padded_decode = True  # on the CPU: the padded step eagerly, checked against the eager step
        report["graphs_vs_eager"] = [
            check_graphs_against_eager(model, n) for n in sorted({min(n, max(levels)) for n in (1, 3, 16)})
        ]
        model.padded_decode = padded
        print(json.dumps({"graphs_vs_eager": report["graphs_vs_eager"]}), flush=True)
    if hasattr(os, "getloadavg"):
        report["load_before"] = os.getloadavg()
    for answers in levels:
        for mode in modes:
            model.padded_decode = mode == "padded"
            engine = OmniEngine(model, max_sessions=answers)  # a fresh worker per level (stop ends it)
            result = {"mode": mode, **asyncio.run(level(engine, answers, args))}
            print(json.dumps(result), flush=True)
            report["levels"].append(result)
    if hasattr(os, "getloadavg"):
        report["load_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
