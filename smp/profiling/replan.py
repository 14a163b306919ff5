"""Re-partitioning from what a profile measured: ``smp replan DIR`` and ``"auto_repartition"``.

The plan was cut with the cost model's per-op estimates; a profile measures what each stage's forward and
backward really cost per microbatch. :func:`fit_costs` turns those per-stage measurements into per-op
costs. Each stage has a ratio, measured / planned. An op *kind* (``aten.linear``, ``aten.sort``, ...) that
also runs on a stage with a lower ratio is taken at that lower ratio: a linear layer on a stage that met its
plan is believed to run as planned everywhere. What these ops leave of a stage's measurement is spread over
the stage's other ops, in proportion to their estimates. So a misjudged kind (a sort, a scatter, a
Python-heavy block that the roofline prices by its few FLOPs) takes the blame rather than the ops beside it,
and every stage's ops sum exactly to its measurement; with one kind per stage this is plain per-stage
scaling. Forward and backward are fitted apart.
The graph is then partitioned again with the fitted costs, and the schedule simulated under both plans
gives the predicted gain.

In flight (``"auto_repartition"``), the step owns the decision (:mod:`smp.engine.repartition`): rank 0 re-plans
with :func:`replan` from the gathered profile, every rank gets the plan, and :mod:`smp.engine.migrate` moves
parameters, gradients and optimizer state to their new stages. This module only computes.
"""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, replace

import numpy as np

from partitioner import DeviceRates, NodeCosts, OpGraph, PartitionOptions, PartitionPlan, estimate, partition
from pipeline.profile_description import GRAPH_FILE
from pipeline.step_model import plan_step
from smp.profiling.measurements import Measurements, ProfileError, load_profile

__all__ = ["Replan", "fit_costs", "replan", "replan_profile", "replan_to_file"]

@dataclass
class Replan:
    """A new plan from measurements, and the steps the step model (:mod:`pipeline.step_model`) predicts for the old
    and the new plan, both under the costs fitted to the measurements; ``measured_step_s``: the profile's median step;
    ``planned_step_s``: the old plan's own prediction, the report's."""

    plan: PartitionPlan
    old_step_s: float
    new_step_s: float
    measured_step_s: float
    planned_step_s: float

    @property
    def gain(self) -> float:
        """Predicted speed-up of a step: old / new."""
        return self.old_step_s / self.new_step_s if self.new_step_s > 0 else 1.0

    def summary(self, old: PartitionPlan) -> str:
        """Two lines: the predicted steps and gain, and where the stage boundaries moved."""
        moved = sum(old.assignment[n] != s for n, s in self.plan.assignment.items())
        stages = ", ".join(f"stage {s.index}: {s.nodes} ops {s.modules[0]} .. {s.modules[-1]}"
                           for s in self.plan.stages)
        return (f"the profiled plan predicted a {self.planned_step_s * 1e3:.2f} ms step and measured "
                f"{self.measured_step_s * 1e3:.2f} ms; with the stage costs measured, the step model predicts "
                f"{self.old_step_s * 1e3:.2f} ms for it and {self.new_step_s * 1e3:.2f} ms re-planned: "
                f"{self.gain:.2f}x; {moved} ops move\n{stages}")


