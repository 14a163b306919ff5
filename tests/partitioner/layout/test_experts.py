"""``partitioner.layout.experts`` and the planner's expert parallelism: on a small Mixtral, the search considers ep
degrees dividing dp and the experts, an ep rank holds 1/ep of the experts' state, its all-to-alls cost time that
grows with the tokens (more across nodes), ep is never proposed with sdp or ZeRO-1, and a dense model gets no ep."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from partitioner.cost.precision import param_memory_parts
from partitioner.cut.options import PartitionOptions
from partitioner.layout.costs import layout_costs
from partitioner.layout.experts import ep_choices, expert_params
from partitioner.layout.layout import Layout, group_link
from partitioner.layout.score import LayoutScorer, Pricing
from partitioner.layout.search import SearchSpace, candidates, search
from pipeline.stage_simulation import pipeline_simulator
from smp import zoo
from tests.smp.test_expert_parallel import moe_model

OPTIONS = PartitionOptions(device="h100-80gb", dtype="bf16")


@pytest.fixture(scope="module")
def costs():
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    return layout_costs(moe_model("mixtral"), (ids,), {}, sizes=[2, 4], tp_degrees=[1, 2],
                        rates=OPTIONS.resolve_rates(), dtype="bf16")


@pytest.fixture(scope="module")
def scorer(costs):
    return LayoutScorer(costs, Pricing(OPTIONS, 8), pipeline_simulator)


def _expert_state(graph, names) -> float:
    """Bytes of weights, gradients and optimizer state of the parameters named ``names``."""
    mine = np.array([n in names for n in graph.param_names], bool)
    return sum(float(v[mine].sum()) for v in param_memory_parts(graph, "bf16", "adam").values())


def test_the_degrees_divide_dp_and_every_layers_experts(costs) -> None:
    assert costs.experts == (4, 4)  # two layers of 4 experts
    assert ep_choices(8, costs.experts) == [1, 2, 4]
    assert ep_choices(6, costs.experts) == [1, 2]
    assert ep_choices(8, ()) == [1]  # a dense model


def test_an_ep_rank_holds_its_share_of_the_experts(costs, scorer) -> None:
    one = Layout(pp=1, tp=1, dp=4, microbatch_size=2, microbatches=2)
    graphs = {ep: scorer.priced(dataclasses.replace(one, ep=ep))[0] for ep in (1, 2, 4)}
    names = set(graphs[2].fx.experts.params)
    assert names and not expert_params(graphs[1]).any()
    whole = _expert_state(graphs[1], names)
    for ep in (2, 4):
        assert expert_params(graphs[ep]).sum() == len(names)
        assert _expert_state(graphs[ep], names) == pytest.approx(whole / ep)
    held = [scorer.score(dataclasses.replace(one, ep=ep)).parameter_bytes for ep in (1, 2, 4)]
    assert held[0] - held[1] == pytest.approx(whole / 2, rel=1e-6)
    assert held[1] - held[2] == pytest.approx(whole / 4, rel=1e-6)


def test_all_to_alls_cost_time_that_grows_with_the_tokens_and_across_nodes(costs, scorer) -> None:
    inter = scorer.inter
    comm = {size: costs.costs(1, size, 2).tp_forward_s.sum() for size in (2, 3, 4)}
    assert costs.costs(1, 2).tp_forward_s is None  # no collective at tp 1, ep 1
    assert 0 < comm[2] < comm[3] < comm[4]
    assert comm[3] == pytest.approx((comm[2] + comm[4]) / 2)  # interpolated on the line through the traces
    assert costs.costs(1, 3, 2, inter).tp_forward_s.sum() > comm[3]
    # A group of ep replicas spans nodes when they are more ranks apart than a node has.
    wide = Layout(pp=4, tp=1, dp=4, microbatch_size=2, microbatches=4, ep=4)
    assert group_link(wide, scorer.rates, inter, 8) is inter
    assert group_link(dataclasses.replace(wide, placement="PDT"), scorer.rates, inter, 8) is None
    s = scorer.score(Layout(pp=1, tp=1, dp=4, microbatch_size=2, microbatches=2, ep=2))
    assert s.tp_comm_s == pytest.approx(2 * (costs.costs(1, 2, 2).tp_forward_s.sum()
                                             + costs.costs(1, 2, 2).tp_backward_s.sum()))


def test_ep_is_searched_but_never_with_sdp_or_zero1(costs, scorer) -> None:
    space = SearchSpace(devices=8, global_batch=16, ranks_per_node=8)
    layouts = list(candidates(space, costs.tp_degrees, (), costs.experts))
    assert {lay.ep for lay in layouts} == {1, 2, 4}
    assert not any(lay.ep > 1 and (lay.sdp > 1 or lay.zero1) for lay in layouts)
    assert any(lay.ep == 1 and lay.sdp > 1 for lay in layouts) and any(lay.ep == 1 and lay.zero1 for lay in layouts)
    result = search(layouts, scorer, top=50, exhaustive=True)
    assert any(p.layout.ep > 1 for p in result.proposals)
    assert not any(p.layout.ep > 1 and (p.layout.sdp > 1 or p.layout.zero1) for p in result.proposals)
    for bad in ({"sdp": 2}, {"zero1": True}, {"ep": 8}):
        with pytest.raises(ValueError, match="ep="):
            Layout(**{"pp": 1, "tp": 1, "dp": 4, "microbatch_size": 1, "microbatches": 1, "ep": 2, **bad})


def test_a_dense_model_gets_no_ep() -> None:
    z = zoo.build("gpt2", batch=2)
    dense = layout_costs(z.model, z.args, z.kwargs, sizes=[2], tp_degrees=[1], rates=OPTIONS.resolve_rates(),
                         dtype="bf16")
    assert dense.experts == ()
    space = SearchSpace(devices=8, global_batch=16, ranks_per_node=8)
    assert {lay.ep for lay in candidates(space, dense.tp_degrees, (), dense.experts)} == {1}
