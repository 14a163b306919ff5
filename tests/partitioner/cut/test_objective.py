"""The objective: monotone in bottleneck and largest-stage memory; within 1% of the best, fewer bytes cut and
fewer activations in flight win; a dominated plan is never chosen."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import partitioner
from partitioner import DeviceRates, OpGraph
from partitioner.cut.objective import HEADROOM, NEAR, choose, dominates, evaluate, roomy_budget
from partitioner.cut.portfolio import make_problem
from tests.conftest import stage_array

FAST_LINK = DeviceRates(link_bytes_per_s=1e15, link_latency_s=0.0)  # compute decides the bottleneck


def chain(ms: list[float], value_bytes: list[int], act_bytes: list[int],
          param_bytes: list[int] | None = None) -> OpGraph:
    """Ops taking ``ms`` milliseconds each under ``DeviceRates()``, then the output; op i sends
    ``value_bytes[i]`` to op i + 1, keeps ``act_bytes[i]`` for backward and owns a weight of ``param_bytes[i]``."""
    n = len(ms) + 1
    flops = np.array([m * 1e-3 * DeviceRates().flops_per_s for m in ms] + [0.0])
    act = np.array(list(act_bytes) + [0], np.int64)
    weights = np.array(param_bytes or [], np.int64)
    return OpGraph(names=[f"op{i}" for i in range(n)], kinds=["aten.mm"] * (n - 1) + ["output"], modules=[""] * n,
                   flops=flops, out_bytes=act.copy(), act_bytes=act, move_bytes=np.zeros(n, np.int64),
                   src=np.arange(n - 1), dst=np.arange(1, n), value=np.arange(n - 1),
                   value_bytes=np.array(value_bytes, np.int64), param_names=[f"w{i}" for i in range(len(weights))],
                   param_bytes=weights, param_trainable=np.ones(len(weights), bool),
                   use_node=np.arange(len(weights)), use_param=np.arange(len(weights)))


def embedding_first() -> OpGraph:
    """An embedding-like op (1 ms, 120 MiB of weights) then three layers (10 ms, 50 MiB each): the fastest
    two-stage cut, after op1 (bottleneck 20 ms), holds 170 MiB of weights on stage 0 (680 MiB with gradients
    and Adam); cutting after op0 (30 ms) holds at most 150 MiB (600 MiB)."""
    return chain([1.0, 10.0, 10.0, 10.0], [8, 8, 8, 4], [1, 1, 1, 1], [120 << 20, 50 << 20, 50 << 20, 50 << 20])


def test_fewer_bytes_cut_wins_within_one_percent():
    # Cutting after op0 sends 64 MiB and is balanced (20.05 ms); after op1, 1 KiB at 20.15 ms (0.5% slower).
    g = chain([20.0, 0.15, 19.9], [64 << 20, 1 << 10, 4], [1, 1, 1])
    plan = partitioner.partition(g, 2, rates=FAST_LINK, memory_weight=0.0)
    assert stage_array(plan, g).tolist() == [0, 0, 1, 1] and plan.cut_bytes == 1 << 10
    fastest = make_problem(g, 2, rates=FAST_LINK, memory_weight=0.0)
    best = evaluate(fastest, np.array([0, 1, 1, 1])).bottleneck
    assert best < plan.bottleneck <= best * (1 + NEAR)


def test_a_cheaper_cut_more_than_one_percent_slower_loses():
    # After op1 the cut is cheap but the bottleneck is 2.5% worse: the balanced, dearer cut stays.
    g = chain([20.0, 0.5, 19.5], [64 << 20, 1 << 10, 4], [1, 1, 1])
    plan = partitioner.partition(g, 2, rates=FAST_LINK, memory_weight=0.0)
    assert stage_array(plan, g).tolist() == [0, 1, 1, 1] and plan.cut_bytes == 64 << 20


def test_fewer_activations_in_flight_break_a_tie_in_cut_bytes():
    # Equal cut bytes; op1 keeps 100 MB for backward. Under 1F1B with 2 stages the first stage holds two
    # microbatches, so placing op1 on the second stage (0.5% slower) holds 100 MB less.
    g = chain([19.9, 0.15, 20.0], [1 << 10, 1 << 10, 4], [1 << 20, 100 << 20, 1 << 20])
    plan = partitioner.partition(g, 2, rates=FAST_LINK, memory_weight=0.0, microbatches=4)
    assert stage_array(plan, g).tolist() == [0, 1, 1, 1]
    p = make_problem(g, 2, rates=FAST_LINK, memory_weight=0.0, microbatches=4)
    other = evaluate(p, np.array([0, 0, 1, 1]))
    assert other.bottleneck < plan.bottleneck and other.act_in_flight > evaluate(p, stage_array(plan, g)).act_in_flight


def test_the_objective_is_monotone_in_bottleneck_and_memory():
    """A plan at least as fast and as small as another never scores worse, whatever the memory weight."""
    g = chain([10.0, 1.0, 5.0, 5.0, 9.0], [8, 8, 8, 8, 4], [1 << 20, 50 << 20, 1 << 10, 1 << 10, 1 << 20])
    for w in (0.0, 0.2, 0.5, 1.0):
        p = make_problem(g, 3, rates=FAST_LINK, memory_weight=w, microbatches=8)
        plans = [evaluate(p, np.searchsorted((0, a, b), np.arange(6), side="right") - 1)
                 for a in range(1, 5) for b in range(a + 1, 5)]
        for x in plans:
            for y in plans:
                if x.bottleneck <= y.bottleneck and x.memory.max() <= y.memory.max():
                    assert x.objective <= y.objective + 1e-12


def test_dominates():
    assert dominates((1.0, 10, 5.0), (1.0, 11, 5.0))
    assert not dominates((1.0, 10, 5.0), (1.0, 10, 5.0))            # equal is not better
    assert not dominates((0.9, 12, 5.0), (1.0, 11, 5.0))            # better in one, worse in another
    assert not dominates((1.0 + 1e-12, 10, 5.0), (1.0, 10, 5.0))    # float noise is not a difference


def test_choose_never_keeps_a_dominated_plan():
    g = chain([20.0, 0.15, 19.9], [64 << 20, 1 << 10, 4], [1, 1, 1])
    p = make_problem(g, 2, rates=FAST_LINK, memory_weight=0.0)
    balanced, cheap = evaluate(p, np.array([0, 1, 1, 1])), evaluate(p, np.array([0, 0, 1, 1]))
    assert choose([("a", balanced), ("b", cheap)], None)[0] == "b"
    cheaper_and_as_fast = evaluate(p, np.array([0, 0, 1, 1]))
    cheaper_and_as_fast.cut_bytes = 0  # an imaginary plan that dominates both
    assert choose([("a", balanced), ("b", cheap), ("c", cheaper_and_as_fast)], None)[0] == "c"


def test_memory_weight_trades_time_for_memory_on_the_pareto_front():
    # op1 keeps 400 MiB for backward: on stage 0 (2 microbatches in flight under 1F1B) it costs twice what it
    # costs on stage 1 (one), so the smallest plan puts it there, at the price of a slower stage 1.
    g = chain([5.0, 5.0, 5.0, 5.0], [8, 8, 8, 4], [1 << 10, 400 << 20, 1 << 10, 1 << 10])
    fast = partitioner.partition(g, 2, rates=FAST_LINK, memory_weight=0.0, microbatches=4)
    small = partitioner.partition(g, 2, rates=FAST_LINK, memory_weight=1.0, microbatches=4)
    assert stage_array(fast, g).tolist() == [0, 0, 1, 1, 1] and stage_array(small, g).tolist() == [0, 1, 1, 1, 1]
    assert fast.bottleneck < small.bottleneck and small.max_memory_bytes < fast.max_memory_bytes / 1.9
    with pytest.raises(partitioner.MemoryBudgetError):
        partitioner.partition(g, 2, rates=FAST_LINK, microbatches=4, device_memory=100 << 20)


def test_under_a_tight_budget_a_plan_with_headroom_wins_then_the_smallest():
    p = make_problem(embedding_first(), 2, rates=FAST_LINK, memory_weight=0.0)
    fast, small = ("fast", evaluate(p, np.array([0, 0, 1, 1, 1]))), ("small", evaluate(p, np.array([0, 1, 1, 1, 1])))
    assert fast[1].bottleneck < small[1].bottleneck and small[1].memory.max() < fast[1].memory.max()
    assert (fast[1].memory.max(), small[1].memory.max()) == pytest.approx((680 << 20, 600 << 20), abs=16)
    # No budget, or one with room to spare: the objective decides, as always.
    assert choose([fast, small], None)[0] == "fast" and choose([fast, small], float(1 << 30))[0] == "fast"
    # 700 MiB: the fast plan fits but leaves 2.9% free, the small one 14%: the one with headroom wins.
    assert not fast[1].roomy(700 << 20) and small[1].roomy(700 << 20)
    assert choose([fast, small], float(700 << 20))[0] == "small"
    # 650 MiB: only the small plan fits, with 7.7% free (less than HEADROOM): tight, the smaller wins.
    assert roomy_budget(650 << 20) == pytest.approx((1 - HEADROOM) * (650 << 20))
    assert choose([fast, small], float(650 << 20))[0] == "small"
    # Tight, beside imaginary plans twice as slow: 0.5% smaller is as small (NEAR), and the faster wins;
    # 5% smaller is smaller, and wins however slow.
    def slower(ev, memory_scale):
        return dataclasses.replace(ev, compute_s=ev.compute_s * 2, objective=ev.objective * 2,
                                   memory=ev.memory * memory_scale)
    as_small = ("as small, slower", slower(small[1], 0.995))
    assert choose([as_small, small, fast], float(650 << 20))[0] == "small"
    smaller = ("smaller, slower", slower(small[1], 0.95))
    assert choose([smaller, small, fast], float(650 << 20))[0] == "smaller, slower"
