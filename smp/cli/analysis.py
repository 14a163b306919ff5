"""What ``smp inspect`` and ``smp demo`` compute: the plan, its baselines, and the simulated schedule.

The plan comes from :func:`partitioner.partition`; the baselines (uniform, params, layers) are scored under
the same cost model and simulated under the same schedule, so the table compares like with like. Everything is
priced for the plan's device and training precision (``--device``, ``--dtype``): transfers between stages per
microbatch from the bytes :func:`partitioner.cut.objective.stage_crossings` counts at that precision, over the
plan's link rates. What each stage's rank holds (:func:`partitioner.stage_memory`) counts the activations of
the microbatches the simulated schedule keeps in flight at its peak (:func:`pipeline.schedule.peak_in_flight`).
``--measure`` times every stage for real (:func:`partitioner.measure_stages`). Under ``--sdp`` the stages are cut
without the memory budget (:attr:`smp.cli.options.Options.stage_options`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from smp.cli.errors import CLIError
from smp.cli.options import Options
from smp.cli.target import Target

__all__ = ["simulate_stages", "analyse", "plan_sim"]


def simulate_stages(schedule_name: str, microbatches: int, forward_s: Sequence[float], backward_s: Sequence[float],
                    rates: Any, *, deps: Sequence[tuple[int, int]] | None = None,
                    comm: dict[tuple[int, int], float] | None = None, num_ranks: int | None = None,
                    virtual_stages: int = 1) -> Any:
    """Build the named schedule and predict its step under ``rates`` (:func:`pipeline.step_model.predict_step`)."""
    from pipeline.schedule import make_schedule
    from pipeline.step_model import predict_step

    ranks = num_ranks or len(forward_s)
    kwargs = {"virtual_stages": virtual_stages} if virtual_stages != 1 else {}
    schedule = make_schedule(schedule_name, ranks, microbatches, **kwargs)
    return predict_step(schedule, list(forward_s), list(backward_s), rates, comm_s=dict(comm or {}),
                        stage_deps=list(deps) if deps is not None else None)


def plan_sim(plan: Any, graph: Any, opts: Options, forward_s: Sequence[float] | None = None,
             backward_s: Sequence[float] | None = None) -> Any:
    """Simulate ``opts``' schedule on the plan's stages: its stage times (or the ones given) and its transfers
    over the plan's link."""
    from partitioner import DeviceRates
    from partitioner.cut.objective import stage_crossings

    rates = DeviceRates.from_dict(plan.rates)
    crossing = stage_crossings(graph, plan.stage_of_ops(graph), plan.num_stages, opts.partition.dtype)
    comm = {e: rates.comm_s(b, messages=c) for e, (b, c) in crossing.items()}
    fwd = forward_s if forward_s is not None else [s.forward_s for s in plan.stages]
    bwd = backward_s if backward_s is not None else [s.backward_s for s in plan.stages]
    return simulate_stages(opts.schedule, opts.microbatches, fwd, bwd, rates, deps=sorted(crossing), comm=comm)


def analyse(graph: Any, opts: Options, *, target: Target | None = None,
            progress: Callable[[str], None] = lambda m: None) -> tuple[Any, Any]:
    """Partition ``graph``, score the baselines, simulate the schedule, and measure if asked.

    Returns ``(plan, sim)``: the plan with ``extra["baselines"]``, ``extra["schedule"]``, ``extra["memory"]``
    (and ``extra["measured"]``, ``extra["target"]``) filled in, and the simulator's result for its schedule.
    """
    from partitioner import measure_stages, partition, stage_memory
    from partitioner.capture.stage_modules import split
    from partitioner.cut.baselines import all_baselines
    from partitioner.cut.portfolio import make_problem
    from pipeline.schedule import peak_in_flight

    progress(f"partitioning into {opts.partitions} stages (method {opts.partition.method})")
    plan = partition(graph, opts.partitions, opts.stage_options)
    progress(f"scoring baselines and simulating {opts.microbatches} microbatches, {opts.pipeline} pipeline")
    baselines = {}
    for name, other in all_baselines(make_problem(graph, opts.partitions, opts.partition)).items():
        baselines[name] = {"balance": other.balance, "bottleneck_s": other.bottleneck, "cut_bytes": other.cut_bytes,
                           "max_memory_bytes": max(s.memory_bytes for s in other.stages),
                           "predicted_step_s": plan_sim(other, graph, opts).step_s}
    sim = plan_sim(plan, graph, opts)
    plan.extra["baselines"] = baselines
    plan.extra["schedule"] = {
        "microbatches": opts.microbatches, "pipeline": opts.pipeline, "schedule": opts.schedule,
        "predicted_step_s": sim.step_s, "bubble": sim.bubble,
        "throughput_microbatches_per_s": opts.microbatches / sim.step_s if sim.step_s > 0 else 0.0,
    }
    plan.extra["memory"] = [m.to_dict() for m in stage_memory(plan, graph, peak_in_flight(sim.schedule))]
    if target is not None:
        plan.extra["target"] = target.spec
    if opts.measure_stages:
        if target is None:
            raise CLIError("--measure needs the model's example inputs")
        times = measure_stages(split(graph, plan.assignment, plan.num_stages), target.args, target.kwargs,
                               progress=progress)
        for s, total in zip(plan.stages, times.total_s):
            s.measured_s = total
        msim = plan_sim(plan, graph, opts, forward_s=times.forward_s, backward_s=times.backward_s)
        plan.extra["measured"] = {"forward_s": times.forward_s, "backward_s": times.backward_s,
                                  "predicted_step_s": msim.step_s, "bubble": msim.bubble}
    return plan, sim
