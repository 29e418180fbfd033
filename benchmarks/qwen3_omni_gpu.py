"""Qwen3-Omni's engine path alone (no gateway): one spoken turn's end-of-turn to first audio, per-session RTF at N
conversations at once, where a step's time goes, and transformers' reference ``generate`` on the same shapes.

Phases (each one's result is written to ``--out`` as soon as it ends, so a phase that fails loses only itself):

- ``check``: the engine's thinker prefill logits against transformers' thinker forward on the same prompt (relative
  max difference, top token agreement), on the device and dtype of the run.
- ``spoken_turn``: a user turn of ``--speech-s`` seconds of audio (log-mel features of noise: random weights make
  its content moot) encoded by the audio encoder, then the turn (system prompt, the audio tokens, the open assistant
  turn) run alone: encoder time, time to the first text token, to the first audio frame, per-frame step time.
- ``levels``: N turns submitted at once (a ``--prompt-tokens`` text prompt each, sampled), run until each has
  ``--frames`` audio frames or ends: first-audio latency per turn (p50/p99), the steps' time split between thinker
  decode, talker frames and Code2Wav, and the per-session real-time factor (step time per frame over 80 ms).
- ``reference``: transformers' ``generate`` (thinker, talker with its code predictor, ``Code2Wav.chunked_decode``)
  on the same prompt, greedy, with ``--ref-tokens`` thinker tokens and as many talker tokens: it returns audio only
  at the end, so its first audio is its whole time.
- ``code2wav``: the streaming decoder one frame at a time for B rows against one full forward over the same frames.

CPU smoke (tiny preset)::

    python -m benchmarks.qwen3_omni_gpu --model preset:tiny --levels 1,4 --frames 6 --out /tmp/q3.json

H200 (``preset:qwen3-omni-30b-a3b``, random weights)::

    python -m benchmarks.qwen3_omni_gpu --model preset:qwen3-omni-30b-a3b --device cuda --dtype bfloat16 \\
        --slots 64 --levels 1,16,64 --out $OUT/qwen3_omni_h200.json
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnigate.engines.qwen3_omni.model import Qwen3OmniModel, load_model
from omnigate.engines.qwen3_omni.runner import AudioFrame, TextToken, TurnDone, TurnRequest, TurnRunner

FRAME_S = 0.08


def _sync(model: Qwen3OmniModel) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


class StageClock:
    """Wall time of the model calls a step makes, by stage (each call ends with a host read, so it is synchronous)."""

    def __init__(self, model: Qwen3OmniModel) -> None:
        self.totals: dict[str, float] = {}
        self._wrap(model, "thinker_prefill", "thinker_prefill")
        self._wrap(model, "thinker_step", "thinker_decode")
        self._wrap(model, "talker_prefill", "talker_prefill")
        self._wrap(model, "talker_frame", "talker_frame")
        self._wrap(model.code2wav, "push", "code2wav")

    def _wrap(self, owner: Any, name: str, stage: str) -> None:
        call: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = call(*args, **kwargs)
            self.totals[stage] = self.totals.get(stage, 0.0) + time.perf_counter() - start
            return out

        setattr(owner, name, timed)


def _prompt(model: Qwen3OmniModel, tokens: int, seed: int) -> list[int]:
    tok = model.tokenizer
    rng = np.random.default_rng(seed)
    words = " ".join("".join(rng.choice(list("abcdefghij"), 4)) for _ in range(tokens // 5 + 1))
    content = tok.encode(words)[:tokens]
    return (
        tok.turn("system", tok.encode("You are a helpful assistant."))
        + tok.turn("user", content)
        + tok.open_assistant()
    )


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


@torch.inference_mode()
def check(model: Qwen3OmniModel) -> dict[str, Any]:
    prompt = _prompt(model, 64, 1)
    logits, _ = model.thinker_prefill([0], [model.embed_prompt(prompt)])
    model.thinker_cache.reset(0)
    whole: Any = model.whole
    ref = whole.thinker(input_ids=torch.tensor([prompt], device=model.device)).logits[0, -1].float()
    ref = ref[: logits.shape[1]]
    diff = float((logits[0] - ref).abs().max() / ref.abs().max())
    return {"relative_max_diff": diff, "top_token_agrees": int(logits[0].argmax()) == int(ref.argmax())}


_CLOCKS: dict[int, StageClock] = {}


def run_turns(model: Qwen3OmniModel, requests: list[TurnRequest], frames: int) -> dict[str, Any]:
    runner = TurnRunner(model)
    clock = _CLOCKS.get(id(model))
    if clock is None:  # wrap the model's calls once
        clock = _CLOCKS[id(model)] = StageClock(model)
    clock.totals = {}
    start = time.perf_counter()
    ids = {runner.submit(r): i for i, r in enumerate(requests)}
    first_text: dict[int, float] = {}
    first_audio: dict[int, float] = {}
    counts = dict.fromkeys(ids, 0)
    last_frame: dict[int, float] = {}
    done: dict[int, str] = {}
    steps = 0
    while runner.busy and steps < 20_000:
        events = runner.step()
        steps += 1
        now = time.perf_counter() - start
        for event in events:
            if isinstance(event.event, TextToken):
                first_text.setdefault(event.turn, now)
            elif isinstance(event.event, AudioFrame):
                first_audio.setdefault(event.turn, now)
                counts[event.turn] += 1
                last_frame[event.turn] = now
                if counts[event.turn] >= frames:
                    runner.cancel(event.turn)
                    done[event.turn] = "frames"
            elif isinstance(event.event, TurnDone):
                done[event.turn] = event.event.reason
    wall = time.perf_counter() - start
    rtf = [
        (last_frame[t] - first_audio[t]) / ((counts[t] - 1) * FRAME_S)
        for t in ids
        if counts[t] > 1 and t in first_audio
    ]
    return {
        "sessions": len(requests),
        "wall_s": wall,
        "steps": steps,
        "first_text_ms": {
            "p50": 1000 * _pct(list(first_text.values()), 50),
            "p99": 1000 * _pct(list(first_text.values()), 99),
        },
        "first_audio_ms": {
            "p50": 1000 * _pct(list(first_audio.values()), 50),
            "p99": 1000 * _pct(list(first_audio.values()), 99),
            "max": 1000 * max(first_audio.values(), default=float("nan")),
        },
        "frames_total": sum(counts.values()),
        "frames_per_s": sum(counts.values()) / wall,
        "rtf_per_session": {"p50": _pct(rtf, 50), "p99": _pct(rtf, 99), "max": max(rtf, default=float("nan"))},
        "stage_s": dict(clock.totals),
        "ends": sorted(set(done.values())),
    }


def spoken_turn(model: Qwen3OmniModel, speech_s: float, frames: int) -> dict[str, Any]:
    mel = int(model.config.thinker_config.audio_config.num_mel_bins)
    features = torch.randn(mel, int(speech_s * 100), generator=torch.Generator().manual_seed(0)) * 0.5
    model.encode_audio(features)  # warm
    _sync(model)
    start = time.perf_counter()
    audio = model.encode_audio(features)
    _sync(model)
    encode_s = time.perf_counter() - start
    tok = model.tokenizer
    audio_id = int(model.config.thinker_config.audio_token_id)
    prompt = (
        tok.turn("system", tok.encode("You are a helpful assistant."))
        + tok.turn("user", [audio_id] * audio.shape[0])
        + tok.open_assistant()
    )
    request = TurnRequest(prompt=prompt, audio=audio, max_tokens=64, max_frames=frames, temperature=0.7,
                          talker_temperature=0.9, seed=1)  # fmt: skip
    run_turns(model, [request], 2)  # warm: first calls of every stage
    result = run_turns(model, [request], frames)
    result["audio_encode_ms"] = 1000 * encode_s
    result["audio_tokens"] = int(audio.shape[0])
    result["end_of_turn_to_first_audio_ms"] = result["audio_encode_ms"] + result["first_audio_ms"]["p50"]
    return result


def levels(model: Qwen3OmniModel, counts: list[int], prompt_tokens: int, frames: int) -> list[dict[str, Any]]:
    out = []
    warm = [TurnRequest(prompt=_prompt(model, prompt_tokens, i), max_frames=2, seed=i) for i in range(max(counts))]
    run_turns(model, warm, 2)  # first calls at the largest shapes (GEMM algorithms, kernel compiles)
    for n in counts:
        requests = [
            TurnRequest(
                prompt=_prompt(model, prompt_tokens, i),
                max_tokens=4 * frames,
                max_frames=frames,
                temperature=0.7,
                talker_temperature=0.9,
                seed=i,
            )
            for i in range(n)
        ]
        out.append(run_turns(model, requests, frames))
        print(json.dumps(out[-1]), flush=True)
    return out


@torch.inference_mode()
def reference(model: Qwen3OmniModel, prompt_tokens: int, tokens: int) -> dict[str, Any]:
    whole: Any = model.whole
    prompt = torch.tensor([_prompt(model, prompt_tokens, 0)], device=model.device)
    kwargs = dict(speaker="ethan", thinker_max_new_tokens=tokens, thinker_eos_token_id=-1, thinker_do_sample=False,
                  talker_do_sample=False, talker_max_new_tokens=tokens + 1)  # fmt: skip
    _sync(model)
    start = time.perf_counter()
    sequences, wav = whole.generate(prompt, **kwargs)
    _sync(model)
    wall = time.perf_counter() - start
    samples = int(wav.numel())
    return {
        "thinker_tokens": int(sequences.shape[1] - prompt.shape[1]),
        "audio_s": samples / model.sample_rate,
        "wall_s": wall,
        "first_audio_ms": 1000 * wall,
        "rtf": wall / max(samples / model.sample_rate, 1e-9),
        "experts_implementation": str(
            getattr(whole.config.thinker_config.text_config, "_experts_implementation", None)
        ),
    }


@torch.inference_mode()
def code2wav(model: Qwen3OmniModel, rows: int, frames: int) -> dict[str, Any]:
    stream = model.code2wav
    q, size = stream.num_quantizers, stream.codebook_size
    codes = torch.randint(0, size, (rows, q, frames), generator=torch.Generator().manual_seed(0))
    opened = [stream.open() for _ in range(rows)]
    try:
        stream.push(opened, codes[:, :, :1])  # warm
        for row in opened:
            stream.restart(row)
        _sync(model)
        start = time.perf_counter()
        for t in range(frames):
            stream.push(opened, codes[:, :, t : t + 1])
        _sync(model)
        streaming_s = time.perf_counter() - start
    finally:
        for row in opened:
            stream.close(row)
    whole: Any = model.whole
    device_codes = codes.to(model.device)
    whole.code2wav(device_codes)
    _sync(model)
    start = time.perf_counter()
    whole.code2wav(device_codes)
    _sync(model)
    full_s = time.perf_counter() - start
    return {"rows": rows, "frames": frames, "streaming_s": streaming_s, "full_forward_s": full_s,
            "streaming_over_full": streaming_s / full_s}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="preset:tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--max-context", type=int, default=1024)
    parser.add_argument("--levels", default="1,4")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--frames", type=int, default=40)
    parser.add_argument("--speech-s", type=float, default=5.0)
    parser.add_argument("--ref-tokens", type=int, default=16)
    parser.add_argument("--phases", default="check,spoken_turn,levels,reference,code2wav")
    parser.add_argument("--no-capture", action="store_true", help="skip the CUDA graphs (a reference-only run)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    report: dict[str, Any] = {"command": vars(args) | {"out": str(args.out)}}
    if torch.cuda.is_available():
        report["gpu"] = torch.cuda.get_device_name()
    report["torch"] = torch.__version__

    def save() -> None:
        args.out.write_text(json.dumps(report, indent=2, default=str))

    start = time.perf_counter()
    model = load_model(args.model, device=args.device, dtype=args.dtype, slots=args.slots, max_context=args.max_context)
    _sync(model)
    report["build_s"] = time.perf_counter() - start
    start = time.perf_counter()
    try:
        if not args.no_capture:
            model.capture()
    except Exception:  # measure eagerly rather than not at all
        report["capture_error"] = traceback.format_exc()[-2000:]
    report["capture_s"] = time.perf_counter() - start
    save()
    phases: dict[str, Callable[[], Any]] = {
        "check": lambda: check(model),
        "spoken_turn": lambda: spoken_turn(model, args.speech_s, args.frames),
        "levels": lambda: levels(model, [int(n) for n in args.levels.split(",")], args.prompt_tokens, args.frames),
        "code2wav": lambda: code2wav(model, min(args.slots, 64), 50),
        "reference": lambda: reference(model, args.prompt_tokens, args.ref_tokens),
    }
    for name in args.phases.split(","):
        start = time.perf_counter()
        try:
            report[name] = phases[name]()
        except Exception:  # one phase failing must not lose the others' results
            report[name] = {"error": traceback.format_exc()[-3000:]}
        report.setdefault("phase_s", {})[name] = time.perf_counter() - start
        print(name, json.dumps(report[name])[:1500], flush=True)
        save()


if __name__ == "__main__":
    main()
