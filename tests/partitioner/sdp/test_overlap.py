"""``partitioner.sdp.overlap``: prefetched collectives (our runtime's and FSDP's) expose only what compute cannot hide,
one per unit (``partitioner.sdp.units``); pricing them exposed (``Pricing(overlap=False)``) costs more."""
from __future__ import annotations

import numpy as np
import pytest

from partitioner.cut.options import PartitionOptions
from partitioner.layout.costs import layout_costs
from partitioner.layout.layout import Layout
from partitioner.layout.score import LayoutScorer, Pricing
from partitioner.sdp.overlap import StageCollectives, exposed_s, overlapped, stage_collectives
from partitioner.sdp.shards import sharded_params
from partitioner.sdp.units import fsdp_unit, group_units
from pipeline.stage_simulation import pipeline_simulator
from smp import zoo

OPTIONS = PartitionOptions(device="h100-80gb", dtype="bf16")


@pytest.fixture(scope="module")
def costs():
    z = zoo.build("gpt2", batch=2)
    return layout_costs(z.model, z.args, z.kwargs, sizes=[2], tp_degrees=[1], rates=OPTIONS.resolve_rates(),
                        dtype="bf16")


def test_the_two_stream_bound_hides_what_compute_covers() -> None:
    assert exposed_s(10.0, 4.0, first_s=1.0, last_s=0.5) == 1.5  # hidden but the first and the last
    assert exposed_s(2.0, 4.0, first_s=1.0) == pytest.approx(1.0 + 1.0)  # 3 s after the first, 2 s of compute
    assert exposed_s(0.0, 4.0) == 4.0 and exposed_s(5.0, 0.0) == 0.0


def test_fsdp_units_are_the_blocks_of_a_layer_list_and_the_root() -> None:
    assert fsdp_unit("model.layers.3.mlp.up_proj.weight") == "model.layers.3"
    assert fsdp_unit("transformer.h.11.attn.c_attn.weight") == "transformer.h.11"
    assert fsdp_unit("lm_head.weight") == "" and fsdp_unit("model.norm.weight") == ""


def test_units_are_blocks_and_runs_outside_them_cut_at_a_blocks_bytes() -> None:
    names = ["wte", "wpe", "h.0.a", "h.0.b", "h.1.a", "h.1.b", "ln_f.weight", "ln_f.bias", "head"]
    nbytes = [8.0, 1.0, 2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 3.0]
    # the embedding alone reaches a block's 4 bytes: the position embedding starts a unit of its own
    assert group_units(names, nbytes) == [[0], [1], [2, 3], [4, 5], [6, 7, 8]]
    assert group_units(names[:2], nbytes[:2]) == [[0, 1]]  # no block: one unit
    assert group_units(names[2:6], nbytes[2:6], keys=["a", "b", "b", "b"]) == [[0], [1], [2, 3]]  # dtype, mesh


def test_overlapped_passes_and_the_reduce_scatter_tail() -> None:
    c = StageCollectives(gathers_s=(1.0, 2.0, 3.0), scatters_s=(0.5, 1.0, 1.0))
    fwd, bwd, tail = overlapped([c, StageCollectives((), ())], [10.0, 1.0], [1.0, 1.0])
    # backward: the last unit stays whole from the forward, and 1 s of compute hides 1 s of the other 3
    assert fwd[0] == 1.0 and bwd[0] == 2.0
    # the last backward: the last reduce-scatter, and what 1 s of compute leaves of the rest
    assert tail[0] == pytest.approx(0.5 + max(0.0, 5.5 - 0.5 - 1.0) - bwd[0])
    assert fwd[1] == bwd[1] == tail[1] == 0.0


def test_overlap_prices_no_more_than_our_runtime_and_no_less_than_compute(costs) -> None:
    layout = Layout(pp=1, tp=1, dp=4, sdp=4, microbatch_size=2, microbatches=1)
    ours, fsdp = (LayoutScorer(costs, Pricing(OPTIONS, 2, 1000, overlap=o), pipeline_simulator) for o in (False, True))
    plain = ours.score(Layout(pp=1, tp=1, dp=1, microbatch_size=2, microbatches=1))
    a, b = ours.score(layout), fsdp.score(layout)
    assert plain.step_s <= b.step_s < a.step_s  # across two nodes: overlap hides some, never the compute
    assert b.memory_bytes == a.memory_bytes  # memory is the sharded ranks' either way
    plan, graph = fsdp.plan(layout), costs.graph(1, 2)
    units = stage_collectives(plan, graph, 4, 1000, fsdp.inter)
    sharded = [n for n, on in zip(graph.param_names, sharded_params(graph, plan.stage_of_ops(graph), 1, 4, 1000)) if on]
    blocks = {fsdp_unit(n) for n in sharded} - {""}
    assert len(units) == 1 and len(blocks) < len(units[0].gathers_s) < len(sharded)  # per unit, not per parameter
    assert np.isclose(sum(units[0].gathers_s), sum(units[0].scatters_s))  # bf16 weights and gradients alike
