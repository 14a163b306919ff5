"""The price of context parallelism: the gathers of a cp rank's program and its loss's all-reduces.

Each attention gathers the group's keys and values (:func:`partitioner.cp.comm.cp_gather`): a ring all-gather of the
whole sequence's bytes forward, and the reduce-scatter of their gradients backward, which moves as much
(:func:`partitioner.cost.collectives.all_gather_s`); so does every other gather (an output, an op that mixes
positions). The loss over the group's tokens all-reduces two scalars (latency only). Bytes are the whole values'
at the training precision (:mod:`partitioner.cost.precision`), on the link the group's ranks share.
"""
from __future__ import annotations

import numpy as np

from ..capture.graph import OpGraph
from ..cost.collectives import all_gather_s, all_reduce_s, bytes_at, calls_of
from ..cost.devices import DeviceRates
from .comm import cp_cross_entropy, cp_gather, cp_group_loss

__all__ = ["context_seconds"]


def context_seconds(graph: OpGraph, rates: DeviceRates, dtype: str = "fp32",
                    needs_grad: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per op, the forward and the backward seconds of its context-parallel collectives (zeros for other ops)."""
    fwd, bwd = np.zeros(graph.num_nodes), np.zeros(graph.num_nodes)
    if graph.fx is None or graph.fx.cp_comm is None:
        return fwd, bwd
    cp = graph.fx.cp_comm.size
    for op, node, grad in calls_of(graph, {cp_gather, cp_cross_entropy, cp_group_loss}, needs_grad):
        if node.target is cp_gather:  # the whole value's bytes, gathered forward and reduce-scattered backward
            one = all_gather_s(bytes_at(node.meta.get("val"), dtype), cp, rates)
        else:  # the loss: two scalars all-reduced forward, the sum's gradient backward
            one = all_reduce_s(4.0, cp, rates)
            fwd[op] += one
        fwd[op] += one
        bwd[op] += one if grad else 0.0
    return fwd, bwd
