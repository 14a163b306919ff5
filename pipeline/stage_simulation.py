"""A pipeline's step from its stages' seconds: a named schedule built and predicted by the step model, a plan's
schedule with its transfers, the closed form for equal stages, and the layout planner's simulator.

Every prediction here is :func:`pipeline.step_model.predict_step` on a schedule of
:func:`pipeline.schedule.make_schedule`, so ``smp inspect``, ``smp simulate`` and ``smp plan``
(:func:`pipeline_simulator`, what :class:`partitioner.layout.score.LayoutScorer` calls) price one pipeline the same
way. A plan's transfers between stages are the bytes :func:`partitioner.cut.objective.stage_crossings` counts at the
training precision, over the plan's link.
"""
from __future__ import annotations

from collections.abc import Sequence

from partitioner.capture.graph import OpGraph
from partitioner.cost.devices import DeviceRates
from partitioner.cut.objective import stage_crossings
from partitioner.cut.options import PartitionOptions
from partitioner.cut.plan import PartitionPlan
from partitioner.layout.score import SimOutcome

from .schedule import make_schedule, peak_in_flight
from .simulate import SimResult
from .step_model import predict_step

__all__ = ["simulate_stages", "plan_sim", "formula_step", "pipeline_simulator"]


def simulate_stages(schedule_name: str, microbatches: int, forward_s: Sequence[float], backward_s: Sequence[float],
                    rates: DeviceRates, *, deps: Sequence[tuple[int, int]] | None = None,
                    comm: dict[tuple[int, int], float] | None = None, num_ranks: int | None = None,
                    virtual_stages: int = 1) -> SimResult:
    """Build the named schedule (on ``num_ranks`` ranks, default one per stage) and predict its step under ``rates``
    (:func:`pipeline.step_model.predict_step`); ``deps``: the stage edges, ``comm``: seconds per message on each."""
    ranks = num_ranks or len(forward_s)
    kwargs = {"virtual_stages": virtual_stages} if virtual_stages != 1 else {}
    schedule = make_schedule(schedule_name, ranks, microbatches, **kwargs)
    return predict_step(schedule, list(forward_s), list(backward_s), rates, comm_s=dict(comm or {}),
                        stage_deps=list(deps) if deps is not None else None)


def plan_sim(plan: PartitionPlan, graph: OpGraph, options: PartitionOptions, forward_s: Sequence[float] | None = None,
             backward_s: Sequence[float] | None = None) -> SimResult:
    """Simulate ``options``' schedule and microbatches on the plan's stages: its stage times (or the ones given) and
    its transfers at ``options``' dtype over the plan's link."""
    rates = DeviceRates.from_dict(plan.rates)
    crossing = stage_crossings(graph, plan.stage_of_ops(graph), plan.num_stages, options.dtype)
    comm = {e: rates.comm_s(b, messages=c) for e, (b, c) in crossing.items()}
    fwd = forward_s if forward_s is not None else [s.forward_s for s in plan.stages]
    bwd = backward_s if backward_s is not None else [s.backward_s for s in plan.stages]
    return simulate_stages(options.pipeline, options.microbatches, fwd, bwd, rates, deps=sorted(crossing), comm=comm)


def formula_step(p: int, m: int, total_s: float, rates: DeviceRates) -> float:
    """The step of GPipe or 1F1B over p equal stages of a model whose microbatch costs ``total_s``, communication
    free: (m + p - 1) (T/p + 2 o) + s, with the runtime's per-pass and per-step costs o and s of ``rates``
    (:mod:`pipeline.step_model`), what the simulator gives."""
    return (m + p - 1) * (total_s / p + 2 * rates.pass_overhead_s) + rates.step_overhead_s


def pipeline_simulator(schedule: str, ranks: int, microbatches: int, virtual_stages: int, forward_s: list[float],
                       backward_s: list[float], comm_s: dict[tuple[int, int], float],
                       deps: list[tuple[int, int]], rates: DeviceRates) -> SimOutcome:
    """The :class:`partitioner.layout.score.PipelineSimulator` of ``smp plan``: the schedule ``smp simulate``
    builds, simulated the same way (:func:`simulate_stages`)."""
    sim = simulate_stages(schedule, microbatches, forward_s, backward_s, rates, deps=deps, comm=comm_s,
                          num_ranks=ranks, virtual_stages=virtual_stages)
    return SimOutcome(sim.step_s, sim.bubble, [e[-1] if e else 0.0 for e in sim.ends], peak_in_flight(sim.schedule))
