"""Token-count buckets of the talker's prefill graphs."""

from __future__ import annotations

from omnigate.engines.talker.prefill_graphs import prefill_buckets


def test_buckets_double_from_sixteen_and_end_at_the_maximum() -> None:
    assert prefill_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert prefill_buckets(100) == [16, 32, 64, 100]
    assert prefill_buckets(16) == [16]
    assert prefill_buckets(5) == [5]
