"""Stage modules follow ``train()`` / ``eval()`` like the model they were cut from, whatever mode it was traced in."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import partitioner
from partitioner.capture.stage_modules import MetaTensorError


class _ModeDependent(nn.Module):
    """Every op whose behaviour depends on the module mode, with and without running statistics."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn1 = nn.BatchNorm1d(8)
        self.bn2 = nn.BatchNorm2d(2)
        self.inorm = nn.InstanceNorm2d(2, track_running_stats=True)
        self.inorm_batch = nn.InstanceNorm2d(2)                     # batch statistics in both modes
        self.bn_batch = nn.BatchNorm2d(2, track_running_stats=False)
        self.drop2d = nn.Dropout2d(0.3)
        self.alpha = nn.AlphaDropout(0.2)
        self.rrelu = nn.RReLU()

    def forward(self, x):
        y = F.dropout(self.bn1(self.lin(x)), 0.5, self.training).view(4, 2, 2, 2)
        y = self.bn_batch(self.inorm(self.bn2(y)))
        return self.rrelu(self.alpha(self.drop2d(self.inorm_batch(y))))


@pytest.mark.parametrize("traced_in", ["train", "eval"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_stages_follow_train_and_eval(traced_in, k):
    torch.manual_seed(0)
    model = _ModeDependent().train(traced_in == "train")
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    staged = partitioner.partition(partitioner.trace(model, (x,)), k).as_module()
    assert staged.training == model.training  # stages start in the traced mode
    for mode in (False, True, False, True):
        staged.train(mode)
        reference.train(mode)
        torch.manual_seed(1)  # one process, same op order: dropout draws the same masks
        got = staged(x)
        torch.manual_seed(1)
        want = reference(x)
        assert torch.equal(got, want), (mode, float((got - want).abs().max()))
    stats = {n: v for n, v in model.state_dict().items() if "running" in n}
    assert stats and all(torch.equal(v, reference.state_dict()[n]) for n, v in stats.items())
    if traced_in == "train":  # BatchNorm counts batches in training only
        assert int(model.bn1.num_batches_tracked) == int(reference.bn1.num_batches_tracked) == 2


def test_eval_mode_is_deterministic_after_training_trace():
    torch.manual_seed(0)
    model = _ModeDependent().train()
    staged = partitioner.partition(partitioner.trace(model, (torch.randn(4, 8),)), 2).as_module().eval()
    x = torch.randn(4, 8)
    assert torch.equal(staged(x), staged(x))


def test_a_meta_model_plans_but_refuses_to_run_or_be_timed():
    """Planning without weights is how a model larger than this machine is inspected; running or timing it is
    an error that says so (not meta outputs, not timings of meta kernels)."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(4, 16)
    graph = partitioner.trace(model, (x,))
    plan = partitioner.partition(graph, 2, rates=partitioner.DeviceRates())
    with pytest.raises(MetaTensorError, match=r"cannot run the staged model: 0.weight, 0.bias, 2.weight"):
        plan.as_module()
    with pytest.raises(MetaTensorError, match="cannot time the ops"):
        partitioner.partition(graph, 2, measure=True, example_inputs=(x,))
    with pytest.raises(MetaTensorError, match="cannot time the stages"):
        partitioner.measure_stages(partitioner.split(graph, plan.assignment, 2), (x,), {})
