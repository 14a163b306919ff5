"""Sharded data parallelism: each stage's parameters sharded over the stage's replicas (SMP v1's
``sharded_data_parallel_degree``).

SMP v1.11 shards parameters, gradients and optimizer state inside a sharding group of ``sdp`` data-parallel replicas
and replicates across groups (MiCS: Zhang et al. 2022, "MiCS: Near-linear Scaling for Training Gigantic Model on
Public Cloud", arXiv:2205.00119; ZeRO stage 3 inside each group). Here every pipeline stage's replicas shard that
stage (torchtitan does so with FSDP2 under pipelines), over the DeviceMesh ``smp.init`` made
(:meth:`smp.runtime.topology.Topology.sdp_grid`: replica rows x sharding group). A parameter becomes a DTensor,
``Shard(0)`` over the group (``Replicate`` across rows), and the stages gather it where they read it
(:mod:`pipeline.param_gather`). Left whole, as SMP leaves them: parameters with fewer than
``sdp_param_persistence_threshold`` elements, and parameters that two stages share (tied embeddings on the first and
last stage: the pipeline sums their gradients whole). Whole parameters are averaged over the replicas as under
plain data parallelism.

Delayed initialisation becomes sharded initialisation: the rank's tensors are made real one module at a time, and
each module's parameters are sharded before the next module is made, so a rank never holds more than its shards
plus one module's whole parameters (:func:`shard_own_share`). The parameter objects change (a DTensor cannot take
a plain tensor's place in the same object, ``torch.utils.swap_tensors`` refuses): the module's attributes and the
optimizer's parameter groups are pointed at the new ones, so an optimizer built over ``model.parameters()`` before
the first step steps the shards.
"""
from __future__ import annotations

from typing import Any, Collection

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from pipeline.param_gather import shard_of
from smp.engine.materialize import materialize, release

__all__ = ["to_shard", "shard_own_share", "shard_parameter"]


def to_shard(module: torch.nn.Module, local: Collection[str], shared: Collection[str], threshold: float) -> set[str]:
    """The names of the parameters this rank shards: of its ``local`` tensors, the parameters with at least
    ``threshold`` elements that no other stage reads (``shared``: the plan's shared parameters), every alias of each."""
    out: set[str] = set()
    for names in _aliases(module).values():
        p = module.get_parameter(names[0])
        if any(n in local for n in names) and not any(n in shared for n in names) and p.numel() >= max(threshold, 1):
            out.update(names)
    return out


def _aliases(module: torch.nn.Module) -> dict[int, list[str]]:
    """id of each parameter of ``module`` -> every name it has (tied weights have several)."""
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    return aliases


def shard_parameter(module: torch.nn.Module, names: list[str], mesh: Any,
                    also: Collection[torch.nn.Module] = ()) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    """Replace the parameter called ``names`` (its aliases) in ``module`` by its DTensor shard over ``mesh``
    (``Shard(0)`` on the mesh's last dimension, ``Replicate`` on the others), cut from this rank's whole value with no
    communication (every replica holds the same value), and in each module of ``also`` that holds the same parameter
    under one of those names (the traced program the stages are cut from); returns (old, new)."""
    old = module.get_parameter(names[0])
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    with torch.no_grad():
        new = torch.nn.Parameter(shard_of(old, mesh, placements), requires_grad=old.requires_grad)
    for m in (module, *also):
        for name in names:
            owner, _, attr = name.rpartition(".")
            holder = _submodule(m, owner)
            if holder is not None and getattr(holder, attr, None) is old:
                setattr(holder, attr, new)
    return old, new


def _submodule(module: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def shard_own_share(module: torch.nn.Module, names: Collection[str], sharded: Collection[str], mesh: Any,
                    device: torch.device | str, initialise: bool = True, tp_ranks: dict[str, int] | None = None,
                    optimizer: torch.optim.Optimizer | None = None,
                    also: Collection[torch.nn.Module] = ()) -> dict[int, torch.nn.Parameter]:
    """Make this rank's tensors ``names`` real and shard those in ``sharded`` over ``mesh``, one owning module at a
    time (see the module docstring; ``initialise`` and ``tp_ranks``, its ``shard_of``, as for
    :func:`smp.engine.materialize.materialize`), release every other tensor, and point ``optimizer``'s parameter
    groups and the modules ``also`` (:func:`shard_parameter`) at the shards. Returns id(old parameter) -> its shard."""
    aliases = _aliases(module)  # ids stay: materialize swaps data into the same parameter objects
    by_owner: dict[str, list[str]] = {}
    for name in sorted(names):
        by_owner.setdefault(name.rpartition(".")[0], []).append(name)
    replaced: dict[int, torch.nn.Parameter] = {}
    for group in by_owner.values():
        materialize(module, group, device, initialise, tp_ranks)
        for name in group:
            p = module.get_parameter(name) if name in sharded else None
            if p is not None and not isinstance(p, DTensor):  # an alias of one sharded already is that shard
                old, new = shard_parameter(module, aliases[id(p)], mesh, also)
                replaced[id(old)] = new
    release(module, keep=names)
    if optimizer is not None:
        for g in optimizer.param_groups:
            g["params"] = [replaced.get(id(p), p) for p in g["params"]]
    return replaced
