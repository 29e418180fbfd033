"""The embedded LLM's cache of prepared weights: a hit answers as the freshly loaded model does, a corrupt or stale
entry is prepared again, one entry per weights file, and its place is configurable.

The model is the tiny random-weight Llama of ``test_embedded_llm`` with a character-level tokenizer built in
memory (a real ``tokenizers`` tokenizer, saved and loaded as ``tokenizer.json``); the source loader counts its calls.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from omnigate.engines.llm.model import LlmModel, load_prepared
from omnigate.engines.llm.weights_cache import CACHE_DIR_ENV, MANIFEST, WeightsCache, default_cache_root
from omnigate.engines.omni.tokenizer import HfTokenizer
from tests.unit.test_embedded_llm import VOCAB, greedy, tiny_llama

KEY: dict[str, str | int] = {"format": 1, "file": "tiny.gguf", "size": 10, "sha256": "ab" * 32}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    chars = [chr(i) for i in range(32, 32 + VOCAB - 2)]
    vocab = {token: i for i, token in enumerate(["<unk>", "<|im_end|>", *chars])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", unk_token="<unk>")


class Source:
    """The slow path: builds the tiny model and tokenizer, counting how often it was asked."""

    def __init__(self) -> None:
        self.loads = 0

    def __call__(self) -> tuple[Any, Any]:
        self.loads += 1
        return tiny_llama(seed=3), tiny_tokenizer()


def answer(loaded: tuple[Any, Any]) -> tuple[list[int], list[int]]:
    causal_lm, tokenizer = loaded
    model = LlmModel(causal_lm, HfTokenizer(tokenizer), name="tiny", slots=1, max_context=64)
    prompt = model.tokenizer.encode("user: what is the capital of France?")
    return prompt, greedy(model, 0, prompt, 16)


def test_a_cache_hit_answers_with_the_same_tokens_as_a_fresh_load(tmp_path: Path) -> None:
    source = Source()
    cache = WeightsCache(tmp_path, "tiny.gguf")
    fresh = answer(source())
    first = answer(load_prepared(source, cache, KEY))  # a miss: prepared, then written
    assert source.loads == 2 and cache.read(KEY) == cache.entry
    hit = load_prepared(source, cache, KEY)
    assert source.loads == 2, "the second load read the cache"
    assert hit[0].lm_head.weight.data_ptr() == hit[0].model.embed_tokens.weight.data_ptr(), "the head is still tied"
    assert answer(hit) == first == fresh
    assert len(set(fresh[1])) > 3, "the random model's answer varies"


@pytest.mark.parametrize("damage", ["flip_a_weight_byte", "truncate_weights", "drop_manifest", "garble_manifest"])
def test_a_corrupt_entry_is_prepared_again(tmp_path: Path, damage: str) -> None:
    source = Source()
    cache = WeightsCache(tmp_path, "tiny.gguf")
    expected = answer(load_prepared(source, cache, KEY))
    weights = cache.entry / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "flip_a_weight_byte":
        data[-5] ^= 0x40  # inside the last tensor: the file still parses
        weights.write_bytes(bytes(data))
    elif damage == "truncate_weights":
        weights.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "drop_manifest":
        (cache.entry / MANIFEST).unlink()
    else:
        (cache.entry / MANIFEST).write_text("{not json")
    assert cache.read(KEY) is None
    assert answer(load_prepared(source, cache, KEY)) == expected
    assert source.loads == 2, "prepared again from the source"
    assert cache.read(KEY) == cache.entry, "and the entry rewritten"
    load_prepared(source, cache, KEY)
    assert source.loads == 2


def test_a_stale_entry_is_replaced_and_the_cache_holds_one_entry_per_weights_file(tmp_path: Path) -> None:
    source = Source()
    cache = WeightsCache(tmp_path, "tiny.gguf")
    load_prepared(source, cache, KEY)
    newer = {**KEY, "sha256": "cd" * 32}  # another wheel's file of the same name
    assert cache.read(newer) is None
    load_prepared(source, cache, newer)
    assert source.loads == 2
    assert cache.read(newer) == cache.entry and cache.read(KEY) is None
    assert sorted(p.name for p in cache.folder.iterdir()) == ["tiny.gguf"], "no second entry, no leftovers"
    other = WeightsCache(tmp_path, "other.gguf")
    other.write(KEY, lambda folder: (folder / "weights").write_bytes(b"x"))
    assert sorted(p.name for p in cache.folder.iterdir()) == ["other.gguf", "tiny.gguf"]


def test_a_failed_write_leaves_no_entry_and_no_temporary_folder(tmp_path: Path) -> None:
    cache = WeightsCache(tmp_path, "tiny.gguf")

    def save(folder: Path) -> None:
        (folder / "half").write_bytes(b"x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        cache.write(KEY, save)
    assert list(cache.folder.iterdir()) == []
    assert cache.read(KEY) is None


def test_the_temporary_folder_of_a_write_whose_process_died_is_removed_by_the_next_write(tmp_path: Path) -> None:
    cache = WeightsCache(tmp_path, "tiny.gguf")
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    cache.folder.mkdir(parents=True)
    died = cache.folder / f".tmp-tiny.gguf-{int(ended.stdout)}-0123abcd"
    died.mkdir()
    (died / "model.safetensors").write_bytes(b"half of it")
    writing = cache.folder / f".tmp-tiny.gguf-{os.getpid()}-4567ef01"  # a write in progress in a live process
    writing.mkdir()
    cache.write(KEY, lambda folder: (folder / "weights").write_bytes(b"x"))
    assert sorted(p.name for p in cache.folder.iterdir()) == [writing.name, "tiny.gguf"]


def test_the_cache_location_is_configurable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_root() == tmp_path / "xdg" / "omnigate"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_root() == Path.home() / ".cache" / "omnigate"
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "mine"))
    assert default_cache_root() == tmp_path / "mine"
    assert WeightsCache(default_cache_root(), "tiny.gguf").entry == tmp_path / "mine" / "llm" / "tiny.gguf"
