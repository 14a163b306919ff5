"""Per-stage memory accounting: the bytes the rank that runs a stage holds at its peak, by kind.

The rank holds its stage's parameters -- weights, gradients, optimizer state and, under mixed precision, fp32
master weights, as ZeRO accounts them (:func:`partitioner.cost.precision.param_memory_parts`; Rajbhandari et al.
2020, section 3.1) -- and the activations one microbatch leaves on the stage for backward, times the
microbatches in flight at once. That count is the schedule's: a simulated or real schedule's peak
(:func:`pipeline.schedule.peak_in_flight`), or the closed form :func:`partitioner.cost.roofline.in_flight` (GPipe: m,
1F1B: p - s). With the closed form the total is the plan's ``memory_bytes``: the same terms, broken down.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..capture.graph import OpGraph
from ..cost.precision import activation_bytes, param_memory_parts
from ..cost.roofline import in_flight as closed_form_in_flight
from .objective import stage_params
from .plan import PartitionPlan

__all__ = ["StageMemory", "stage_memory"]


@dataclass(frozen=True)
class StageMemory:
    """What one stage's rank holds, in bytes at the training precision: parameters by kind, and the
    activations of ``in_flight`` microbatches of ``activation_bytes_per_microbatch`` each."""

    stage: int
    weights_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    master_bytes: int
    activation_bytes_per_microbatch: int
    in_flight: int

    @property
    def activation_bytes(self) -> int:
        """Activations held at the peak: per microbatch x microbatches in flight."""
        return self.activation_bytes_per_microbatch * self.in_flight

    @property
    def parameter_state_bytes(self) -> int:
        """Weights, gradients, optimizer state and master weights: what does not depend on the schedule."""
        return self.weights_bytes + self.gradient_bytes + self.optimizer_bytes + self.master_bytes

    @property
    def total_bytes(self) -> int:
        """Everything the rank holds at its peak."""
        return self.parameter_state_bytes + self.activation_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with the derived totals."""
        return {**asdict(self), "activation_bytes": self.activation_bytes, "total_bytes": self.total_bytes}


def stage_memory(plan: PartitionPlan, graph: OpGraph, in_flight: Sequence[int] | None = None) -> list[StageMemory]:
    """Per stage of ``plan`` (made from ``graph``), the bytes its rank holds, at the plan's dtype and for its
    optimizer; ``in_flight`` gives each stage's peak microbatches in flight (default: the closed form for the
    plan's pipeline and microbatches)."""
    k, opts = plan.num_stages, plan.options
    dtype, optimizer = opts.get("dtype", "fp32"), opts.get("optimizer", "adam")
    if in_flight is None:
        in_flight = [closed_form_in_flight(s, k, opts.get("microbatches", 1), opts.get("pipeline", "1f1b"))
                     for s in range(k)]
    if len(in_flight) != k:
        raise ValueError(f"in_flight has {len(in_flight)} entries for {k} stages")
    stage = plan.stage_of_ops(graph)
    p_stage, p_idx = stage_params(graph, stage, k)
    parts = {kind: np.bincount(p_stage, weights=per_param[p_idx], minlength=k)
             for kind, per_param in param_memory_parts(graph, dtype, optimizer).items()}
    acts = np.bincount(stage, weights=activation_bytes(graph, dtype), minlength=k)

    def b(x: float) -> int:
        return int(round(float(x)))

    return [StageMemory(stage=s, weights_bytes=b(parts["weights"][s]), gradient_bytes=b(parts["gradients"][s]),
                        optimizer_bytes=b(parts["optimizer"][s]), master_bytes=b(parts["master"][s]),
                        activation_bytes_per_microbatch=b(acts[s]), in_flight=int(in_flight[s]))
            for s in range(k)]
