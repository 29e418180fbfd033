"""The shipped corpus and how texts are streamed."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from omnigate.loadtest.corpus import load_corpus, parse_corpus, pick_texts, unit_end_offset, word_chunks


def test_the_shipped_corpus_has_fifty_varied_entries() -> None:
    corpus = load_corpus()
    assert len(corpus) >= 50
    assert len(set(corpus)) == len(corpus)
    assert all(20 <= len(entry) <= 400 for entry in corpus)
    assert any("?" in entry for entry in corpus)
    assert any(entry[-1] not in '.!?"' for entry in corpus), "an entry without final punctuation"


def test_parse_corpus_splits_on_blank_lines_and_joins_lines() -> None:
    assert parse_corpus("One line\ncontinued.\n\n  \nSecond.\n") == ["One line continued.", "Second."]


def test_a_corpus_file_or_folder_can_be_given(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("First.\n\nSecond.\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("Third.\n", encoding="utf-8")
    assert load_corpus(tmp_path) == ["First.", "Second.", "Third."]
    assert load_corpus(tmp_path / "b.txt") == ["Third."]


def test_texts_are_picked_reproducibly_per_seed_and_session() -> None:
    corpus = load_corpus()
    assert pick_texts(corpus, 3, seed=1, session_id=5) == pick_texts(corpus, 3, seed=1, session_id=5)
    picks = {tuple(pick_texts(corpus, 3, seed=1, session_id=i)) for i in range(20)}
    assert len(picks) > 10


@given(st.text(alphabet=st.sampled_from("ab .,\n\t?"), max_size=80))
def test_word_chunks_join_back_to_the_text(text: str) -> None:
    chunks = word_chunks(text)
    assert "".join(chunks) == text or (not text.strip() and chunks == [])


def test_word_chunks_keep_trailing_whitespace_with_each_word() -> None:
    assert word_chunks("Hi there.  Bye") == ["Hi ", "there.  ", "Bye"]


def test_unit_end_offset_counts_non_space_characters() -> None:
    text = "Hello   there. Next one."
    assert unit_end_offset(text, "Hello there. ") == len("Hello   there.")
    assert unit_end_offset(text, "") is None
    assert unit_end_offset("short", "much longer than it") is None
