"""Qwen3-Omni's engine path against transformers' own implementation, on the tiny preset with the same weights.

Greedy decoding makes the comparison exact: the thinker's tokens and the talker's codes (every codebook of every
frame) must be the ones ``Qwen3OmniMoeForConditionalGeneration.generate`` produces for the same prompt, while the
engine runs several turns batched in the same steps; the audio streamed frame by frame equals the waveform
``generate`` decodes from all the codes at the end, within float32 rounding (relative 1e-4 of the peak). The prompts
are chosen so that no greedy choice along the way is a float32 near-tie (the top two logits within ~1e-4, where the
summation order of a batched kernel decides)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from omnigate.engines.qwen3_omni.experts import grouped_experts
from omnigate.engines.qwen3_omni.model import Qwen3OmniModel, build_preset, load_model
from omnigate.engines.qwen3_omni.moe_stack import _experts
from omnigate.engines.qwen3_omni.runner import (
    CONTEXT_LENGTH_EXCEEDED,
    AudioFrame,
    TextToken,
    TurnDone,
    TurnRequest,
    TurnRunner,
)
from omnigate.engines.qwen3_omni.vision import frame_patches

MAX_TOKENS = 12
MAX_FRAMES = 39  # transformers' talker_max_new_tokens=40 counts the end-of-speech draw too


@pytest.fixture(scope="module")
def model() -> Qwen3OmniModel:
    return build_preset("tiny", vocab_limit=False, slots=4, max_context=512)


def _prompt(model: Qwen3OmniModel, question: str) -> list[int]:
    tok = model.tokenizer
    return tok.turn("system", tok.encode("be brief")) + tok.turn("user", tok.encode(question)) + tok.open_assistant()


Result = tuple[list[int], list[list[int]], TurnDone]


def _run(
    runner: TurnRunner, requests: list[TurnRequest], audio: dict[int, list[np.ndarray]] | None = None
) -> dict[int, Result]:
    ids = [runner.submit(r) for r in requests]
    text: dict[int, list[int]] = {i: [] for i in ids}
    frames: dict[int, list[list[int]]] = {i: [] for i in ids}
    done: dict[int, TurnDone] = {}
    for _ in range(10_000):
        if not runner.busy:
            break
        for event in runner.step():
            if isinstance(event.event, TextToken):
                text[event.turn].append(event.event.token)
            elif isinstance(event.event, AudioFrame):
                frames[event.turn].append(event.event.codes)
                if audio is not None:
                    audio.setdefault(event.turn, []).append(event.event.audio)
            else:
                done[event.turn] = event.event
    return {i: (text[i], frames[i], done[i]) for i in ids}


def _reference(
    model: Qwen3OmniModel, prompt: list[int], frames: int = MAX_FRAMES, **inputs: Any
) -> tuple[list[int], list[list[int]], np.ndarray]:
    """transformers' greedy thinker tokens, talker codes (as Code2Wav receives them) and waveform for ``prompt``,
    with ``inputs`` (audio features, pixels) and at most ``frames`` codec frames."""
    whole: Any = model.whole
    seen: dict[str, torch.Tensor] = {}
    decode = whole.code2wav.chunked_decode

    def keep_codes(codes: torch.Tensor, **kwargs: Any) -> Any:
        seen["codes"] = codes.clone()
        return decode(codes, **kwargs)

    whole.code2wav.chunked_decode = keep_codes
    try:
        sequences, wav = whole.generate(
            torch.tensor([prompt]),
            **inputs,
            speaker="ethan",
            thinker_max_new_tokens=MAX_TOKENS,
            thinker_eos_token_id=model.tokenizer.im_end,
            thinker_do_sample=False,
            talker_do_sample=False,
            talker_max_new_tokens=frames + 1,
        )
    finally:
        del whole.code2wav.chunked_decode
    return sequences[0, len(prompt) :].tolist(), seen["codes"][0].t().tolist(), wav.reshape(-1).numpy()


@pytest.mark.parametrize("part", ["thinker", "talker"])
def test_grouped_experts_equal_the_reference_block(model: Qwen3OmniModel, part: str) -> None:
    whole: Any = model.whole
    layer = (whole.thinker.model.language_model if part == "thinker" else whole.talker.model).layers[0]
    config = whole.config.thinker_config.text_config if part == "thinker" else whole.config.talker_config.text_config
    x = torch.randn(37, config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = layer.mlp(x[None])[0]
        got = grouped_experts(x, _experts(layer.mlp, config))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_batched_turns_equal_transformers_generate(model: Qwen3OmniModel) -> None:
    prompts = [_prompt(model, "what is two and two?"), _prompt(model, "x")]
    audio: dict[int, list[np.ndarray]] = {}
    requests = [TurnRequest(prompt=p, max_tokens=MAX_TOKENS, max_frames=MAX_FRAMES) for p in prompts]
    results = _run(TurnRunner(model), requests, audio)
    assert len(results) == 2
    delay = model.code2wav.delay_samples
    for prompt, (turn, (text, frames, done)) in zip(prompts, results.items(), strict=True):
        expected_text, expected_codes, expected_wav = _reference(model, prompt)
        assert text == expected_text
        assert frames == expected_codes
        assert done.error is None
        streamed = np.concatenate(audio[turn])
        assert len(streamed) == len(frames) * model.code2wav.samples_per_frame
        assert not streamed[:delay].any()  # the stream is the full decode, delayed
        peak = float(np.abs(expected_wav).max())
        assert peak > 0
        np.testing.assert_allclose(streamed[delay:], expected_wav, rtol=0, atol=1e-4 * peak)
    # the two answers really ran in the same steps: one reached the token limit, the other its own end
    assert {done.reason for _, _, done in results.values()} == {"length", "stop"}


def test_text_only_turn_ends_with_the_answer(model: Qwen3OmniModel) -> None:
    prompt = _prompt(model, "x")
    [(text, frames, done)] = _run(
        TurnRunner(model), [TurnRequest(prompt=prompt, speak=False, max_tokens=MAX_TOKENS)]
    ).values()
    assert frames == []
    assert text == _reference(model, prompt)[0]
    assert done.reason == "stop"


def test_prompt_longer_than_the_context_is_refused_typed(model: Qwen3OmniModel) -> None:
    prompt = _prompt(model, "y" * model.max_context)
    [(text, frames, done)] = _run(TurnRunner(model), [TurnRequest(prompt=prompt)]).values()
    assert (text, frames, done.reason) == ([], [], CONTEXT_LENGTH_EXCEEDED)
    assert done.error is not None and str(model.max_context) in done.error


def test_cancelled_turn_stops_at_once_and_frees_its_slot(model: Qwen3OmniModel) -> None:
    runner = TurnRunner(model)
    turn = runner.submit(TurnRequest(prompt=_prompt(model, "what is two and two?"), max_tokens=MAX_TOKENS))
    first = runner.step()
    assert [e.turn for e in first] == [turn]
    runner.cancel(turn)
    assert runner.step() == []
    assert not runner.busy
    assert runner.free_slots == model.slots


def test_checkpoint_written_by_save_pretrained_loads_back(model: Qwen3OmniModel, tmp_path: Any) -> None:
    model.whole.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32", slots=2, max_context=512)
    assert not loaded.random_weights
    prompt = _prompt(model, "x")
    expected = _run(TurnRunner(model), [TurnRequest(prompt=prompt, max_tokens=MAX_TOKENS, max_frames=8)])
    got = _run(TurnRunner(loaded), [TurnRequest(prompt=prompt, max_tokens=MAX_TOKENS, max_frames=8)])
    assert list(got.values()) == list(expected.values())


def test_spoken_turn_equals_transformers_generate_with_the_same_audio(model: Qwen3OmniModel) -> None:
    """A user turn of audio: the audio encoder's tokens in the thinker, the thinker's hidden states (projected) in
    the talker at the audio positions. Here the talker says its end of speech before the thinker's text ends: the
    turn still carries the whole answer's text, as ``generate`` writes it."""
    features = torch.randn(128, 300, generator=torch.Generator().manual_seed(0)) * 0.5
    audio = model.encode_audio(features)
    config = model.config.thinker_config
    tok = model.tokenizer
    content = [int(config.audio_start_token_id), *[int(config.audio_token_id)] * audio.shape[0], *tok.encode(" hi")]
    prompt = tok.turn("system", tok.encode("be brief")) + tok.turn("user", content) + tok.open_assistant()
    [(text, frames, done)] = _run(
        TurnRunner(model), [TurnRequest(prompt=prompt, audio=audio, max_tokens=MAX_TOKENS, max_frames=20)]
    ).values()
    mask = torch.ones(1, features.shape[1], dtype=torch.long)
    expected_text, expected_frames, _ = _reference(
        model, prompt, 20, input_features=features[None], feature_attention_mask=mask
    )
    assert text == expected_text
    assert frames == expected_frames
    assert len(frames) < len(text)  # the voice ended first; the text went on to its end
    assert done.reason == "length"


