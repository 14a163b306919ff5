"""``pipeline.stage_pricing``: a real plan's stage costs up to the exact limit, total / P beyond it; boundaries
priced by where their ranks are; sharded data parallelism's gathers in the passes and its reductions in the step."""
from __future__ import annotations

import pytest

from partitioner import OpGraph, PartitionOptions, trace
from partitioner.sdp.group import ShardingGroup
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


def test_sharding_adds_the_gathers_to_the_passes_and_the_reductions_to_the_step(graph: OpGraph) -> None:
    plain = pipeline_costs(graph, OPTIONS, 2)
    sharded = pipeline_costs(graph, OPTIONS, 2, sdp=ShardingGroup(2, threshold=1))
    assert len(sharded.sdp) == 2 and all(r.sharded > 0 for r in sharded.sdp)
    gathers = [r.gather_forward_s for r in sharded.sdp]
    assert sharded.forward_s == pytest.approx([f + g for f, g in zip(plain.forward_s, gathers)])
    assert sharded.sdp_gather_s == pytest.approx([2 * g for g in gathers])
    assert sharded.sdp_end_s == [r.end_of_step_s for r in sharded.sdp]
    assert simulate_costs("1f1b", sharded, 4, 2, 8, INTER).step_s > simulate_costs("1f1b", plain, 4, 2, 8, INTER).step_s
    assert pipeline_costs(graph, OPTIONS, 2, sdp=ShardingGroup(1)).sdp == []  # degree 1: nothing sharded
