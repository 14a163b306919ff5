"""In-place updates are dependencies (partitioner/capture/mutation.py): every plan and every cut of the op order keeps
a mutation, the value it changes and the readers that must see it before or after on the right stages."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import partitioner
from partitioner import METHODS
from partitioner.capture.stage_modules import split
from tests.conftest import assert_same_step, pipeline_step, train_step


class SliceUpdate(nn.Module):
    """``y[:, :4] += h[:, 4:]`` on a clone (``add_`` on a slice plus a ``copy_`` write-back with no users),
    a reader of ``y`` before the update and several after it, far enough apart for a plan to cut between."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        y = h.clone()
        before = y * 3.0                  # must see y before the update
        y[:, :4] += h[:, 4:]
        z = torch.tanh(self.b(h))
        z = torch.tanh(self.c(z))
        return self.d(y * z) + before     # must see y after it


class RunningMean(nn.Module):
    """A buffer updated through chained in-place ops (``mul_`` then ``add_``), read later in the same step."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        self.ema.mul_(0.9).add_(0.1 * h.mean(0).detach())
        z = torch.tanh(self.b(h))
        return self.c(z) + self.ema


def _loss(out, target):
    return ((out - target) ** 2).mean()


@pytest.mark.parametrize("cls", [SliceUpdate, RunningMean])
def test_every_cut_of_the_op_order_runs_exactly(cls):
    torch.manual_seed(0)
    model = cls()
    x, target = torch.randn(4, 8), torch.randn(4, 8)
    g = partitioner.trace(model, (x,))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    want = train_step(model, model, (x,), {}, _loss, target)
    for k in (2, 3):
        for first in range(1, g.num_nodes - k + 1):
            cuts = [first] + list(range(first + 1, first + k - 1))
            stage = np.searchsorted([0] + cuts, np.arange(g.num_nodes), side="right") - 1
            model.load_state_dict(state)
            got = pipeline_step(model, split(g, dict(zip(g.names, stage.tolist())), k), (x,), {}, _loss, target)
            assert_same_step(got, want)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cls", [SliceUpdate, RunningMean])
def test_plans_of_every_method_run_exactly(cls, method):
    torch.manual_seed(0)
    model = cls()
    x, target = torch.randn(4, 8), torch.randn(4, 8)
    g = partitioner.trace(model, (x,))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    want = train_step(model, model, (x,), {}, _loss, target)
    ops = sum(kind != "output" for kind in g.kinds)
    for k in range(2, min(ops, 6) + 1):
        plan = partitioner.partition(g, k, method=method, memory_weight=0.0, rates=partitioner.DeviceRates())
        model.load_state_dict(state)
        assert_same_step(pipeline_step(model, split(g, plan.assignment, k), (x,), {}, _loss, target), want)


def test_a_mutation_its_value_and_earlier_readers_are_one_op():
    torch.manual_seed(0)
    g = partitioner.trace(SliceUpdate(), (torch.randn(4, 8),))
    group = next(m for m in g.members if "add_" in m)
    assert {"clone", "add_", "copy_", "mul"} <= set(group), group  # mul: the reader before the update
    assert not any("mul_1" in m for m in g.members if m is group)  # the reader after the update stays free
    g = partitioner.trace(RunningMean(), (torch.randn(4, 8),))
    group = next(m for m in g.members if "mul_" in m)
    assert "add_" in group, group
