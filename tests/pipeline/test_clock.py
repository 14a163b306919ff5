"""Clock offsets by ping-pong: a rank whose clock runs 5 s ahead is found 5 s ahead."""
from __future__ import annotations

import time

import pytest

from pipeline.clock import ClockOffset, clock_offset
from smp.testing import run_ranks


def _offsets(rank: int, world: int) -> tuple[float, float]:
    skew = 5.0 * rank  # rank r's clock reads 5 r seconds more than rank 0's
    got = clock_offset(lambda: time.perf_counter() + skew, rounds=4)
    return got.offset_s, got.error_s


def test_offsets_from_rank0_are_found_within_half_a_round_trip():
    results = run_ranks(_offsets, 3, timeout=120)
    assert results[0] == (0.0, 0.0)
    for rank, (offset, error) in enumerate(results[1:], 1):
        assert 0 < error < 0.05
        assert abs(offset - 5.0 * rank) <= error + 1e-3


def test_a_time_moves_to_rank0s_clock():
    assert ClockOffset(2.0, 0.1).to_rank0(10.0) == 8.0


def test_rounds_must_be_positive():
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        clock_offset(rounds=0)
