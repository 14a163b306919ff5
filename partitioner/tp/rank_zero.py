"""tp rank 0's graph: what a plan of one tensor-parallel rank is made from, and whether a degree leaves every rank a
slice of every sharded weight.

The traced graph is sharded with Megatron's pattern (:func:`partitioner.tp.sharding.find_sharding`) and written for tp
rank 0 (:func:`partitioner.tp.shard_program.shard_graph`): its ops, parameters and activations have their local sizes,
so a plan of it counts memory per rank. Rank 0 holds the largest shard where a size does not divide
(``torch.chunk``'s layout), so its numbers are its group's worst. A degree above a sharded weight's slices along its
split dimension would leave some ranks none of it (:func:`thin_params`).
"""
from __future__ import annotations

import warnings

from ..capture.graph import OpGraph
from .shard_program import shard_graph
from .sharding import Sharding, find_sharding

__all__ = ["rank_zero_graph", "thin_params"]


def rank_zero_graph(graph: OpGraph, tp: int, sequence: bool = False) -> tuple[OpGraph, Sharding]:
    """``(the graph tp rank 0 of tp runs, its Sharding)`` of a traced ``graph`` (``sequence``: with sequence
    parallelism, :mod:`partitioner.tp.sequence`; its notes are warned); raises what
    :func:`~partitioner.tp.sharding.find_sharding` and :func:`~partitioner.tp.shard_program.shard_graph` raise on a
    model they cannot shard (``ValueError``, ``TypeError``, ``RuntimeError``)."""
    if graph.fx is None:
        raise ValueError("tensor parallelism needs a traced graph (partitioner.trace), not a synthetic one")
    with warnings.catch_warnings():  # torch's deprecation notices while copying the graph
        warnings.simplefilter("ignore", FutureWarning)
        sharding = find_sharding(graph.fx.module, tp)
        local = shard_graph(graph, sharding, 0, sequence)
        return local, local.fx.sharding or sharding


def thin_params(sharding: Sharding) -> list[tuple[int, str]]:
    """``(slices, name)`` of each parameter ``sharding`` splits into fewer slices along its split dimension than
    its degree has ranks (some rank would hold none of it), fewest first."""
    return sorted((s.size // s.groups, name) for name, s in sharding.params.items() if s.size // s.groups < sharding.tp)