def _fit(kinds: np.ndarray, estimated: np.ndarray, stage: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """Per-op seconds whose per-stage sums are ``measured`` (see the module docstring)."""
    k = len(measured)
    planned = np.bincount(stage, weights=estimated, minlength=k)
    ratio = np.divide(measured, planned, out=np.ones(k), where=planned > 0)
    # Each kind at the lowest measured/planned ratio of the stages that run it ...
    kind_ratio = np.full(int(kinds.max(initial=-1)) + 1, np.inf)
    busy = estimated > 0
    np.minimum.at(kind_ratio, kinds[busy], ratio[stage[busy]])
    op_ratio = np.where(busy, kind_ratio[kinds], 1.0)
    pinned = busy & (op_ratio < ratio[stage] * (1 - 1e-9))
    # ... and on each stage, what those pinned ops leave of the measurement is spread over its other ops.
    fixed = np.bincount(stage, weights=np.where(pinned, estimated * op_ratio, 0.0), minlength=k)
    free = np.bincount(stage, weights=np.where(pinned, 0.0, estimated), minlength=k)
    left = measured - fixed
    ok = (free > 0) & (left > 0)
    scale = np.divide(left, free, out=np.zeros(k), where=ok)
    fitted = np.where(pinned, estimated * op_ratio, estimated * scale[stage])
    return np.where(ok[stage], fitted, estimated * ratio[stage])  # else: the whole stage at its own ratio


def fit_costs(graph: OpGraph, costs: NodeCosts, stage: np.ndarray, forward_s: list[float],
              backward_s: list[float]) -> NodeCosts:
    """``costs`` refitted so that each stage's ops sum to its measured ``forward_s`` / ``backward_s`` per
    microbatch (``stage``: each op's stage in graph order)."""
    _, kinds = np.unique(np.asarray(graph.kinds), return_inverse=True)
    stage = np.asarray(stage, np.int64)
    return NodeCosts(forward_s=_fit(kinds, costs.forward_s, stage, np.asarray(forward_s, float)),
                     backward_s=_fit(kinds, costs.backward_s, stage, np.asarray(backward_s, float)),
                     needs_grad=costs.needs_grad, measured=True)


def replan(m: Measurements, graph: OpGraph) -> Replan:
    """Re-partition ``graph`` (the profiled run's) with op costs fitted to the measurements ``m``."""
    old = m.plan
    if set(graph.names) != set(old.assignment):
        raise ProfileError("the op graph does not belong to the profiled plan (another model's?): profile again")
    options = PartitionOptions.from_dict(old.options, rates=DeviceRates.from_dict(old.rates))
    stage = old.stage_of_ops(graph)
    estimated = estimate(graph, options.resolve_rates(), options.dtype)
    costs = fit_costs(graph, estimated, stage, m.stage_forward_s, m.stage_backward_s)
    new = replace(partition(graph, old.num_stages, options, costs=costs), inputs=old.inputs)  # the run's microbatch
    measured = statistics.median(p.step_s for p in m.phases.values()) if m.phases else 0.0
    # The old plan under the fitted costs has the measured stage times: the simulator's replay of them.
    return Replan(plan=new, old_step_s=m.replayed.step_s, new_step_s=plan_step(new, m.schedule, graph=graph).step_s,
                  measured_step_s=measured, planned_step_s=m.predicted.step_s)


def replan_profile(directory: str | os.PathLike[str]) -> tuple[Replan, Measurements]:
    """:func:`replan` for a profile directory (``smp replan DIR``)."""
    m = load_profile(directory)
    path = os.path.join(directory, GRAPH_FILE)
    if not os.path.exists(path):
        raise ProfileError(f"{os.fspath(directory)} has no {GRAPH_FILE}: it was profiled without its op graph, "
                           "which re-planning needs; profile again with this version")
    return replan(m, OpGraph.load(path)), m


def replan_to_file(directory: str | os.PathLike[str], out: str | os.PathLike[str]) -> str:
    """``smp replan DIR -o OUT``: re-plan the profile in ``directory`` and write the plan to ``out`` (the
    profiled plan itself when the new one is not predicted faster); returns what to tell the user."""
    result, m = replan_profile(directory)
    faster = result.gain > 1.0 and result.plan.assignment != m.plan.assignment
    (result.plan if faster else m.plan).to_json(os.fspath(out))
    verdict = (f"wrote the re-planned partition to {os.fspath(out)}" if faster else
               f"the re-planned partition is not predicted faster: wrote the profiled plan to {os.fspath(out)}")
    return (f"{result.summary(m.plan)}\n{verdict}; run with the smp config key \"partition_file\": "
            f"\"{os.fspath(out)}\" (or PipelineRunner.from_plan_file)")
