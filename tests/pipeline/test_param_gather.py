"""Sharded parameters gathered where a graph reads them (pipeline.param_gather), on two spawned ranks: the same
outputs and gradients as the whole module, nothing whole once the forward is done, the weights a backward needs
gathered again there, and the gradients reduced into shards once."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from smp.testing import run_ranks


class TwoLayers(torch.nn.Module):
    """Parameters read by ``get_attr`` in a traced graph, as the stages read them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 6)
        self.b = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(F.linear(x, self.a.weight, self.a.bias)), self.b.weight, self.b.bias)


def _gather(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from pipeline.param_gather import GatheredParams, shard_of

    torch.manual_seed(0)
    model = TwoLayers()
    x = torch.randn(5, 4, requires_grad=True)
    y_ref = model(x)
    (y_ref ** 2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    x_grad = x.grad.clone()
    x = x.detach().requires_grad_(True)
    mesh = init_device_mesh("cpu", (world,))
    for mod in (model.a, model.b):
        for name in ("weight", "bias"):
            setattr(mod, name, torch.nn.Parameter(shard_of(getattr(mod, name), mesh, [Shard(0)])))
    gm = torch.fx.symbolic_trace(model)
    gathered = GatheredParams(record=True)
    inserted = gathered.insert(gm)
    with gathered.saving():
        y = gm(x)
    whole_after_forward = gathered.live_bytes
    (y ** 2).sum().backward()
    gathered.reduce_gradients(gm.parameters())
    grad_err = max(float((p.grad.full_tensor() - grads[n]).abs().max()) for n, p in gm.named_parameters())
    return {"rank": rank, "inserted": inserted, "out": torch.equal(y, y_ref), "x_grad": torch.allclose(x.grad, x_grad),
            "grad_err": grad_err, "whole_after_forward": whole_after_forward,
            "again": [e.name for e in gathered.trace if e.backward],
            "peak": max(e.live_bytes for e in gathered.trace),
            "local_grad": tuple(gm.b.weight.grad.to_local().shape)}


def test_gathered_where_read_and_gathered_again_for_the_backward():
    for r in run_ranks(_gather, 2, timeout=120):
        assert r["inserted"] == 4 and r["out"] and r["x_grad"], r
        assert r["grad_err"] < 1e-6, r
        assert r["whole_after_forward"] == 0, r  # nothing saved for the backward holds a whole weight
        # The backward needs both weights (for the input's gradient), gathered again, each once; never the biases.
        assert sorted(r["again"]) == ["a.weight", "b.weight"], r
        assert r["peak"] <= (24 + 6 + 18 + 3) * 4, r
        assert r["local_grad"] == ((2, 6) if r["rank"] == 0 else (1, 6)), r  # a shard, as the parameter
