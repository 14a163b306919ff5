"""``"auto_repartition"``: between two steps, move a running model to a plan fitted to what it measured.

The config's ``auto_repartition`` profiles the first steps (:mod:`smp.profiling.session` records them); once
that window is complete the step (:func:`smp.engine.execution.run_step`) calls :func:`repartition_in_flight`
before running: every rank hands its part of the profile to rank 0, rank 0 re-plans with the measured stage
costs (:func:`smp.profiling.replan.replan`, which only computes), and when the predicted gain is at least
``min_gain`` every rank moves to the new plan (:func:`smp.engine.migrate.migrate`). Re-planning is an
optimisation: when it fails, training goes on with the plan it has.
"""
from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist

from partitioner import PartitionPlan
from pipeline.profile_description import merge, run_description
from pipeline.profiler import Profiler
from smp.engine.migrate import migrate
from smp.engine.pipeline_model import PipelineModel
from smp.profiling.measurements import measure
from smp.profiling.replan import replan
from smp.runtime.config import AutoRepartition
from smp.runtime.state import State

__all__ = ["repartition_in_flight"]


def repartition_in_flight(st: State, model: PipelineModel, profiler: Profiler,
                          options: AutoRepartition) -> PartitionPlan | None:
    """Between two steps on every rank (a collective): gather the profile of the last ``after_steps`` steps,
    re-plan on rank 0, and when the predicted gain is at least ``min_gain`` move every rank to the new plan.
    Returns the new plan, or None if kept."""
    runner = model.runner
    assert runner is not None  # a profiled step ran: the model is partitioned
    parts = profiler.gather()
    graph = runner.plan.graph
    box: list[Any] = [None]
    if parts is not None:
        try:
            info = run_description(runner)
            info.pop("graph")
            result = replan(measure(*merge(parts), info), graph)
        except Exception as exc:  # re-planning is an optimisation: training goes on with the plan it has
            print(f"smp: auto_repartition could not re-plan ({type(exc).__name__}: {exc}); keeping the plan",
                  file=sys.stderr, flush=True)
        else:
            move = result.gain >= 1.0 + options.min_gain and result.plan.assignment != runner.plan.assignment
            verdict = "re-partitioning" if move else f"keeping the plan (gain below min_gain={options.min_gain:g})"
            print(f"smp: auto_repartition after {options.after_steps} profiled steps: "
                  f"{result.summary(runner.plan)}\nsmp: {verdict}", file=sys.stderr, flush=True)
            box = [result.plan.to_json() if move else None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        return None
    plan = PartitionPlan.from_json(box[0]).bind(graph, "the re-planned partition")
    migrate(st, model, plan)
    return plan
