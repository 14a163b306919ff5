"""The price of context parallelism: the gathers of a cp rank's program and its loss's all-reduces.

Each attention gathers the group's keys and values (:func:`partitioner.cp.comm.cp_gather`): a ring all-gather of the
whole sequence's bytes forward, and the reduce-scatter of their gradients backward, which moves as much
(:func:`partitioner.cost.collectives.all_gather_s`); so does every other gather (an output, an op that mixes
positions). The loss over the group's tokens all-reduces two scalars (latency only). Bytes are the whole values'
at the training precision (:mod:`partitioner.cost.precision`), on the link the group's ranks share.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..capture.graph import OpGraph
from ..cost.collectives import all_gather_s, all_reduce_s, bytes_at, priced_calls
from ..cost.devices import DeviceRates
from .comm import cp_cross_entropy, cp_gather, cp_group_loss

__all__ = ["context_seconds"]


def context_seconds(graph: OpGraph, rates: DeviceRates, dtype: str = "fp32",
                    needs_grad: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per op, the forward and the backward seconds of its context-parallel collectives (zeros for other ops)."""
    comm = graph.fx.cp_comm if graph.fx is not None else None
    cp = comm.size if comm is not None else 1

    def price(node: Any) -> tuple[float, float]:
        if node.target is cp_gather:  # the whole value's bytes, gathered forward and reduce-scattered backward
            one = all_gather_s(bytes_at(node.meta.get("val"), dtype), cp, rates)
            return one, one
        one = all_reduce_s(4.0, cp, rates)  # the loss: two scalars forward, the sum's gradient backward
        return 2 * one, one

    return priced_calls(graph, {cp_gather, cp_cross_entropy, cp_group_loss} if comm is not None else (), price,
                        needs_grad)
