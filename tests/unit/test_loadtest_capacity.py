"""Capacity search against fake measure functions with a known answer."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnigate.loadtest.capacity import CapacitySearch, search_capacity


def exact_search(true_capacity: int, max_level: int, start: int = 1, tolerance: float = 0.0) -> tuple[int, list[int]]:
    search = CapacitySearch(max_level=max_level, start=start, tolerance=tolerance)
    measured: list[int] = []
    while (level := search.next_level()) is not None:
        assert level not in measured, "a level is measured twice"
        measured.append(level)
        search.record(level, level <= true_capacity)
    return search.result().capacity, measured


@given(true_capacity=st.integers(min_value=0, max_value=600), start=st.integers(min_value=1, max_value=8))
def test_exact_search_finds_the_true_capacity(true_capacity: int, start: int) -> None:
    capacity, measured = exact_search(true_capacity, max_level=512, start=start)
    assert capacity == min(true_capacity, 512)
    # Doubling then bisection: about two log2 steps at most.
    assert len(measured) <= 2 * math.ceil(math.log2(512)) + 2


@given(true_capacity=st.integers(min_value=1, max_value=1000))
def test_tolerant_search_lands_within_the_tolerance_below_the_truth(true_capacity: int) -> None:
    capacity, _ = exact_search(true_capacity, max_level=1024, tolerance=0.1)
    assert capacity <= true_capacity
    assert true_capacity - capacity <= max(1, math.floor(capacity * 0.1))


def test_the_doubling_sequence_and_the_result_fields() -> None:
    search = CapacitySearch(max_level=100)
    levels = []
    while (level := search.next_level()) is not None:
        levels.append(level)
        search.record(level, level <= 20)
    assert levels == [1, 2, 4, 8, 16, 32, 24, 20, 22, 21]
    result = search.result()
    assert result.capacity == 20
    assert result.first_failure == 21
    assert not result.ceiling_reached
    assert result.tried[0] == (1, True)


def test_reaching_the_ceiling_is_reported() -> None:
    capacity, measured = exact_search(true_capacity=10_000, max_level=48)
    assert capacity == 48
    assert measured == [1, 2, 4, 8, 16, 32, 48]
    search = CapacitySearch(max_level=48)
    while (level := search.next_level()) is not None:
        search.record(level, True)
    assert search.result().ceiling_reached


def test_nothing_passing_gives_zero() -> None:
    capacity, measured = exact_search(true_capacity=0, max_level=64, start=8)
    assert capacity == 0
    assert measured == [8, 4, 2, 1]


def test_invalid_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="start"):
        CapacitySearch(max_level=4, start=8)
    with pytest.raises(ValueError, match="tolerance"):
        CapacitySearch(max_level=4, tolerance=-0.1)


async def test_search_capacity_drives_an_async_measure_function() -> None:
    calls: list[int] = []

    async def measure(level: int) -> bool:
        calls.append(level)
        return level <= 5

    result = await search_capacity(measure, max_level=64)
    assert result.capacity == 5
    assert calls == [level for level, _ in result.tried]
