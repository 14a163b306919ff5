"""``pipeline.stage_pricing``: a real plan's stage costs up to the exact limit, total / P beyond it; boundaries
priced by where their ranks are; what sharded data parallelism's prefetched gathers expose in the passes and its
reductions in the step."""
from __future__ import annotations

import pytest

from partitioner import OpGraph, PartitionOptions, partition, trace
from partitioner.sdp.group import ShardingGroup, cut_options
from pipeline.sharded_step import exposed
from pipeline.stage_pricing import EXACT_MAX_STAGES, pipeline_costs, simulate_costs
from smp import zoo

OPTIONS = PartitionOptions(device="h100-80gb", dtype="bf16", microbatches=4)
INTER = (1e9, 1e-4)  # a slow link between nodes


@pytest.fixture(scope="module")
def graph() -> OpGraph:
    z = zoo.build("mlp")
    return trace(z.model, z.args, z.kwargs)


def test_a_real_plan_up_to_the_exact_limit_and_total_over_p_beyond(graph: OpGraph) -> None:
    exact = pipeline_costs(graph, OPTIONS, 3)
    assert exact.exact and len(exact.forward_s) == 3 and exact.note.startswith("a real 3-stage plan")
    assert exact.deps == sorted(exact.edge_bytes) and len(exact.param_state) == len(exact.act_bytes) == 3
    ops = sum(k != "output" for k in graph.kinds)
    deep = pipeline_costs(graph, OPTIONS, ops + 5)
    assert not deep.exact and "no real plan exists" in deep.note and len(set(deep.forward_s)) == 1
    assert sum(deep.forward_s) == pytest.approx(sum(exact.forward_s))  # the model's total, spread evenly
    assert deep.deps == [(s, s + 1) for s in range(ops + 4)]
    assert not pipeline_costs(graph, OPTIONS, 3, exact=False).exact and EXACT_MAX_STAGES >= 3


def test_boundaries_between_nodes_take_the_inter_node_link(graph: OpGraph) -> None:
    costs = pipeline_costs(graph, OPTIONS, 4)
    one_node = simulate_costs("1f1b", costs, 4, 4, 4, INTER)
    node_each = simulate_costs("1f1b", costs, 4, 4, 1, INTER)
    assert node_each.step_s > one_node.step_s and one_node.peak_activation_bytes > 0
    assert 0 <= one_node.bubble < 1


def test_sharding_adds_what_the_gathers_expose_to_the_passes_and_the_reductions_to_the_step(graph: OpGraph) -> None:
    plain = pipeline_costs(graph, OPTIONS, 2)
    group = ShardingGroup(2, threshold=1)
    sharded = pipeline_costs(graph, OPTIONS, 2, sdp=group)
    assert len(sharded.sdp) == 2 and all(r.sharded > 0 for r in sharded.sdp)
    plan = partition(graph, 2, cut_options(OPTIONS, 2))
    fwd, bwd, end = exposed(plan, graph, group, sharded.sdp, plain.forward_s, plain.backward_s)
    assert sharded.forward_s == pytest.approx([f + g for f, g in zip(plain.forward_s, fwd)])
    assert sharded.sdp_gather_s == pytest.approx([f + b for f, b in zip(fwd, bwd)])
    # prefetched: no more than the gathers' own seconds, no less than the first unit's
    assert all(0 < g <= r.gather_forward_s + 1e-12 for g, r in zip(fwd, sharded.sdp))
    assert sharded.sdp_end_s == pytest.approx(end)
    assert simulate_costs("1f1b", sharded, 4, 2, 8, INTER).step_s > simulate_costs("1f1b", plain, 4, 2, 8, INTER).step_s
    assert pipeline_costs(graph, OPTIONS, 2, sdp=ShardingGroup(1)).sdp == []  # degree 1: nothing sharded
