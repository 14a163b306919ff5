"""The user's model holds this rank's tensor-parallel shards: its parameters become the sharded graph's.

A tp rank's graph (:func:`partitioner.tp.shard_program.shard_graph`) holds new parameters, this rank's slices of the
sharded weights; so does an ep rank's (:func:`partitioner.ep.expert_program.expert_parallel_graph`), its experts'
rows of the stacked expert weights. The model's own ``nn.Parameter`` objects take their place:
:func:`smp.engine.materialize.swap_in` gives each the shard's data (an optimizer built over ``model.parameters()``
before partitioning steps the shards), and the graph is pointed back at them, so the whole weights are released and
``model.parameters()``, ``state_dict`` and checkpoints see exactly what this rank holds, under the model's own names
(as SMP v1's distributed modules do).
"""
from __future__ import annotations

import torch

from partitioner.capture.graph import OpGraph
from partitioner.capture.program import tensor_aliases
from partitioner.tp.sharding import Shard
from smp.engine.materialize import swap_in

__all__ = ["install_shards", "sharded_names", "shard_specs", "shard_owners", "expert_specs"]


def shard_specs(graph: OpGraph) -> dict[str, Shard]:
    """Every name (tied ones included) of the parameters that ``graph``'s tensor parallelism shards -> its
    :class:`~partitioner.tp.sharding.Shard` (dimension, whole length, blocks); empty without tensor parallelism."""
    prog = graph.fx
    if prog is None or prog.sharding is None:
        return {}
    alias = tensor_aliases(prog.module)
    wanted = {alias.get(t, t): s for t, s in prog.sharding.params.items()}
    return {path: wanted[canonical] for path, canonical in alias.items() if canonical in wanted}


def sharded_names(graph: OpGraph) -> set[str]:
    """Every name (tied ones included) of the parameters that ``graph``'s tensor parallelism shards."""
    return set(shard_specs(graph))


def expert_specs(graph: OpGraph) -> dict[str, tuple[int, int, int]]:
    """Every name of the stacked expert weights ``graph``'s expert parallelism shards -> the experts this rank holds
    ``(start, stop, whole)``; empty without expert parallelism."""
    experts = graph.fx.experts if graph.fx is not None else None
    return dict(experts.params) if experts is not None else {}


def install_shards(model: torch.nn.Module, graph: OpGraph) -> None:
    """Give ``model``'s sharded parameters (tensor and expert parallelism's) this rank's shards from ``graph`` and
    point ``graph`` at them."""
    prog = graph.fx
    names = sharded_names(graph) | set(expert_specs(graph))
    if prog is None or not names:
        return
    done: dict[int, torch.nn.Parameter] = {}
    for path in sorted(names):
        mine = model.get_parameter(path)
        shard = prog.module.get_parameter(path)
        if shard is mine:
            continue
        if id(mine) not in done:
            with torch.no_grad():
                swap_in(mine, shard.detach())
            done[id(mine)] = mine
        owner, _, leaf = path.rpartition(".")
        setattr(prog.module.get_submodule(owner), leaf, mine)


def shard_owners(graph: OpGraph, tp_rank: int) -> dict[str, int]:
    """Module path -> ``tp_rank`` for every module holding a sharded parameter of ``graph`` (initialised from a
    stream of this tp rank's own: :func:`smp.engine.materialize.materialize`)."""
    return {name.rpartition(".")[0]: tp_rank for name in sharded_names(graph)}
