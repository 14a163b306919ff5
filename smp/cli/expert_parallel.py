"""``--ep E`` of ``smp inspect`` and ``smp simulate``: plan the graph that one expert-parallel rank runs, and say what
expert parallelism holds per rank and what its all-to-alls cost.

The graph is ep rank 0's (:func:`partitioner.ep.expert_program.expert_parallel_graph`): every mixture-of-experts layer
found on the traced graph holds ``experts / E`` of its experts, so a plan of it counts the expert weights, their
gradients and optimizer state per rank, and its stage costs include each layer's all-to-alls on the link within a
node (:mod:`partitioner.ep.pricing`). Layers the pattern does not match stay whole, with a warning saying why; a
model with none, or a degree that does not divide a layer's experts, is refused. ``--ep 1`` changes nothing.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from partitioner.units import format_bytes, format_seconds
from smp.cli.target import rank_target

__all__ = ["expert_target", "ep_lines"]


def expert_target(graph: Any, ep: int, progress: Callable[[str], None] = lambda m: None) -> Any:
    """The graph ep rank 0 of ``ep`` runs (``graph`` for 1), what cannot be split refused in the command line's
    terms."""
    from partitioner.ep.expert_program import expert_parallel_graph

    return rank_target(graph, ep, "--ep", f"splitting the experts for expert parallelism of degree {ep}",
                       expert_parallel_graph, progress)


def ep_lines(graph: Any, whole_weights: float, local_weights: float, rates: Any, dtype: str, microbatches: int,
             step_s: float | None = None) -> list[str]:
    """What expert parallelism does to a plan of ``graph`` (ep rank 0's): the layers split, the weights (in
    ``dtype``) a rank holds next to the model's, and the all-to-alls' seconds at ``rates``
    (:class:`partitioner.DeviceRates`) per microbatch and per step."""
    experts = graph.fx.experts if graph.fx is not None else None
    if experts is None:
        return []
    from partitioner.ep.pricing import all_to_all_seconds

    found, first = experts.found, experts.found.layers[0]
    share = local_weights / whole_weights if whole_weights else 1.0
    fwd, bwd = all_to_all_seconds(graph, rates, dtype)
    per_mb = float(np.sum(fwd) + np.sum(bwd))
    of_step = f", {100 * microbatches * per_mb / step_s:.1f}% of the predicted step" if step_s else ""
    return [f"expert parallelism: degree {experts.ep}, {len(found.layers)} mixture-of-experts layer(s) split "
            f"({first.experts} experts, top-{first.top_k}, {first.experts // experts.ep} per rank), "
            f"{len(found.skipped)} left whole; every number above is per rank (ep rank 0)",
            f"  weights per ep rank {format_bytes(local_weights)} of the model's {format_bytes(whole_weights)} in "
            f"{dtype} ({share:.3f}); the experts' gradients and optimizer state scale with them",
            *(f"  left whole: {name}: {why}" for name, why in sorted(found.skipped.items())),
            f"  all-to-alls (rows to their experts and back, forward and backward; inside the stages' fwd/bwd ms): "
            f"{format_seconds(per_mb)} per microbatch, {format_seconds(microbatches * per_mb)} per step{of_step}"]