def test_a_turn_at_its_credit_pauses_and_goes_on_unchanged_when_granted(model: Qwen3OmniModel) -> None:
    prompt = _prompt(model, "what is two and two?")
    [(text, frames, done)] = _run(
        TurnRunner(model), [TurnRequest(prompt=prompt, max_tokens=MAX_TOKENS, max_frames=20)]
    ).values()
    assert len(frames) > 6
    runner = TurnRunner(model)
    turn = runner.submit(TurnRequest(prompt=prompt, max_tokens=MAX_TOKENS, max_frames=20, credit=3))
    events = []
    while runner.ready:
        events += runner.step()
    assert [e.event.codes for e in events if isinstance(e.event, AudioFrame)] == frames[:3]
    assert runner.busy and runner.step() == []  # paused: neither its thinker nor its talker steps
    runner.grant(turn, 2)  # a lower limit changes nothing
    assert not runner.ready
    runner.grant(turn, 1000)
    while runner.busy:
        events += runner.step()
    # The pause changed nothing of the answer: the same tokens, the same codes, one end.
    assert [e.event.token for e in events if isinstance(e.event, TextToken)] == text
    assert [e.event.codes for e in events if isinstance(e.event, AudioFrame)] == frames
    assert [e.event for e in events if isinstance(e.event, TurnDone)] == [done]


