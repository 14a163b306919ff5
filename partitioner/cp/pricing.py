"""The price of context parallelism: the gathers of a cp rank's program and its loss's all-reduces.

Each attention gathers the group's keys and values (:func:`partitioner.cp.comm.cp_gather`): a ring all-gather of the
whole sequence's bytes forward, and the reduce-scatter of their gradients backward, which moves as much
(:func:`partitioner.cost.collectives.all_gather_s`); so does every other gather (an output, an op that mixes
positions). The loss over the group's tokens all-reduces two scalars (latency only). Bytes are the whole values'
at the training precision (:mod:`partitioner.cost.precision`), on the link the group's ranks share.
"""
from __future__ import annotations

import numpy as np

from ..capture.flops import float_bytes, tensor_bytes
from ..capture.graph import OpGraph
from ..cost.collectives import all_gather_s, all_reduce_s
from ..cost.devices import DeviceRates
from ..cost.precision import at_precision
from .comm import cp_cross_entropy, cp_gather, cp_group_loss

__all__ = ["context_seconds"]


def context_seconds(graph: OpGraph, rates: DeviceRates, dtype: str = "fp32",
                    needs_grad: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per op, the forward and the backward seconds of its context-parallel collectives (zeros for other ops)."""
    fwd, bwd = np.zeros(graph.num_nodes), np.zeros(graph.num_nodes)
    prog = graph.fx
    if prog is None or prog.cp_comm is None:
        return fwd, bwd
    cp = prog.cp_comm.size
    for node in prog.module.graph.nodes:
        if node.op != "call_function" or node.name not in prog.op_of:
            continue
        op = prog.op_of[node.name]
        grad = needs_grad is None or bool(needs_grad[op])
        if node.target is cp_gather:
            whole = node.meta.get("val")
            nbytes = float(at_precision(np.array([tensor_bytes(whole)]), np.array([float_bytes(whole)]), dtype)[0])
            fwd[op] += all_gather_s(nbytes, cp, rates)
            bwd[op] += all_gather_s(nbytes, cp, rates) if grad else 0.0
        elif node.target is cp_cross_entropy or node.target is cp_group_loss:
            fwd[op] += 2 * all_reduce_s(4.0, cp, rates)
            bwd[op] += all_reduce_s(4.0, cp, rates) if grad else 0.0
    return fwd, bwd
