"""One plan for every input shape: a plan re-bound, by op names, to a trace of the model at other input shapes.

Stages are cut from a trace, and a trace is specialised to its inputs' shapes (sizes are constants in the exported
graph: views, masks, position ids). A batch with another sequence length or a smaller last batch is another
*shape class*; it runs the same plan on stages cut from a trace of that class (:func:`partitioner.trace` on one
microbatch of it, fake tensors, no memory). Traces of one model at two shapes of the same code path hold the same
ops in the same order, and the plan's stages carry over op for op. Where the code path differs a little with the
shapes (a microbatch of one sample, where torch elides an ``expand`` and a ``contiguous``), the ops are matched by
structure, not by name: torch.export names a node after its op and how many of that op came before it, so one
elided ``expand`` renames every later one, and ``expand_4`` of one trace is another op than ``expand_4`` of the
other. :func:`respecialise` aligns the two traces' op sequences (each op by its kind and the parameters it reads;
the longest matching runs, as ``difflib`` compares lines), gives each matched op its counterpart's stage, places an
op without one on the latest stage of its producers (stage 0 when it has none) and drops ops the new trace lacks.
It then checks what makes the result runnable by the ranks that hold the plan's weights:

* acyclic: no value flows from a later stage to an earlier one (invariant 1);
* the same weights per stage: each stage reads exactly the parameters and buffers it reads under the plan, so
  every rank already holds what its stages need and tied weights stay replicated on the same stages.

Any other difference (data-dependent control flow that takes another branch at these shapes) is a
:class:`ShapeClassError` naming the ops, with the fix. The per-stage FLOPs of the result are this class's (the
throughput figures of :mod:`partitioner.cost.throughput` then count the work of the shapes that ran).
"""
from __future__ import annotations

from dataclasses import replace
from difflib import SequenceMatcher

import numpy as np

from ..capture.chunk import split_columns
from ..capture.graph import OpGraph
from ..capture.plan_inputs import input_record
from .plan import PartitionPlan, PlanMismatchError

__all__ = ["ShapeClassError", "respecialise"]


class ShapeClassError(PlanMismatchError):
    """A trace at new input shapes cannot run the plan's stages; the message names the ops and the fix."""


def _fix(shapes: str) -> str:
    return (f"Fix: keep the inputs at shapes that take the same code path as the plan's ({shapes}), make the "
            "model's control flow independent of the input shapes, or partition the model again for these shapes")


def respecialise(plan: PartitionPlan, graph: OpGraph, shapes: str = "") -> PartitionPlan:
    """``plan`` (bound to a trace of its model) re-bound to ``graph``, a trace of the same model at other input
    shapes (``shapes`` describes them in errors): the same stages, op for op matched by structure, checked as the
    module docstring says, with this class's per-stage FLOPs and input record. Raises :class:`ShapeClassError`."""
    home = plan.traced_graph()
    if graph.fx is None:
        raise ValueError("respecialise needs a traced graph (partitioner.trace), not a synthetic one")
    if plan.split_ops and not graph.fx.split_ops:
        graph = split_columns(graph, plan.split_ops)
    stage, matched = _matched_stages(plan, home, graph)
    added = [graph.names[i] for i in np.flatnonzero(stage < 0).tolist()]
    gone = [n for n, m in zip(home.names, matched) if not m]
    for i in np.flatnonzero(stage < 0).tolist():  # ops without a counterpart, in topological order
        producers = graph.src[graph.dst == i]
        stage[i] = int(stage[producers].max()) if len(producers) else 0
    where = f"at input shapes {shapes}" if shapes else "at these input shapes"
    if graph.num_edges and (back := stage[graph.src] > stage[graph.dst]).any():
        e = int(np.argmax(back))
        raise ShapeClassError(
            f"the model traces {where} to ops the plan cannot cut the same way: {graph.names[graph.src[e]]} (stage "
            f"{stage[graph.src[e]]}) feeds {graph.names[graph.dst[e]]} (stage {stage[graph.dst[e]]}), ops new at these "
            f"shapes: {added[:5]}. {_fix(_plan_shapes(plan))}")
    k = plan.num_stages
    flops = np.bincount(stage, weights=graph.flops, minlength=k)
    out = replace(plan, assignment=dict(zip(graph.names, stage.tolist())), graph=graph, inputs=input_record(graph),
                  stages=[replace(s, flops=float(flops[s.index])) for s in plan.stages])
    for s in range(k):
        want, got = plan.stage_tensors([s], home), out.stage_tensors([s], graph)
        if want != got:
            moved = sorted(want ^ got)
            raise ShapeClassError(
                f"the model traces {where} to ops that put other weights on stage {s} than the plan does "
                f"({len(moved)} differ, first: {moved[:3]}; ops new at these shapes: {added[:5]}, ops gone: "
                f"{gone[:5]}). {_fix(_plan_shapes(plan))}")
    return out


def _signatures(graph: OpGraph) -> list[tuple[str, tuple[str, ...]]]:
    """Each op of ``graph`` as structure names it: its kind and the parameters and buffers it reads."""
    reads: list[list[str]] = [[] for _ in range(graph.num_nodes)]
    for node, param in zip(graph.use_node.tolist(), graph.use_param.tolist()):
        reads[node].append(graph.param_names[param])
    return [(kind, tuple(sorted(r))) for kind, r in zip(graph.kinds, reads)]


def _matched_stages(plan: PartitionPlan, home: OpGraph, graph: OpGraph) -> tuple[np.ndarray, np.ndarray]:
    """Per op of ``graph``, the plan's stage of its counterpart in ``home`` (-1 without one), and per op of ``home``
    whether it has a counterpart: the two op sequences aligned by :func:`_signatures` (the module docstring)."""
    home_stage = np.array([plan.assignment[n] for n in home.names], np.int64)
    a, b = _signatures(home), _signatures(graph)
    if a == b:  # the same code path: op for op
        return home_stage, np.ones(home.num_nodes, bool)
    stage = np.full(graph.num_nodes, -1, np.int64)
    matched = np.zeros(home.num_nodes, bool)
    for block in SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
        stage[block.b:block.b + block.size] = home_stage[block.a:block.a + block.size]
        matched[block.a:block.a + block.size] = True
    return stage, matched


def _plan_shapes(plan: PartitionPlan) -> str:
    """The plan's traced input shapes, for messages."""
    return ", ".join(f"{n} {tuple(e['shape'])}" for n, e in plan.inputs.items()) or "its example inputs"
