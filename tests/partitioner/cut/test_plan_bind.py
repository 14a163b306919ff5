"""PartitionPlan.bind: a plan from a file is checked against the model's trace before it cuts it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner import DeviceRates, PartitionPlan, partition, trace
from partitioner.cut.plan import PlanMismatchError


def _graph(width: int = 16, layers: int = 3):
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])
    return trace(net, (torch.randn(2, width),), {})


def test_a_plan_binds_to_a_trace_of_its_model():
    graph = _graph()
    plan = PartitionPlan.from_json(partition(graph, 2, rates=DeviceRates()).to_json())
    bound = plan.bind(_graph(), num_stages=2)
    assert bound.graph is not None and plan.graph is None and bound.assignment == plan.assignment
    assert len(bound.stage_modules()) == 2


def test_a_plan_of_another_model_or_stage_count_is_refused_with_what_differs():
    plan = partition(_graph(), 2, rates=DeviceRates())
    with pytest.raises(PlanMismatchError, match=r"partition_file 'p.json' has 2 stages but this run has 4"):
        plan.bind(_graph(), "partition_file 'p.json'", num_stages=4)
    with pytest.raises(PlanMismatchError, match=r"does not fit this model: 4 of its 11 traced ops are not in the "
                                                r"plan .* smp replan"):
        plan.bind(_graph(layers=5))
    assert issubclass(PlanMismatchError, ValueError)


def test_a_tensor_parallel_plan_round_trips_and_binds_only_to_its_degree():
    """The plan JSON records tensor parallelism; a plan without the record (older) is degree 1; either binds only
    to a graph sharded for its own degree, with an error that says which."""
    from partitioner.tp.shard_program import shard_graph
    from partitioner.tp.sharding import find_sharding

    whole = _graph(width=16, layers=4)  # Linear, ReLU, Linear, ReLU ...: column- then row-parallel pairs
    local = shard_graph(whole, find_sharding(whole.fx.module, 2), 0)
    plan = partition(local, 2, rates=DeviceRates())
    assert plan.tensor_parallel["degree"] == 2 and plan.tensor_parallel["sharding"]["params"]
    text = plan.to_json()
    loaded = PartitionPlan.from_json(text)
    assert loaded.to_json() == text and loaded.tensor_parallel == plan.tensor_parallel
    assert loaded.bind(shard_graph(whole, find_sharding(whole.fx.module, 2), 1)).graph is not None  # any tp rank
    with pytest.raises(PlanMismatchError, match=r"plan.json was made for tensor-parallel degree 2 but the graph is "
                                                r"not sharded \(tensor-parallel degree 1\)"):
        loaded.bind(whole, "plan.json")
    with pytest.raises(PlanMismatchError, match=r"made for tensor-parallel degree 2 but the graph is sharded for "
                                                r"tensor-parallel degree 4"):
        loaded.bind(shard_graph(whole, find_sharding(whole.fx.module, 4), 0))
    old = PartitionPlan.from_json(partition(whole, 2, rates=DeviceRates()).to_json())
    assert "tensor_parallel" not in old.to_dict() and old.tensor_parallel == {}
    assert old.bind(_graph(width=16, layers=4)).graph is not None
    with pytest.raises(PlanMismatchError, match=r"made for a model without tensor parallelism but the graph is "
                                                r"sharded for tensor-parallel degree 2"):
        old.bind(local)


def test_a_step_that_passes_other_keyword_inputs_is_told_which():
    """A GPT-2 plan made from ``(input_ids,)`` and a step that calls ``model(ids, labels=ids)``: the trace holds the
    loss ops the plan lacks, and the error names ``labels``, not only op names."""
    import transformers as T

    cfg = T.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    plan = PartitionPlan.from_json(partition(trace(model, (ids,), {}), 2, rates=DeviceRates()).to_json())
    named = r"this call passes \['labels'\] that .*the plan: \['input_ids'\]; this call: \['input_ids', 'labels'\]"
    with pytest.raises(PlanMismatchError, match=named):
        plan.bind(trace(model, (ids,), {"labels": ids}), "partition_file 'job.plan.json'")
