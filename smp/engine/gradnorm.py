"""The norm of the whole model's gradient when its parameters are spread over ranks.

Gradient clipping by global norm (Pascanu et al. 2013, "On the difficulty of training recurrent neural
networks", arXiv:1211.5063) and LAMB's clipping need the norm of *every* gradient of the model, but each
rank holds only the gradients of its pipeline stages (and, with ``shard_optimizer_state``, an optimizer
holds only its shard of them). Data-parallel replicas hold identical copies, and a parameter replicated on
two stages (tied embeddings) holds its summed gradient on both.

So every rank writes the norm of each gradient it holds into a vector indexed by the parameter's position in
the model, zero elsewhere, and one all-reduce with MAX over the world fills in every entry: copies agree,
and a rank that does not hold a parameter contributes 0, below any norm (with one stage and DDP's averaging every
rank holds every entry already, and the all-reduce is skipped). The total is then combined as one
device would, from per-tensor norms (``clip_grad_norm_``'s order). Gradients of parameters outside the
DistributedModel are added locally. A gradient in parts on several ranks (a tensor-parallel shard, a DTensor
sharded over sharded-data-parallel replicas, :mod:`smp.engine.sharded_dp`, or both) has its norm put together from
its parts' ``norm ** p`` (MAX for the inf-norm) first: one all-reduce on the sharding group, one on the tp group.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from smp.runtime.state import State

__all__ = ["global_grad_norm", "clip_grad_norm_"]


def _model_index(st: State | None) -> dict[int, int]:
    """Parameter (by id) -> its position in the DistributedModel (the same on every rank); {} without one."""
    if st is None or st.model is None:
        return {}
    return {id(p): i for i, (_, p) in enumerate(st.model.module.named_parameters())}


def _tp_sharded(st: State | None) -> set[int]:
    """Ids of the parameters that are tensor-parallel shards (each tp rank holds another part of them)."""
    if st is None or st.model is None or st.topology.tp == 1 or not st.model.partitioned:
        return set()
    names = set(st.model.tensor_parallel_layout().shards)
    return {id(p) for n, p in st.model.module.named_parameters() if n in names}


def _replicas_only(st: State) -> bool:
    """Does every rank hold the whole model's parameters but its sdp shards, with the same averaged gradients (one
    stage, no tensor or expert parallelism, DDP's averaging)? Then each rank's per-parameter norms are the world's."""
    return st.topology.pp == 1 and st.topology.tp == 1 and st.config.expert_parallel_degree == 1 and st.config.ddp


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
    inf = math.isinf(norm_type)
    # A sharded gradient's part here, as norm ** p (the inf-norm: as is): summed (MAX) over the ranks holding the
    # other parts, first over its sdp sharding group, then over its tp group.
    sdp_parts = torch.zeros(len(index), dtype=torch.float32, device=device)
    tp_parts = torch.zeros(len(index), dtype=torch.float32, device=device)
    tp_split, sdp_group = _tp_sharded(st), None
    for (key, g), norm in zip(grads.items(), _norms([_local(g) for g in grads.values()], norm_type, device)):
        if key not in index:
            local.append(norm)
        elif isinstance(g, DTensor) or key in tp_split:
            parts = sdp_parts if isinstance(g, DTensor) else tp_parts
            parts[index[key]] = norm if inf else norm ** norm_type
            if isinstance(g, DTensor):
                sdp_group = g.device_mesh.get_group(g.device_mesh.ndim - 1)
        else:
            per_param[index[key]] = norm
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    if sdp_group is not None:  # every replica of a stage holds the same sharded parameters: all take part
        dist.all_reduce(sdp_parts, op=op, group=sdp_group)
    if tp_split:
        for key in tp_split & set(grads):
            if isinstance(grads[key], DTensor):
                tp_parts[index[key]] = sdp_parts[index[key]]
        dist.all_reduce(tp_parts, op=op, group=st.group("tensor-parallel") if st is not None else None)
    whole = torch.maximum(sdp_parts, tp_parts)  # the sum over every part of each sharded gradient
    per_param = torch.maximum(per_param, whole if inf else whole ** (1.0 / norm_type))
    if index and st is not None and st.topology.world > 1 and not _replicas_only(st):
        dist.all_reduce(per_param, op=dist.ReduceOp.MAX, group=st.group("world"))
    every = torch.cat([per_param, torch.stack(local)]) if local else per_param
    if every.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=device)
    if math.isinf(norm_type):
        return every.max()
    return torch.linalg.vector_norm(every, norm_type)


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    st: State | None = None) -> torch.Tensor:
    """Scale the gradients of ``params`` so that their global norm (:func:`global_grad_norm`) is at most
    ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does on one device; return the norm before clipping."""
    params = [p for p in params if p.grad is not None]
    total = global_grad_norm(params, norm_type, st)
    if math.isinf(max_norm):  # nothing to clip (a factor of 1 everywhere): only the norm was wanted
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [_local(p.grad) for p in params if p.grad is not None]  # a shard scales in place, as a whole one
    for (device, dtype), group in _by_device_and_dtype(grads).items():
        torch._foreach_mul_([grads[i] for i in group], coef.to(device, dtype))
    return total


def _local(grad: torch.Tensor) -> torch.Tensor:
    """``grad``'s values on this rank, detached: a DTensor's local shard, or the tensor."""
    return (grad.to_local() if isinstance(grad, DTensor) else grad).detach()


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Indices of ``tensors`` grouped by device and dtype: one foreach call per group, as ``clip_grad_norm_`` makes."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups


def _norms(tensors: list[torch.Tensor], norm_type: float, device: torch.device) -> list[torch.Tensor]:
    """Each tensor's ``norm_type``-norm, float32 on ``device``: one ``torch._foreach_norm`` per device and dtype."""
    out: list[torch.Tensor] = [torch.zeros(())] * len(tensors)
    for group in _by_device_and_dtype(tensors).values():
        for i, norm in zip(group, torch._foreach_norm([tensors[i] for i in group], norm_type, dtype=torch.float32)):
            out[i] = norm.to(device)
    return out