def test_a_paused_turn_cancelled_stops_at_once_and_frees_its_slot(model: Qwen3OmniModel) -> None:
    runner = TurnRunner(model)
    turn = runner.submit(TurnRequest(prompt=_prompt(model, "hello"), max_tokens=MAX_TOKENS, credit=1))
    while runner.ready:
        runner.step()
    runner.cancel(turn)
    assert runner.step() == []
    assert not runner.busy and runner.free_slots == model.slots


def test_steps_run_in_inference_mode_where_the_captured_buffers_live(model: Qwen3OmniModel) -> None:
    """On CUDA ``capture`` makes the graphs' input buffers and the codec's states in inference mode; a push or a
    close outside it fails ("Inplace update to inference tensor outside InferenceMode")."""
    seen: list[tuple[str, bool]] = []
    stream: Any = model.code2wav
    push, close = stream.push, stream.close

    def watched_push(*args: Any) -> Any:
        seen.append(("push", torch.is_inference_mode_enabled()))
        return push(*args)

    def watched_close(*args: Any) -> Any:
        seen.append(("close", torch.is_inference_mode_enabled()))
        return close(*args)

    stream.push, stream.close = watched_push, watched_close
    try:
        runner = TurnRunner(model)
        runner.submit(TurnRequest(prompt=_prompt(model, "hello"), max_tokens=4, max_frames=2))
        runner.step()
        runner.step()
        runner.step()
        runner.drop_all()
    finally:
        del stream.push, stream.close
    assert {kind for kind, _ in seen} == {"push", "close"} and all(mode for _, mode in seen), seen


def test_question_about_frames_equals_transformers_generate(model: Qwen3OmniModel) -> None:
    """Camera frames in the thinker: the vision encoder's tokens at the image placeholders, its deepstack features
    added after the first decoder layers, and the image tokens at 3-D rotary positions (the text after them at the
    largest plus one, and decoding on from there), in the talker too: the greedy answer and its codes equal
    transformers' for the same pixels."""
    rng = np.random.default_rng(0)
    pictures = [rng.integers(0, 256, (96, 160, 3), dtype=np.uint8) for _ in range(2)]
    frames = model.encode_frames(pictures)
    assert [f.grid for f in frames] == [(3, 5), (3, 5)]
    config = model.config.thinker_config
    tok = model.tokenizer
    start = int(config.vision_start_token_id)
    content: list[int] = []
    for frame in frames:
        content += [start, *[int(config.image_token_id)] * frame.count, start + 1]
    content += tok.encode(" what is it?")
    prompt = tok.turn("system", tok.encode("be brief")) + tok.turn("user", content) + tok.open_assistant()
    request = TurnRequest(prompt=prompt, frames=tuple(frames), max_tokens=MAX_TOKENS, max_frames=20)
    [(text, codes, done)] = _run(TurnRunner(model), [request]).values()
    pixels = torch.cat([frame_patches(p, patch=model.patch, merge=model.merge, temporal=2) for p in pictures])
    grid = torch.tensor([[1, 6, 10]] * 2)
    expected_text, expected_codes, _ = _reference(model, prompt, 20, pixel_values=pixels, image_grid_thw=grid)
    assert text == expected_text
    assert codes == expected_codes
    assert done.error is None
