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
from functools import lru_cache

from partitioner.capture.graph import OpGraph
from partitioner.cost.devices import DeviceRates
from partitioner.cut.objective import stage_crossings
from partitioner.cut.options import PartitionOptions
from partitioner.cut.plan import PartitionPlan
from partitioner.layout.score import SimOutcome

from .schedule import Schedule, make_schedule, peak_in_flight
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


@lru_cache(maxsize=64)
def _built(schedule: str, ranks: int, microbatches: int, virtual_stages: int) -> tuple[Schedule, list[int]]:
    """The named schedule and its :func:`pipeline.schedule.peak_in_flight`, built once per shape: a layout search
    prices hundreds of layouts on a few dozen (schedule, ranks, microbatches) shapes, and building one of 24 ranks x
    192 microbatches costs as much as a tenth of its simulation. Neither is modified by a simulation."""
    kwargs = {"virtual_stages": virtual_stages} if virtual_stages != 1 else {}
    built = make_schedule(schedule, ranks, microbatches, **kwargs)
    return built, peak_in_flight(built)


def pipeline_simulator(schedule: str, ranks: int, microbatches: int, virtual_stages: int, forward_s: list[float],
                       backward_s: list[float], comm_s: dict[tuple[int, int], float],
                       deps: list[tuple[int, int]], rates: DeviceRates) -> SimOutcome:
    """The :class:`partitioner.layout.score.PipelineSimulator` of ``smp plan``: the schedule ``smp simulate``
    builds, simulated the same way (:func:`simulate_stages`, with the schedule built once per shape). Layouts that
    differ only in ZeRO-1 (or in a placement that moves no boundary across nodes) simulate the same stages: the
    outcome is kept per exact input and each caller gets lists of its own."""
    out = _simulated(schedule, ranks, microbatches, virtual_stages, tuple(forward_s), tuple(backward_s),
                     tuple(sorted(comm_s.items())), tuple(deps), rates)
    return SimOutcome(out.step_s, out.bubble, list(out.rank_end_s), list(out.peak_in_flight))


@lru_cache(maxsize=256)
def _simulated(schedule: str, ranks: int, microbatches: int, virtual_stages: int, forward_s: tuple[float, ...],
               backward_s: tuple[float, ...], comm_s: tuple[tuple[tuple[int, int], float], ...],
               deps: tuple[tuple[int, int], ...], rates: DeviceRates) -> SimOutcome:
    """:func:`pipeline_simulator`'s outcome for hashable inputs (kept: its lists are the cache's, never handed out)."""
    built, peak = _built(schedule, ranks, microbatches, virtual_stages)
    sim = predict_step(built, list(forward_s), list(backward_s), rates, comm_s=dict(comm_s), stage_deps=list(deps))
    return SimOutcome(sim.step_s, sim.bubble, [e[-1] if e else 0.0 for e in sim.ends], list(peak))
