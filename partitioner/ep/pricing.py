"""The price of expert parallelism: the all-to-alls of every expert layer of an ep rank's program.

Each expert layer (:func:`partitioner.ep.dispatch.expert_parallel`) moves its routed rows twice forward (to the
experts' ranks, and the results home) and their gradients twice backward, plus one exchange of per-expert counts
(a few bytes: latency only). Under balanced routing a rank keeps ``1 / ep`` of its rows and sends the rest, the
pattern of a pairwise all-to-all, which moves what a ring all-gather of the same output moves: ``(ep - 1) / ep x B``
per rank in ``ep - 1`` steps (:func:`partitioner.cost.collectives.all_gather_s`), on the link an ep group's ranks
share. Bytes are the traced rows' at the training precision (:mod:`partitioner.cost.precision`).
"""
from __future__ import annotations

import numpy as np

from ..capture.flops import float_bytes, tensor_bytes
from ..capture.graph import OpGraph
from ..cost.collectives import all_gather_s
from ..cost.devices import DeviceRates
from ..cost.precision import at_precision
from .dispatch import expert_parallel

__all__ = ["all_to_all_seconds"]


def all_to_all_seconds(graph: OpGraph, rates: DeviceRates, dtype: str = "fp32",
                       needs_grad: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per op, the forward and the backward seconds of its expert all-to-alls (zeros for other ops)."""
    fwd, bwd = np.zeros(graph.num_nodes), np.zeros(graph.num_nodes)
    prog = graph.fx
    if prog is None or prog.ep_comm is None:
        return fwd, bwd
    ep = prog.ep_comm.size
    for node in prog.module.graph.nodes:
        if node.op != "call_function" or node.target is not expert_parallel or node.name not in prog.op_of:
            continue
        op, rows = prog.op_of[node.name], node.args[2].meta.get("val")
        nbytes = float(at_precision(np.array([tensor_bytes(rows)]), np.array([float_bytes(rows)]), dtype)[0])
        one = all_gather_s(nbytes, ep, rates)
        fwd[op] += 2 * one + all_gather_s(8.0 * ep, ep, rates)
        if needs_grad is None or bool(needs_grad[op]):
            bwd[op] += 2 * one
    return fwd, bwd
