"""A plan re-bound to a trace at other input shapes (partitioner.cut.respecialise): the same stages, ops matched by
structure (an op elided at some shapes renames the later ones), this class's FLOPs, and a clear error when the
shapes take another code path that moves weights between stages."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner import DeviceRates, partition, trace
from partitioner.cut.respecialise import ShapeClassError, respecialise


class Branchy(nn.Module):
    """Runs ``b`` only on batches of more than two samples: a shape-dependent code path."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).relu()
        if x.shape[0] > 2:
            h = self.b(h).relu()
        return self.c(h)


def _plan(model: nn.Module, x: torch.Tensor):
    return partition(trace(model, (x,)), 2, rates=DeviceRates(), microbatches=1)


def test_same_stages_and_this_class_flops():
    model = Branchy()
    plan = _plan(model, torch.randn(8, 8))
    other = respecialise(plan, trace(model, (torch.randn(4, 8),)), "x (4, 8)")
    assert other.assignment == plan.assignment
    assert [s.flops for s in other.stages] == pytest.approx([s.flops / 2 for s in plan.stages])
    assert other.inputs["x"]["shape"] == [4, 8]
    assert plan.inputs["x"]["shape"] == [8, 8]  # the plan itself is untouched
    assert torch.allclose(other.as_module()(torch.ones(4, 8)), model(torch.ones(4, 8)))


def test_another_code_path_that_moves_weights_is_a_clear_error():
    model = Branchy()
    plan = _plan(model, torch.randn(8, 8))
    assert plan.stage_tensors([1]) & {"b.weight", "c.weight"}  # b or c runs on stage 1
    with pytest.raises(ShapeClassError, match=r"at input shapes x \(2, 8\).*other weights on stage.*Fix: keep"):
        respecialise(plan, trace(model, (torch.randn(2, 8),)), "x (2, 8)")


class Elided(nn.Module):
    """Adds a zero only to batches of more than one sample, as torch elides an expand at a batch of one: every later
    ``add`` of the trace at one sample is named one lower (``add_3`` there is ``add_4`` here)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            x = x + 0.0
        for layer in self.layers:
            x = layer(x) + 1.0
        return x


def test_an_op_elided_at_one_shape_renames_the_later_ones_and_the_stages_still_match():
    model = Elided()
    plan = _plan(model, torch.randn(4, 8))
    one = trace(model, (torch.randn(1, 8),))
    assert len(one.names) == len(plan.assignment) - 1
    by_name = {n: plan.assignment.get(n, 0) for n in one.names}  # matching by names puts layer k's add elsewhere
    assert any(by_name[n] != plan.assignment[m] for n, m in zip(one.names, plan.traced_graph().names[1:]))
    other = respecialise(plan, one, "x (1, 8)")
    for s in range(plan.num_stages):
        assert other.stage_tensors([s]) == plan.stage_tensors([s])
    assert torch.allclose(other.as_module()(torch.ones(1, 8)), model(torch.ones(1, 8)))
