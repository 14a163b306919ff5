"""The price of tensor parallelism: the seconds of every collective in a tp rank's graph, and the plan's record.

A graph written for one tp rank (:func:`partitioner.tp.shard_program.shard_graph`) already has its ops at their local
size, so FLOPs, activations and parameter bytes counted on it are per rank. What it adds is communication between
the ``tp`` ranks of a group, over the link within a node (``DeviceRates.link_*``: ``--link``, NVLink on a GPU
profile). Collectives are priced as NCCL's ring algorithms (Patarasuk and Yuan 2009, "Bandwidth optimal all-reduce
algorithms for clusters of workstations", JPDC 69(2); Thakur et al. 2005): an all-reduce of ``B`` bytes sends
``2 (tp - 1) / tp x B`` bytes per rank in ``2 (tp - 1)`` steps, an all-gather of an output of ``B`` bytes
``(tp - 1) / tp x B`` in ``tp - 1`` steps, each step paying the link's latency.

Forward, in the op that carries it (``OpGraph.fx.op_of``): Megatron's ``g`` after each row-parallel matmul
(``reduce_from``: all-reduce of the matmul's output), the vocabulary-parallel embedding (all-reduce of its
output), the vocabulary-parallel cross-entropy (three all-reduces of one number per token: the largest logit, the
sum of exponentials and the target's logit) and the gather of a sharded output (``gather_from``). Backward:
Megatron's ``f`` (``copy_to``) all-reduces the gradient of a whole value that sharded ops read, when that value has
a gradient. ``g``'s backward is the identity and a gather's keeps this rank's slice: both free. Bytes are counted
at the training precision (:mod:`partitioner.cost.precision`).

Under sequence parallelism (:mod:`partitioner.tp.sequence`) ``g`` and the embedding's sum are reduce-scatters forward
and all-gathers backward, ``f`` an all-gather forward and a reduce-scatter backward: a ring reduce-scatter moves what
an all-gather of the same whole tensor moves, so each pair costs an all-reduce's bytes (in twice the latency steps).
A whole value sliced along the sequence gathers its gradient backward, a sliced output is gathered forward; the
weights the sliced regions read whole sum their gradients once per step with the data-parallel average (small: norm
weights and biases; not priced here), or through ``f`` (an all-reduce backward, each microbatch) where they cannot.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..capture.flops import float_bytes, tensor_bytes
from ..capture.graph import OpGraph
from ..cost.collectives import all_gather_s, all_reduce_s
from ..cost.devices import DeviceRates
from ..cost.precision import at_precision
from .collectives import (
    copy_to,
    gather_from,
    reduce_from,
    scatter_to,
    seq_gather,
    seq_gather_whole,
    seq_reduce_scatter,
    seq_scatter,
    vocab_cross_entropy,
    vocab_embedding,
)

__all__ = ["Collective", "tp_degree", "collectives", "collective_seconds", "tensor_parallel_record",
           "degree_mismatch", "stage_comm_s"]


@dataclass(frozen=True)
class Collective:
    """One tp collective of a sharded graph: the fx node that issues it, the op it is priced in, ``kind``
    (``"all_reduce"``, ``"all_gather"`` or ``"reduce_scatter"``), ``count`` collectives of ``nbytes`` each (the whole
    tensor, at the training precision: an all-gather's gathered output, a reduce-scatter's input), in the op's forward
    or ``backward``."""

    node: str
    op: int
    kind: str
    nbytes: float
    count: int = 1
    backward: bool = False


def tp_degree(graph: OpGraph) -> int:
    """The tensor-parallel degree a graph was sharded for (1: not sharded)."""
    sharding = getattr(graph.fx, "sharding", None) if graph.fx is not None else None
    return int(sharding.tp) if sharding is not None else 1


def _bytes(val: Any, dtype: str, scale: float = 1.0) -> float:
    """Bytes of ``val`` times ``scale`` at the training precision ``dtype``."""
    total, floating = tensor_bytes(val) * scale, float_bytes(val) * scale
    return float(at_precision(np.array([total]), np.array([floating]), dtype)[0])


def collectives(graph: OpGraph, dtype: str = "fp32", needs_grad: np.ndarray | None = None) -> list[Collective]:
    """Every collective of a sharded graph (none for a graph not sharded), in graph order. ``needs_grad`` (per op,
    :func:`partitioner.cost.roofline.needs_grad`) leaves out the backward all-reduces of values without a gradient; None
    counts them all."""
    prog = graph.fx
    if prog is None or tp_degree(graph) == 1:
        return []
    found: list[Collective] = []
    for node in prog.module.graph.nodes:
        if node.op != "call_function" or node.name not in prog.op_of:
            continue
        op, fn, val = prog.op_of[node.name], node.target, node.meta.get("val")
        grad = needs_grad is None or bool(needs_grad[op])
        if fn in (seq_reduce_scatter, seq_gather, seq_scatter, seq_gather_whole) or \
                (fn is vocab_embedding and node.kwargs.get("tokens")):
            found += _sequence(node, op, dtype, grad, tp_degree(graph))
        elif fn is reduce_from or fn is vocab_embedding:
            found.append(Collective(node.name, op, "all_reduce", _bytes(val, dtype)))
        elif fn is copy_to and (needs_grad is None or bool(needs_grad[op])):
            found.append(Collective(node.name, op, "all_reduce", _bytes(val, dtype), backward=True))
        elif fn is scatter_to and (needs_grad is None or bool(needs_grad[op])):  # backward: the slices' gradients
            found.append(Collective(node.name, op, "all_gather", _bytes(node.args[0].meta.get("val"), dtype),
                                    backward=True))
        elif fn is gather_from:
            x, dim, size = node.args[0].meta.get("val"), node.args[1], node.args[2]
            local = x.shape[dim] if isinstance(x, torch.Tensor) else 0
            found.append(Collective(node.name, op, "all_gather", _bytes(x, dtype, size / local) if local else 0.0))
        elif fn is vocab_cross_entropy:
            logits = node.args[0].meta.get("val")  # per token: one number of the logits' dtype
            width = logits.shape[-1] if isinstance(logits, torch.Tensor) and logits.dim() else 0
            found.append(Collective(node.name, op, "all_reduce", _bytes(logits, dtype, 1 / width) if width else 0.0,
                                    count=3))
    return found


def _sequence(node: Any, op: int, dtype: str, grad: bool, tp: int) -> list[Collective]:
    """The collectives of one sequence-parallel op (see the module docstring), each of the whole tensor's bytes."""
    fn, val = node.target, node.meta.get("val")
    if fn is seq_gather or fn is seq_gather_whole:  # val: the whole sequence
        pair = [Collective(node.name, op, "all_gather", _bytes(val, dtype))]
        if fn is seq_gather and grad:
            pair.append(Collective(node.name, op, "reduce_scatter", _bytes(val, dtype), backward=True))
        return pair
    whole = _bytes(val, dtype, tp)  # val: this rank's slice
    if fn is seq_scatter:
        return [Collective(node.name, op, "all_gather", whole, backward=True)] if grad else []
    pair = [Collective(node.name, op, "reduce_scatter", whole)]  # g, or the embedding's sum
    return pair + ([Collective(node.name, op, "all_gather", whole, backward=True)] if grad else [])


