"""The norm of the whole model's gradient when its parameters are spread over ranks.

Gradient clipping by global norm (Pascanu et al. 2013, "On the difficulty of training recurrent neural
networks", arXiv:1211.5063) and LAMB's clipping need the norm of *every* gradient of the model, but each
rank holds only the gradients of its pipeline stages (and, with ``shard_optimizer_state``, an optimizer
holds only its shard of them). Data-parallel replicas hold identical copies, and a parameter replicated on
two stages (tied embeddings) holds its summed gradient on both.

So every rank writes the norm of each gradient it holds into a vector indexed by the parameter's position in
the model, zero elsewhere, and one all-reduce with MAX over the world fills in every entry: copies agree,
and a rank that does not hold a parameter contributes 0, below any norm. The total is then combined as one
device would, from per-tensor norms (``clip_grad_norm_``'s order). Gradients of parameters outside the
DistributedModel are added locally.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist

from smp.runtime.state import State

__all__ = ["global_grad_norm", "clip_grad_norm_"]


def _model_index(st: State | None) -> dict[int, int]:
    """Parameter (by id) -> its position in the DistributedModel (the same on every rank); {} without one."""
    if st is None or st.model is None:
        return {}
    return {id(p): i for i, (_, p) in enumerate(st.model.module.named_parameters())}


def global_grad_norm(params: Iterable[torch.Tensor], norm_type: float = 2.0, st: State | None = None) -> torch.Tensor:
    """The ``norm_type``-norm of the gradients of ``params`` taken together over every rank of the model
    ``st`` describes (collective: every rank calls it), as a float32 scalar on this rank's device. Without
    ``st`` (smp not initialised) the norm is this process's alone."""
    norm_type = float(norm_type)
    grads = {id(p): p.grad for p in params if p.grad is not None}
    index = _model_index(st)
    device = st.device if st is not None else torch.device("cpu")
    per_param = torch.zeros(len(index), dtype=torch.float32, device=device)
    local: list[torch.Tensor] = []
    for key, g in grads.items():
        norm = torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32).to(device)
        if key in index:
            per_param[index[key]] = norm
        else:
            local.append(norm)
    if index and st is not None and st.topology.world > 1:
        dist.all_reduce(per_param, op=dist.ReduceOp.MAX, group=st.group("world"))
    norms = torch.cat([per_param, torch.stack(local)]) if local else per_param
    if norms.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=device)
    if math.isinf(norm_type):
        return norms.max()
    return torch.linalg.vector_norm(norms, norm_type)


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    st: State | None = None) -> torch.Tensor:
    """Scale the gradients of ``params`` so that their global norm (:func:`global_grad_norm`) is at most
    ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does on one device; return the norm before clipping."""
    params = [p for p in params if p.grad is not None]
    total = global_grad_norm(params, norm_type, st)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        grad = p.grad
        assert grad is not None  # kept above
        grad.detach().mul_(coef.to(grad.device, grad.dtype))
    return total
