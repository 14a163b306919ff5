"""``DistributedModel.get_module`` and ``register_post_step_hook`` as SMP v1 scripts use them (the HF
Trainer loads optimizer state from a post-step hook, since the state exists only after partitioning)."""
from __future__ import annotations

import torch
import torch.nn as nn

from smp.testing import run_ranks


def _hooks(rank: int, world: int):
    import smp

    smp.init({"pipeline_parallel_degree": 1})
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    model.register_post_step_hook(lambda m, o: calls.append(("first", m.partitioned, o is opt, len(o.state))))
    cancelled = model.register_post_step_hook(lambda m, o: calls.append(("cancelled",)))
    cancelled.remove()

    @smp.step
    def train_step(model, x):
        loss = model(x).sum()
        model.backward(loss)
        return loss

    for _ in range(2):
        train_step(model, torch.randn(2, 4))
        opt.step()
    late = model.register_post_step_hook(lambda m, o: calls.append(("late", m.partitioned)))
    return {"calls": calls, "late_handle": late, "module_is_net": model.get_module() is net}


def test_post_step_hooks_run_once_after_the_partitioning_step():
    (r,) = run_ranks(_hooks, 1, timeout=120)
    # after the first step, once, with the DistributedOptimizer (whose state does not exist yet: no opt.step)
    assert r["calls"] == [("first", True, True, 0), ("late", True)], r
    assert r["late_handle"] is None and r["module_is_net"], r
