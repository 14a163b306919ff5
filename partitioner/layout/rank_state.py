"""What one pipeline rank of a layout holds of its stages, and what its optimizer step sweeps.

A pipeline rank holds the stages ``s`` with ``s % pp == r`` (:class:`partitioner.cut.memory.StageMemory` each, with
the schedule's microbatches in flight). ZeRO-1 (Rajbhandari et al. SC'20) divides the optimizer state, and the step
that updates it, by dp; activation checkpointing ("full") keeps what a stage received per microbatch in flight, plus
one microbatch's activations while it recomputes. Sharded data parallelism's ranks are priced by
:func:`partitioner.sdp.shards.sharded_dp` instead.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..cut.memory import StageMemory
from .layout import Layout

__all__ = ["rank_memory", "rank_update"]


def rank_memory(layout: Layout, mine: Sequence[StageMemory], received: Sequence[int]) -> tuple[float, float]:
    """(parameter state, activations at the peak) of a pipeline rank holding stages ``mine``, which received
    ``received`` bytes per microbatch each."""
    state = sum(s.weights_bytes + s.gradient_bytes + s.master_bytes for s in mine) + rank_update(layout, mine)[0]
    if layout.checkpointing == "full":
        acts = sum(s.in_flight * r for s, r in zip(mine, received)) + max(s.activation_bytes_per_microbatch
                                                                          for s in mine)
    else:
        acts = sum(s.activation_bytes for s in mine)
    return float(state), float(acts)


def rank_update(layout: Layout, mine: Sequence[StageMemory]) -> tuple[float, float]:
    """(optimizer state, fp32 master weights) that the optimizer step of a pipeline rank holding ``mine`` sweeps
    (:func:`partitioner.cost.optimizer_step.optimizer_step_s`)."""
    share = layout.dp if layout.zero1 else 1
    return (sum(s.optimizer_bytes for s in mine) / share, sum(s.master_bytes for s in mine) / share)
