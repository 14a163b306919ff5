"""The cost model: seconds and bytes per op, per stage.

Compute is a roofline with a launch floor: an op's forward takes
``max(flops / (flop_rate * compute_efficiency), moved_bytes / (bytes_per_s * memory_efficiency))
+ op_overhead`` seconds (Williams et al. 2009, "Roofline: an insightful visual performance model", CACM
52(4)) under a :class:`DeviceRates`, where matmul-class ops (matmuls, convolutions, attention) run at the
tensor-core rate of the training dtype and every other op at the fp32 vector rate, and bytes are counted
at the training precision (:mod:`partitioner.cost.precision`): on a GPU a GEMM is cheap next to the
memory-bound elementwise ops around it. Backward is
2x forward (two matmuls per forward matmul: the input gradient and the weight gradient) for ops that need
a gradient, 1x for ops none of whose inputs needs one (the first layer: only its weight gradient), and 0
for ops that need none (frozen teachers, index math); on top of that, every trainable parameter an op
uses costs its bytes (of a view of it, the viewed bytes) written at ``grad_bytes_per_s``: the weight
gradient is a new tensor every step (``zero_grad(set_to_none=True)``), and on CPU writing fresh pages is
page-fault bound -- for a conv net, whose late layers hold most of the weights and few of the FLOPs,
this is most of the backward time.
:func:`partitioner.cost.timing.measure` replaces the estimate by timing each op's forward and backward for real.

Memory per stage: parameters (+ gradients + optimizer state for trainable ones, by optimizer kind and
precision, :func:`partitioner.cost.precision.param_memory`) and the activations each op keeps for backward
times the microbatches in flight on that stage (:func:`in_flight`).

A graph sharded for tensor parallelism (:mod:`partitioner.tp.shard_program`) is priced at its local shapes, plus its
collectives over the link within a node (:mod:`partitioner.tp.pricing`, which the sharded program names in its
``collective_pricing``): they are part of the forward and backward seconds of the ops that carry them, and kept apart
in :attr:`NodeCosts.tp_forward_s` / ``tp_backward_s``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..capture.flops import VIEW_OPS, is_matmul_class
from ..capture.graph import OpGraph
from .calibration import calibrate
from .devices import DeviceRates
from .pipelines import pipeline_of
from .precision import at_precision, weight_bytes

__all__ = ["NodeCosts", "estimate", "needs_grad", "view_ops", "in_flight"]



@dataclass
class NodeCosts:
    """Per-op costs: forward and backward seconds, and whether the op has a backward at all (``measured``
    when they were timed rather than estimated). ``tp_forward_s`` / ``tp_backward_s``: the part of those seconds
    spent in tensor-parallel collectives (:mod:`partitioner.tp.pricing`; None: the graph is not sharded)."""

    forward_s: np.ndarray
    backward_s: np.ndarray
    needs_grad: np.ndarray
    measured: bool = False
    tp_forward_s: np.ndarray | None = None
    tp_backward_s: np.ndarray | None = None

    @property
    def total_s(self) -> np.ndarray:
        """Forward plus backward seconds per op."""
        return self.forward_s + self.backward_s

    @property
    def tp_comm_s(self) -> np.ndarray:
        """Seconds of tensor-parallel collectives per op, forward plus backward (zeros without them)."""
        if self.tp_forward_s is None or self.tp_backward_s is None:
            return np.zeros_like(np.asarray(self.forward_s, np.float64))
        return self.tp_forward_s + self.tp_backward_s


def needs_grad(graph: OpGraph) -> np.ndarray:
    """An op has a backward when it reads a trainable parameter or a value that has one (index order is
    topological, so one sweep in order settles it)."""
    needs = np.zeros(graph.num_nodes, bool)
    if len(graph.use_node):
        needs[graph.use_node[graph.param_trainable[graph.use_param]]] = True
    if graph.num_edges:
        order = np.argsort(graph.dst, kind="stable")
        src, dst = graph.src[order], graph.dst[order]
        # Propagate along edges in order of destination; src < dst so a source is final when read.
        for s, d in zip(src.tolist(), dst.tolist()):
            if needs[s]:
                needs[d] = True
    return needs


def view_ops(graph: OpGraph) -> np.ndarray:
    """Per op, whether it is a free view (:data:`partitioner.capture.flops.VIEW_OPS`)."""
    return np.fromiter((k.rpartition(".")[2] in VIEW_OPS for k in graph.kinds), bool, count=graph.num_nodes)


def _matmul_class(graph: OpGraph) -> np.ndarray:
    """Per op, whether it runs at the tensor-core rate (:func:`partitioner.capture.flops.is_matmul_class`)."""
    return np.fromiter((is_matmul_class(k.rpartition(".")[2]) for k in graph.kinds), bool, count=graph.num_nodes)


def estimate(graph: OpGraph, rates: DeviceRates | None = None, dtype: str = "fp32") -> NodeCosts:
    """Analytic costs of every op under ``rates`` (this machine's :func:`calibrate` if None), trained in
    ``dtype`` (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``)."""
    rates = rates or calibrate()
    flop_rate = np.where(_matmul_class(graph), rates.matmul_flops_per_s(dtype), rates.flops_per_s)
    moved = at_precision(graph.move_bytes, graph.move_float_bytes, dtype)
    compute = np.maximum(graph.flops / (flop_rate * rates.compute_efficiency),
                         moved / (rates.bytes_per_s * rates.memory_efficiency))
    # The output op does work only when a loss was priced on it (partitioner.trace(loss_fn=...)).
    is_op = np.array([k != "output" for k in graph.kinds], bool) | (graph.flops > 0) | (graph.move_bytes > 0)
    fwd = np.where(is_op, compute + rates.op_overhead_s, 0.0)
    all_needs = needs_grad(graph)
    needs = all_needs & is_op
    # Input gradients only where some input carries one; weight gradients are written to fresh memory.
    input_grad = np.zeros(graph.num_nodes, bool)
    input_grad[graph.dst[all_needs[graph.src]]] = True
    grad_bytes = np.zeros(graph.num_nodes)
    if len(graph.use_node):
        trainable = graph.param_trainable[graph.use_param]
        node, param = graph.use_node[trainable], graph.use_param[trainable]
        # A view of a parameter (a slice: partitioner.capture.chunk's column chunks) writes only its share of the
        # gradient.
        viewed = np.minimum(1.0, graph.out_bytes[node] / np.maximum(graph.param_bytes[param], 1))
        share = np.where(view_ops(graph)[node], viewed, 1.0)
        np.add.at(grad_bytes, node, weight_bytes(graph, dtype)[param] * share)
    factor = np.where(input_grad, 2.0, 1.0)
    grad_s = grad_bytes / (rates.grad_bytes_per_s * rates.memory_efficiency)
    bwd = np.where(needs, factor * compute + grad_s + rates.op_overhead_s, 0.0)
    pricing = graph.fx.collective_pricing if graph.fx is not None else ()
    if not pricing:
        return NodeCosts(forward_s=fwd, backward_s=bwd, needs_grad=needs)
    priced = [price(graph, rates, dtype, all_needs) for price in pricing]
    tp_fwd, tp_bwd = sum(f for f, _ in priced), sum(b for _, b in priced)
    return NodeCosts(forward_s=fwd + tp_fwd, backward_s=bwd + tp_bwd, needs_grad=needs, tp_forward_s=tp_fwd,
                     tp_backward_s=tp_bwd)


def in_flight(stage: int, num_stages: int, microbatches: int, pipeline: str) -> int:
    """Microbatches whose activations a stage holds at once: GPipe keeps all m; 1F1B keeps p - s."""
    if pipeline_of(pipeline) == "gpipe":
        return microbatches
    return max(1, min(microbatches, num_stages - stage))