def collective_seconds(graph: OpGraph, rates: DeviceRates, dtype: str = "fp32",
                       needs_grad: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per op, the forward and the backward seconds of its tp collectives (zeros for a graph not sharded)."""
    fwd, bwd = np.zeros(graph.num_nodes), np.zeros(graph.num_nodes)
    tp = tp_degree(graph)
    for c in collectives(graph, dtype, needs_grad):
        price = all_reduce_s if c.kind == "all_reduce" else all_gather_s  # a ring reduce-scatter: an all-gather's
        (bwd if c.backward else fwd)[c.op] += c.count * price(c.nbytes, tp, rates)
    return fwd, bwd


def tensor_parallel_record(graph: OpGraph, stage: np.ndarray, num_stages: int, tp_s: np.ndarray) -> dict[str, Any]:
    """What a plan records of tensor parallelism (empty for a graph not sharded): the ``degree``, per stage the
    seconds of tp collectives in one microbatch's forward and backward (``comm_s``, part of the stage's cost, from
    ``tp_s`` per op: :attr:`partitioner.cost.roofline.NodeCosts.tp_comm_s`) and the sharding
    (:meth:`partitioner.tp.sharding.Sharding.to_dict`)."""
    tp = tp_degree(graph)
    if tp == 1:
        return {}
    comm = np.bincount(stage, weights=np.asarray(tp_s, np.float64), minlength=num_stages)
    summary = {k: v for k, v in graph.fx.sharding.to_dict().items() if k != "tp"}
    return {"degree": tp, "comm_s": [float(x) for x in comm], "sharding": summary}


def degree_mismatch(plan_record: dict[str, Any], graph: OpGraph) -> str | None:
    """Why a plan with ``plan_record`` (its ``tensor_parallel``) cannot bind to ``graph``: the degrees differ;
    None when they agree."""
    planned, traced = int(plan_record.get("degree", 1)), tp_degree(graph)
    if planned == traced:
        return None
    if planned == 1:
        return (f"was made for a model without tensor parallelism but the graph is sharded for tensor-parallel degree "
                f"{traced}: bind it to the unsharded trace (partitioner.trace), or make the plan from this graph")
    what = f"sharded for tensor-parallel degree {traced}" if traced > 1 else "not sharded (tensor-parallel degree 1)"
    return (f"was made for tensor-parallel degree {planned} but the graph is {what}: shard the trace for degree "
            f"{planned} (partitioner.shard_graph of partitioner.find_sharding(..., {planned})), "
            "or make the plan from this graph")


def stage_comm_s(record: dict[str, Any], num_stages: int) -> Sequence[float]:
    """Per stage, the tp collectives' seconds per microbatch of a plan's ``tensor_parallel`` record (zeros)."""
    return list(record.get("comm_s") or [0.0] * num_stages)
