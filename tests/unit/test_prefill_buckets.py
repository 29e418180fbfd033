"""Token-count buckets of the talker's prefill graphs: every prefill a step can issue has a captured size."""

from __future__ import annotations

import torch

from omnigate.engines.talker.engine import prefill_graph_tokens
from omnigate.engines.talker.options import TalkerOptions
from omnigate.engines.talker.prefill_graphs import PrefillGraphs, prefill_buckets, prefill_pieces


def test_buckets_double_from_sixteen_and_end_at_the_maximum() -> None:
    assert prefill_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert prefill_buckets(100) == [16, 32, 64, 100]
    assert prefill_buckets(16) == [16]
    assert prefill_buckets(5) == [5]


def bucketing(max_tokens: int) -> PrefillGraphs:
    """The graphs' bucketing without a device: nothing is captured or computed here."""

    def compute(ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        raise AssertionError("not run")

    return PrefillGraphs(compute, scratch_slot=0, max_tokens=max_tokens, device=torch.device("cpu"), capture=False)


def test_the_graphs_cover_every_prefill_the_step_budget_allows_whatever_the_context_window() -> None:
    for options in (
        TalkerOptions(),
        TalkerOptions(prefill_tokens_per_step=2048, max_context=1024),  # a step's tokens span many streams
        TalkerOptions(prefill_tokens_per_step=3000, max_context=256),
    ):
        budget = options.prefill_tokens_per_step
        assert prefill_graph_tokens(options) == budget
        graphs = bucketing(prefill_graph_tokens(options))
        for tokens in range(1, budget + 1):
            size = graphs.bucket(tokens)
            assert size in graphs.buckets and tokens <= size and (size < 2 * tokens or size == 16)
    # Set apart from the budget, or off.
    assert prefill_graph_tokens(TalkerOptions(prefill_tokens_per_step=2048, prefill_graph_tokens=1024)) == 1024
    assert prefill_graph_tokens(TalkerOptions(prefill_graph_tokens=0)) == 0


def test_a_prefill_larger_than_the_graphs_runs_in_pieces_of_captured_sizes() -> None:
    assert prefill_pieces(2500, 1024) == [(0, 1024), (1024, 2048), (2048, 2500)]
    assert prefill_pieces(1024, 1024) == [(0, 1024)]
    assert prefill_pieces(7, 1024) == [(0, 7)]
