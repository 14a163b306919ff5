"""What a collective costs on a link: ring all-reduce and all-gather, and the data-parallel gradient average.

Collectives are priced as NCCL's ring algorithms (Patarasuk and Yuan 2009, "Bandwidth optimal all-reduce algorithms
for clusters of workstations", JPDC 69(2); Thakur et al. 2005): an all-reduce of ``B`` bytes over ``n`` ranks sends
``2 (n - 1) / n x B`` bytes per rank in ``2 (n - 1)`` steps, an all-gather of an output of ``B`` bytes
``(n - 1) / n x B`` in ``n - 1`` steps, each step paying the link's latency, and every collective the runtime's cost
of one (:attr:`partitioner.DeviceRates.collective_overhead_s`). Every parallel axis prices its collectives here:
tensor parallelism's (:mod:`partitioner.tp.pricing`), sharded data parallelism's (:mod:`partitioner.sdp`) and the
data-parallel average of the layout planner (:mod:`partitioner.layout.score`).
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from ..capture.flops import float_bytes, tensor_bytes
from ..capture.graph import OpGraph
from .devices import DeviceRates
from .precision import at_precision

__all__ = ["all_reduce_s", "all_gather_s", "gradient_all_reduce_s", "after_pipeline_s", "priced_calls", "bytes_at"]


def all_reduce_s(nbytes: float, tp: int, rates: DeviceRates) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``tp`` ranks on the intra-node link, and the runtime's cost
    of one collective (:attr:`partitioner.DeviceRates.collective_overhead_s`); 0 for tp 1."""
    if tp <= 1 or nbytes <= 0:
        return 0.0
    return (2.0 * (tp - 1) / tp * nbytes / rates.link_bytes_per_s + 2 * (tp - 1) * rates.link_latency_s
            + rates.collective_overhead_s)


def all_gather_s(nbytes: float, tp: int, rates: DeviceRates) -> float:
    """Seconds of a ring all-gather (or reduce-scatter) of an output of ``nbytes`` over ``tp`` ranks, and the
    runtime's cost of one collective; 0 for tp 1. Through gloo (``rates.collectives_on_host``) the price of an
    all-reduce of the output: between a rank's ops on a 2-core VM, gloo's all-gather and reduce-scatter of 8 MB took
    10.7 and 11.4 ms, its all-reduce of the same 8 MB 8.6 ms, where a ring all-gather would move half the bytes."""
    if tp <= 1 or nbytes <= 0:
        return 0.0
    if rates.collectives_on_host:
        return all_reduce_s(nbytes, tp, rates)
    return ((tp - 1) / tp * nbytes / rates.link_bytes_per_s + (tp - 1) * rates.link_latency_s
            + rates.collective_overhead_s)


def gradient_all_reduce_s(nbytes: float, replicas: int, rates: DeviceRates, link: DeviceRates) -> float:
    """Seconds of the runtime's data-parallel average of ``nbytes`` of gradients over ``replicas``
    (:mod:`smp.engine.execution`): copied into one new flat buffer (written at ``rates``' fresh-memory rate, as a new
    gradient is), all-reduced on ``link``, divided and copied back (five more passes over the bytes in memory); 0 for
    one replica. Two GPT-2 ranks of a 2-core VM spent 3.1 ms in the all-reduce of 3.5 MB and 3.3 ms around it."""
    if replicas <= 1 or nbytes <= 0:
        return 0.0
    return (all_reduce_s(nbytes, replicas, link) + nbytes / rates.grad_bytes_per_s
            + 5 * nbytes / (rates.bytes_per_s * rates.memory_efficiency))


def after_pipeline_s(rank_end_s: Sequence[float], after_s: Sequence[float]) -> float:
    """Seconds a step grows by when each pipeline rank, its last pass ending at ``rank_end_s[r]``, then spends
    ``after_s[r]`` on its gradient reduction: how far the latest such end lies past the latest pass; never below 0,
    and 0.0 exactly when nothing is reduced (a difference of sums would round to -0.0 or 1e-17)."""
    if not rank_end_s or not any(x > 0 for x in after_s):
        return 0.0
    return max(0.0, max(end + x for end, x in zip(rank_end_s, after_s)) - max(rank_end_s))


def priced_calls(graph: OpGraph, targets: Collection[Any], price: Callable[[Any], tuple[float, float]],
                 needs_grad: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per op of ``graph``, the forward and the backward seconds of its calls of ``targets`` (an axis's collective
    ops), ``price(node)`` each; the backward only where the op's runs (``needs_grad`` None: every one's)."""
    fwd, bwd = np.zeros(graph.num_nodes), np.zeros(graph.num_nodes)
    prog = graph.fx
    if prog is None:
        return fwd, bwd
    for node in prog.module.graph.nodes:
        if node.op == "call_function" and node.target in targets and node.name in prog.op_of:
            op = prog.op_of[node.name]
            f, b = price(node)
            fwd[op] += f
            bwd[op] += b if needs_grad is None or bool(needs_grad[op]) else 0.0
    return fwd, bwd


def bytes_at(value: Any, dtype: str) -> float:
    """Bytes of a traced ``value`` at the training precision ``dtype`` (:mod:`partitioner.cost.precision`)."""
    return float(at_precision(np.array([tensor_bytes(value)]), np.array([float_bytes(value)]), dtype)[0])
