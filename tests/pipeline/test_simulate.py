"""The simulator reproduces the analytic step times and bubbles of the papers, and scales."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.schedule import Action, Schedule, ScheduleError, gpipe, interleaved, one_f_one_b, zero_bubble_h1
from pipeline.simulate import bubble_bound, simulate

ranks = st.integers(1, 8)
microbatches = st.integers(1, 16)
quarters = st.integers(1, 12).map(lambda q: q / 4)  # dyadic seconds: sums are exact in floating point
fast = settings(max_examples=40, deadline=None)


@fast
@given(p=ranks, m=microbatches, f=quarters, b=quarters)
def test_gpipe_and_1f1b_step_is_m_plus_p_minus_1_slots(p: int, m: int, f: float, b: float) -> None:
    for schedule in (gpipe(p, m), one_f_one_b(p, m)):
        result = simulate(schedule, f, b)
        assert result.step_s == (m + p - 1) * (f + b)
        assert result.busy_s == [m * (f + b)] * p
        assert result.idle_s == [(p - 1) * (f + b)] * p
        assert result.bubble == pytest.approx(bubble_bound(p, m))


@fast
@given(p=ranks, rounds=st.integers(1, 3), v=st.integers(1, 3))
def test_interleaved_divides_the_bubble_by_v(p: int, rounds: int, v: int) -> None:
    m, f, b = p * rounds, 1.0, 2.0
    # Each of the p * v stages is 1/v of the model: the (p - 1)(f + b) ramp shrinks v-fold.
    result = simulate(interleaved(p, m, v), f / v, b / v)
    assert result.step_s == pytest.approx(m * (f + b) + (p - 1) * (f + b) / v)


@fast
@given(p=st.integers(2, 8), extra=st.integers(0, 8), f=quarters, b=quarters, w=quarters)
def test_zb_h1_beats_1f1b_when_weight_grad_is_split_out(p: int, extra: int, f: float, b: float, w: float) -> None:
    m = p + extra
    zb = simulate(zero_bubble_h1(p, m), f, b, weight_s=w)
    base = simulate(one_f_one_b(p, m), f, b, weight_s=w)  # runs B + W as one backward
    assert zb.step_s < base.step_s
    assert sum(zb.busy_s) == sum(base.busy_s)  # same work, smaller bubble


@fast
@given(p=st.integers(1, 8), extra=st.integers(0, 8))
def test_zb_h1_matches_the_paper_with_equal_times(p: int, extra: int) -> None:
    m = p + extra
    # Qi et al. 2023: ZB-H1 bubble (p - 1)(F + B - W) vs 1F1B's (p - 1)(F + B + W).
    assert simulate(zero_bubble_h1(p, m), 1.0, 1.0, weight_s=1.0).step_s == 3 * m + (p - 1)
    assert simulate(one_f_one_b(p, m), 1.0, 1.0, weight_s=1.0).step_s == 3 * m + 3 * (p - 1)


def test_weight_s_defaults_to_half_the_backward() -> None:
    schedule = zero_bubble_h1(3, 6)
    assert simulate(schedule, 1.0, 2.0).step_s == simulate(schedule, 1.0, 1.0, weight_s=1.0).step_s


def test_comm_is_added_on_cross_rank_dependencies_only() -> None:
    # p=2, m=1: F0 | comm | F1, B1 | comm | B0.
    assert simulate(gpipe(2, 1), 1.0, 2.0, comm_s=0.5).step_s == 2 * (1.0 + 2.0) + 2 * 0.5
    assert simulate(gpipe(2, 1), 1.0, 2.0, comm_s={(0, 1): 0.25}).step_s == 2 * (1.0 + 2.0) + 2 * 0.25
    # One rank holding both virtual stages: the (0, 1) edge never crosses ranks.
    assert simulate(interleaved(1, 1, 2), 1.0, 2.0, comm_s=0.5).step_s == 2 * (1.0 + 2.0)


def test_per_stage_times() -> None:
    # One microbatch walks the stages: the step is the sum of all passes.
    result = simulate(gpipe(3, 1), [1.0, 2.0, 3.0], [0.5, 0.5, 1.0])
    assert result.step_s == 8.0
    assert result.busy_s == [1.5, 2.5, 4.0]
    assert result.idle_s == [6.5, 5.5, 4.0]


def test_skip_edges_delay_the_consumer() -> None:
    # Stage 2 also reads stage 0's output, which arrives late over a slow link.
    result = simulate(gpipe(3, 1), 1.0, 1.0, comm_s={(0, 2): 10.0}, stage_deps=[(0, 1), (1, 2), (0, 2)])
    assert result.step_s == 1.0 + 10.0 + 1.0 + 1.0 + 10.0 + 1.0  # F0, link, F2, B2, link back, B0 (B1 meanwhile)


def test_events_follow_the_schedule() -> None:
    schedule = one_f_one_b(2, 2)
    result = simulate(schedule, 1.0, 2.0)
    assert len(result.events) == sum(map(len, schedule.actions))
    first = result.events[0]
    assert (first.rank, first.action, first.start, first.end) == (0, "F0@s0", 0.0, 1.0)
    assert max(e.end for e in result.events) == result.step_s


def test_argument_errors() -> None:
    with pytest.raises(ValueError, match="forward_s has 2 entries but the schedule has 3 stages"):
        simulate(gpipe(3, 1), [1.0, 2.0], 1.0)
    with pytest.raises(ValueError, match=r"backward_s has negative \(stage, seconds\) \[\(1, -1.0\)\]"):
        simulate(gpipe(2, 1), 1.0, [1.0, -1.0])
    with pytest.raises(ScheduleError, match="not stage_deps edges"):
        simulate(gpipe(3, 1), 1.0, 1.0, comm_s={(0, 2): 1.0})


def test_deadlocked_schedule_is_rejected() -> None:
    actions = [[Action.parse(a) for a in order] for order in (["B0@s0", "F0@s0"], ["F0@s1", "B0@s1"])]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(Schedule("custom", 2, 2, 1, [0, 1], actions, False), 1.0, 1.0)


def test_bubble_bound() -> None:
    assert bubble_bound(1, 8) == 0.0
    assert bubble_bound(4, 8) == 3 / 11


def test_scales_to_1024_ranks() -> None:
    p, m = 1024, 512  # 1M actions; m=2048 (4M actions) takes several seconds, too long for this file
    schedule = one_f_one_b(p, m)
    start = time.process_time()  # CPU time: the machine may be shared with other test runs
    result = simulate(schedule, 1.0, 2.0)
    elapsed = time.process_time() - start
    assert result.step_s == (m + p - 1) * 3.0
    assert elapsed < 10.0, f"simulating {2 * p * m} actions took {elapsed:.1f} s of CPU"
