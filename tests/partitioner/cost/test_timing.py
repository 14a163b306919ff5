"""Timing ops and stages for real (partitioner.cost.timing): the weight gradients each timed backward writes are added
into kept ones, as a step's microbatches after the first add theirs."""
from __future__ import annotations

import torch
from torch import nn

import partitioner
from partitioner.capture.stage_modules import split
from partitioner.cost.timing import measure_stages


def _watch(model: nn.Module) -> list[bool]:
    """Records, for every gradient a backward produces for ``model``'s parameters, whether one was kept already."""
    kept: list[bool] = []
    for p in model.parameters():
        p.register_hook(lambda grad, p=p: kept.append(p.grad is not None))
    return kept


def test_timed_backwards_add_into_kept_gradients_and_leave_the_callers_alone() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    x = torch.randn(8, 64)
    g = partitioner.trace(model, (x,))
    kept = _watch(model)
    partitioner.measure(g, (x,), repeats=3)
    # The warm-up pass writes each of the 4 gradients fresh; the 3 timed passes add into them (the time of a step's
    # every microbatch after the first): timed fresh, a 4-layer MLP stage's backward was 6.4 ms, run 10 ms.
    assert kept == [False] * 4 + [True] * 12
    assert all(p.grad is None for p in model.parameters())

    kept.clear()
    measure_stages(split(g, partitioner.partition(g, 2).assignment, 2), (x,), repeats=2)
    assert kept.count(False) == 4 and kept.count(True) == 8
    assert all(p.grad is None for p in model.parameters())
