"""A plan with its baselines and its simulated schedule: what ``smp inspect`` and ``smp demo`` print.

The plan comes from :func:`partitioner.partition`; the baselines (uniform, params, layers) are scored under the same
cost model and simulated under the same schedule (:func:`pipeline.stage_simulation.plan_sim`), so they compare like
with like. Everything is priced for the plan's device and training precision: transfers between stages per
microbatch from the bytes :func:`partitioner.cut.objective.stage_crossings` counts at that precision, over the plan's
link rates. What each stage's rank holds (:func:`partitioner.stage_memory`) counts the activations of the microbatches
the simulated schedule keeps in flight at its peak (:func:`pipeline.schedule.peak_in_flight`). Given the example
inputs, every stage is also timed for real (:func:`partitioner.measure_stages`). Under sharded data parallelism the
stages are cut without the memory budget (:func:`partitioner.sdp.group.cut_options`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from partitioner.capture.graph import OpGraph
from partitioner.capture.stage_modules import split
from partitioner.cost.timing import measure_stages
from partitioner.cut.baselines import all_baselines
from partitioner.cut.memory import stage_memory
from partitioner.cut.options import PartitionOptions
from partitioner.cut.plan import PartitionPlan
from partitioner.cut.portfolio import make_problem, partition
from partitioner.sdp.group import cut_options

from .schedule import peak_in_flight
from .simulate import SimResult
from .stage_simulation import plan_sim

__all__ = ["analyse"]


def analyse(graph: OpGraph, partitions: int, options: PartitionOptions, *, pipeline: str | None = None,
            sdp: int = 1, target: str | None = None,
            measure_inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None,
            progress: Callable[[str], None] = lambda m: None) -> tuple[PartitionPlan, SimResult]:
    """Partition ``graph`` into ``partitions`` stages under ``options`` (its microbatches and schedule included),
    score the baselines, simulate the schedule, and time every stage on ``measure_inputs`` (``(args, kwargs)``: one
    microbatch) if given. ``pipeline``: the pipeline's name as the user gave it (default the schedule's); ``sdp``: the
    sharded data-parallel degree; ``target``: the model's name, recorded.

    Returns ``(plan, sim)``: the plan with ``extra["baselines"]``, ``extra["schedule"]``, ``extra["memory"]`` (and
    ``extra["target"]``, ``extra["measured"]``) filled in, and the simulator's result for its schedule.
    """
    pipeline = pipeline or options.pipeline
    progress(f"partitioning into {partitions} stages (method {options.method})")
    plan = partition(graph, partitions, cut_options(options, sdp))
    progress(f"scoring baselines and simulating {options.microbatches} microbatches, {pipeline} pipeline")
    baselines = {}
    for name, other in all_baselines(make_problem(graph, partitions, options)).items():
        baselines[name] = {"balance": other.balance, "bottleneck_s": other.bottleneck, "cut_bytes": other.cut_bytes,
                           "max_memory_bytes": max(s.memory_bytes for s in other.stages),
                           "predicted_step_s": plan_sim(other, graph, options).step_s}
    sim = plan_sim(plan, graph, options)
    plan.extra["baselines"] = baselines
    plan.extra["schedule"] = {
        "microbatches": options.microbatches, "pipeline": pipeline, "schedule": options.pipeline,
        "predicted_step_s": sim.step_s, "bubble": sim.bubble,
        "throughput_microbatches_per_s": options.microbatches / sim.step_s if sim.step_s > 0 else 0.0,
    }
    plan.extra["memory"] = [m.to_dict() for m in stage_memory(plan, graph, peak_in_flight(sim.schedule))]
    if target is not None:
        plan.extra["target"] = target
    if measure_inputs is not None:
        args, kwargs = measure_inputs
        times = measure_stages(split(graph, plan.assignment, plan.num_stages), args, kwargs, progress=progress)
        for s, total in zip(plan.stages, times.total_s):
            s.measured_s = total
        msim = plan_sim(plan, graph, options, forward_s=times.forward_s, backward_s=times.backward_s)
        plan.extra["measured"] = {"forward_s": times.forward_s, "backward_s": times.backward_s,
                                  "predicted_step_s": msim.step_s, "bubble": msim.bubble}
    return plan, sim
