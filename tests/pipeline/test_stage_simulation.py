"""``pipeline.stage_simulation``: a schedule's step from stage seconds, a plan's schedule with its transfers, the
closed form for equal stages, and the layout planner's simulator, all one step model."""
from __future__ import annotations

import pytest

from partitioner import DeviceRates, PartitionOptions, partition, trace
from pipeline.schedule import make_schedule, peak_in_flight
from pipeline.stage_simulation import formula_step, pipeline_simulator, plan_sim, simulate_stages
from pipeline.step_model import plan_step
from smp import zoo


def test_scaling_formula_is_what_the_simulator_gives_for_equal_stages() -> None:
    """The formula `smp simulate` prints for large cells: equal stages, free communication, with and without the
    runtime's per-pass and per-step costs."""
    for rates in (DeviceRates(), DeviceRates(pass_overhead_s=1e-3, step_overhead_s=2e-3)):
        for name in ("gpipe", "1f1b"):
            for p, m in ((4, 8), (8, 3), (16, 32)):
                T = 0.024
                sim = simulate_stages(name, m, [T / 3 / p] * p, [2 * T / 3 / p] * p, rates)
                assert sim.step_s == pytest.approx(formula_step(p, m, T, rates))
                if not rates.pass_overhead_s:
                    assert sim.step_s == pytest.approx((m + p - 1) * T / p)
                    assert sim.bubble == pytest.approx((p - 1) / (m + p - 1))


def test_the_layout_planners_simulator_is_simulate_stages() -> None:
    rates = DeviceRates(pass_overhead_s=1e-4, step_overhead_s=1e-3)
    fwd, bwd, comm, deps = [1e-3, 2e-3, 1e-3, 2e-3], [2e-3, 4e-3, 2e-3, 4e-3], {(0, 1): 1e-4, (1, 2): 2e-4}, [(0, 1)]
    out = pipeline_simulator("interleaved-virtual", 2, 4, 2, fwd, bwd, comm, deps + [(1, 2), (2, 3)], rates)
    sim = simulate_stages("interleaved-virtual", 4, fwd, bwd, rates, deps=deps + [(1, 2), (2, 3)], comm=comm,
                          num_ranks=2, virtual_stages=2)
    assert (out.step_s, out.bubble) == (sim.step_s, sim.bubble)
    assert out.rank_end_s == [e[-1] for e in sim.ends] and out.peak_in_flight == peak_in_flight(sim.schedule)


def test_a_plans_schedule_is_priced_as_the_step_model_prices_the_plan() -> None:
    z = zoo.build("mlp")
    graph = trace(z.model, z.args, z.kwargs)
    options = PartitionOptions(device="h100-80gb", microbatches=6, pipeline="gpipe")
    plan = partition(graph, 3, options)
    sim = plan_sim(plan, graph, options)
    assert sim.step_s == plan_step(plan, make_schedule("gpipe", 3, 6), graph=graph).step_s
    slower = plan_sim(plan, graph, options, forward_s=[2 * s.forward_s for s in plan.stages])
    assert slower.step_s > sim.step_s


def test_the_planners_simulator_builds_each_schedule_once_and_prices_it_as_a_fresh_one() -> None:
    """The schedule a layout search simulates hundreds of times is built once per shape, and the outcome of the same
    inputs is kept; each call still gives what a freshly built schedule gives (simulations do not modify the shared
    one), its lists its own."""
    rates = DeviceRates(pass_overhead_s=1e-4, step_overhead_s=1e-3)
    cases = [("1f1b", 4, 8, 1), ("gpipe", 4, 8, 1), ("interleaved-virtual", 2, 4, 2), ("zero-bubble", 3, 6, 1)]
    for times in ([1e-3, 3e-3, 2e-3, 1e-3], [5e-3, 1e-3, 1e-3, 4e-3]):
        for name, ranks, m, v in cases:
            k = ranks * v
            fwd, bwd = times[:k] + [1e-3] * (k - len(times[:k])), [2 * t for t in times[:k]] + [2e-3] * (k - 4)
            deps = [(s, s + 1) for s in range(k - 1)]
            comm = {e: 1e-4 * (1 + e[0]) for e in deps}
            out = pipeline_simulator(name, ranks, m, v, fwd, bwd, comm, deps, rates)
            out.peak_in_flight.append(-1)  # the caller's own lists
            out.rank_end_s.append(-1.0)
            again = pipeline_simulator(name, ranks, m, v, fwd, bwd, comm, deps, rates)
            fresh = simulate_stages(name, m, fwd, bwd, rates, deps=deps, comm=comm, num_ranks=ranks,
                                    virtual_stages=v)
            assert (again.step_s, again.bubble) == (fresh.step_s, fresh.bubble)
            assert again.rank_end_s == [e[-1] for e in fresh.ends]
            assert again.peak_in_flight == peak_in_flight(fresh.schedule)
