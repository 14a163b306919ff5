"""PartitionPlan.bind: a plan from a file is checked against the model's trace before it cuts it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner import DeviceRates, PartitionPlan, partition, trace
from partitioner.plan import PlanMismatchError


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
