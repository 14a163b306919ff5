"""``pipeline.sharded_step``: each rank's end-of-step reductions after its last pass, and a plan's step with its
parameters sharded."""
from __future__ import annotations

import pytest

from partitioner import DeviceRates, PartitionOptions, partition, trace
from partitioner.sdp.group import ShardingGroup
from pipeline.sharded_step import sharded_step, with_end_of_step
from pipeline.stage_simulation import plan_sim, simulate_stages
from smp import zoo


def test_the_end_of_step_work_follows_each_ranks_last_pass() -> None:
    plain = simulate_stages("1f1b", 4, [1e-3, 1e-3], [2e-3, 2e-3], DeviceRates())
    assert with_end_of_step(plain, [0.0, 0.0]) == pytest.approx((plain.step_s, plain.bubble))
    sim = simulate_stages("1f1b", 4, [1e-3, 1e-3], [2e-3, 2e-3], DeviceRates(step_overhead_s=5e-4))
    assert with_end_of_step(sim, [0.0, 0.0])[0] == pytest.approx(sim.step_s)  # the step's fixed cost is kept
    last = [e[-1] for e in sim.ends]
    step, bubble = with_end_of_step(sim, [1e-2, 0.0])
    assert step == pytest.approx(last[0] + 1e-2 + 5e-4)  # rank 0's last backward, then its reduction
    assert bubble == pytest.approx(1 - (sum(sim.busy_s) + 1e-2) / (2 * step))


def test_a_sharded_plan_pays_its_gathers_and_reductions() -> None:
    z = zoo.build("mlp")
    graph = trace(z.model, z.args, z.kwargs)
    options = PartitionOptions(device="h100-80gb", microbatches=4)
    plan = partition(graph, 2, options)
    sim = plan_sim(plan, graph, options)
    priced = sharded_step(plan, graph, options, sim, ShardingGroup(2, threshold=1))
    assert len(priced.ranks) == 2 and all(r.degree == 2 and r.gather_forward_s > 0 for r in priced.ranks)
    assert priced.step_s > sim.step_s + max(r.end_of_step_s for r in priced.ranks) - 1e-12
