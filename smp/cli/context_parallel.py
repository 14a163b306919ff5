"""``--cp C`` of ``smp inspect`` and ``smp simulate``: plan the graph that one context-parallel rank runs, and say what
context parallelism holds per rank and what its gathers cost.

The graph is cp rank 0's (:func:`partitioner.cp.context_program.context_parallel_graph`): every op that works token by
token runs on the rank's ``1 / C`` of each sequence, so a plan of it counts the activations, and the compute, of
those tokens; each attention reads the group's keys and values, gathered, and its stage costs include those gathers
on the link within a node (:mod:`partitioner.cp.pricing`). Ops that mix positions otherwise read the whole sequence,
named in a line each; a model without an embedding of its input ids, or a sequence that does not split over ``C``,
is refused. ``--cp 1`` changes nothing.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from partitioner.units import format_bytes, format_seconds
from smp.cli.target import rank_target

__all__ = ["context_target", "cp_lines"]


def context_target(graph: Any, cp: int, progress: Callable[[str], None] = lambda m: None) -> Any:
    """The graph cp rank 0 of ``cp`` runs (``graph`` for 1), what cannot be split refused in the command line's
    terms."""
    from partitioner.cp.context_program import context_parallel_graph

    return rank_target(graph, cp, "--cp", f"splitting the sequence for context parallelism of degree {cp}",
                       context_parallel_graph, progress)


def cp_lines(graph: Any, whole: Any, rates: Any, dtype: str, microbatches: int, step_s: float | None = None
             ) -> list[str]:
    """What context parallelism does to a plan of ``graph`` (cp rank 0's of the traced ``whole``): the tokens and
    activations a rank holds next to one process's, and the gathers' seconds at ``rates``
    (:class:`partitioner.DeviceRates`) per microbatch and per step."""
    context = graph.fx.context if graph.fx is not None else None
    if context is None:
        return []
    from partitioner.cost.precision import at_precision
    from partitioner.cp.pricing import context_seconds

    fwd, bwd = context_seconds(graph, rates, dtype)
    per_mb = float(np.sum(fwd) + np.sum(bwd))
    mine, theirs = (float(np.sum(at_precision(g.act_bytes, g.act_float_bytes, dtype))) for g in (graph, whole))
    of_step = f", {100 * microbatches * per_mb / step_s:.1f}% of the predicted step" if step_s else ""
    return [f"context parallelism: degree {context.cp}, {context.sequence // context.cp} of each sequence's "
            f"{context.sequence} tokens per rank (chunks balanced for causal attention), {context.attentions} "
            "attention(s) reading the group's keys and values; every number above is per rank (cp rank 0)",
            f"  activations kept for backward per microbatch {format_bytes(mine)} of one process's "
            f"{format_bytes(theirs)} in {dtype} ({mine / theirs:.3f}); the weights are whole on every rank"
            if theirs else "  no activations kept for backward",
            *(f"  reads the whole sequence: {note}" for note in context.notes),
            f"  gathers (keys and values forward, their gradients reduce-scattered backward; inside the stages' "
            f"fwd/bwd ms): {format_seconds(per_mb)} per microbatch, {format_seconds(microbatches * per_mb)} per "
            f"step{of_step}"]
