"""The step model: one training step of our runtime, predicted from its stages' op seconds.

Every step time the engine prints (``smp demo``, ``inspect``, ``simulate``, ``plan``, the profile's report and
``smp replan``) comes from :func:`predict_step`, so one plan gets one prediction. A step is its schedule replayed
by the simulator (:func:`pipeline.simulate.simulate`) with

* each pass (one stage's forward, or backward, of one microbatch) taking the seconds of its ops (the cost model's
  roofline, or on this machine's CPU the ops timed for real: :func:`partitioner.measure`) plus what the runtime pays
  per pass that no op accounts for, :attr:`partitioner.DeviceRates.pass_overhead_s`: the executor's bookkeeping,
  posting the pass's sends and receives, and the hand-offs between an ``@smp.step`` function's microbatch thread and
  the executor (on a CPU each is a thread wake-up on a core another rank shares);
* each message between stages its bytes over the link plus the link's latency
  (:meth:`partitioner.DeviceRates.comm_s`), as a delay of the dependency it carries;
* each step :attr:`partitioner.DeviceRates.step_overhead_s` more: sharing the step's arguments from pp_rank 0,
  starting the microbatch threads, and broadcasting the step's results from the last stage.

The overheads are measured for the ``cpu`` profile (:mod:`partitioner.cost.calibration`) and checked against real runs
of the zoo models by ``benchmarks/step_model.py``; the datasheet profiles of GPUs leave them at 0 (there the host's
work overlaps the device's).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from partitioner.cost.devices import DeviceRates
from partitioner.cut.objective import stage_crossings

from .schedule import Schedule, StageDeps
from .simulate import Seconds, SimResult, simulate

__all__ = ["predict_step", "plan_step", "plan_edges", "with_pass_overhead"]


def with_pass_overhead(seconds: Seconds, rates: DeviceRates) -> list[float] | float:
    """Per-stage seconds of a pass (a list, or one scalar for every stage) with the runtime's per-pass cost added."""
    if isinstance(seconds, Sequence):
        return [float(s) + rates.pass_overhead_s for s in seconds]
    return float(seconds) + rates.pass_overhead_s


def predict_step(schedule: Schedule, forward_s: Seconds, backward_s: Seconds, rates: DeviceRates, *,
                 weight_s: Seconds | None = None, comm_s: float | Mapping[tuple[int, int], float] = 0.0,
                 stage_deps: StageDeps = None) -> SimResult:
    """The step of ``schedule`` whose stages' ops take ``forward_s`` / ``backward_s`` (/ ``weight_s``, see
    :func:`pipeline.simulate.simulate`) seconds per microbatch, under ``rates``' per-pass and per-step costs;
    ``comm_s``: seconds per message on each stage edge (or one for all). The result's ``step_s`` includes the
    per-step cost; its passes, bubble and per-rank busy seconds are the schedule's."""
    sim = simulate(schedule, with_pass_overhead(forward_s, rates), with_pass_overhead(backward_s, rates),
                   weight_s=None if weight_s is None else with_pass_overhead(weight_s, rates), comm_s=comm_s,
                   stage_deps=stage_deps)
    if rates.step_overhead_s <= 0:
        return sim
    step = sim.step_s + rates.step_overhead_s
    return dataclasses.replace(sim, step_s=step, idle_s=[step - b for b in sim.busy_s])


def plan_edges(plan: Any, graph: Any, rates: DeviceRates | None = None) -> list[list[Any]]:
    """[producer stage, consumer stage, seconds per microbatch] of every stage edge of a
    :class:`partitioner.PartitionPlan`: the bytes crossing it over the link of ``rates`` (the plan's own if None)."""
    rates = rates or DeviceRates.from_dict(plan.rates)
    crossing = stage_crossings(graph, plan.stage_of_ops(graph), plan.num_stages)
    return [[s, t, rates.comm_s(b, messages=c)] for (s, t), (b, c) in crossing.items()]


def plan_step(plan: Any, schedule: Schedule, rates: DeviceRates | None = None, graph: Any = None) -> SimResult:
    """The step of a :class:`partitioner.PartitionPlan` run by ``schedule``: its stages' seconds and its
    :func:`plan_edges`, priced by :func:`predict_step` under ``rates`` (the plan's own if None); ``graph``: the plan's
    op graph, if at hand (else traced again)."""
    rates = rates or DeviceRates.from_dict(plan.rates)
    edges = plan_edges(plan, graph if graph is not None else plan.traced_graph(), rates)
    return predict_step(schedule, [s.forward_s for s in plan.stages], [s.backward_s for s in plan.stages], rates,
                        comm_s={(s, t): c for s, t, c in edges}, stage_deps=[(s, t) for s, t, _ in edges] or None)
