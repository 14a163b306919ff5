"""The report ``smp inspect`` prints: one row per stage, the totals, and why the plan is what it is.

First the device, precision and links the plan is priced for; then the stage table (for a tensor-parallel plan with a
``tp ms`` column: the tp collectives per microbatch, part of fwd and bwd), and the bytes the rank running each stage
holds by kind (:func:`partitioner.stage_memory`; per tp rank; with ``--sdp`` the sharded figures of
:func:`smp.cli.sharded_dp.memory_table`). After the tables: the lower bound and the balance
(bottleneck / lower bound), the cut and the largest stage's memory, shared parameters, the simulated schedule (and
the one with measured stage times), and the baselines scored by the same cost model and schedule.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from partitioner.units import format_bytes, format_seconds
from smp.cli.graph import is_ancestor
from smp.cli.sharded_dp import memory_table
from smp.cli.text import format_flops, ms, table

__all__ = ["format_report", "module_range", "pipeline_title", "priced_for"]

_SCHEDULE_TITLE = {"1f1b": "1F1B", "gpipe": "GPipe"}


def pipeline_title(pipeline: str, schedule: str) -> str:
    """SMP's pipeline name with the schedule it runs: ``interleaved (1F1B)``, ``simple (GPipe)``."""
    return f"{pipeline} ({_SCHEDULE_TITLE.get(schedule, schedule)})"


def module_range(modules: Sequence[str]) -> str:
    """First .. last module of a stage, skipping containers whose children are listed."""
    mods = [m for m in modules if not any(is_ancestor(m, o) for o in modules)] or list(modules)
    mods = [m or "(root)" for m in mods]
    if not mods:
        return ""
    return mods[0] if len(mods) == 1 or mods[0] == mods[-1] else f"{mods[0]} .. {mods[-1]}"


def _stage_table(plan: Any, graph: Any) -> list[str]:
    measured = plan.extra.get("measured")
    tp_s = plan.tensor_parallel.get("comm_s")
    header = ["stage", "ops", "params", "FLOPs", "fwd ms", "bwd ms"]
    if measured:
        header += ["meas fwd", "meas bwd"]
    if tp_s:
        header += ["tp ms"]
    header += ["comm ms", "cost ms", "memory", "in", "out", "modules"]
    rows = []
    for s in plan.stages:
        row = [str(s.index), str(s.nodes), format_bytes(s.param_bytes), format_flops(s.flops), ms(s.forward_s),
               ms(s.backward_s)]
        if measured:
            row += [ms(measured["forward_s"][s.index]), ms(measured["backward_s"][s.index])]
        if tp_s:
            row += [ms(tp_s[s.index])]
        row += [ms(s.comm_s), ms(s.cost_s), format_bytes(s.memory_bytes), format_bytes(s.bytes_in),
                format_bytes(s.bytes_out), module_range(s.modules)]
        rows.append(row)
    unique_params = int(graph.param_bytes.sum()) if graph is not None else sum(s.param_bytes for s in plan.stages)
    total = ["total", str(sum(s.nodes for s in plan.stages)), format_bytes(unique_params),
             format_flops(sum(s.flops for s in plan.stages)), ms(sum(s.forward_s for s in plan.stages)),
             ms(sum(s.backward_s for s in plan.stages))]
    if measured:
        total += [ms(sum(measured["forward_s"])), ms(sum(measured["backward_s"]))]
    if tp_s:
        total += [ms(sum(tp_s))]
    total += [ms(sum(s.comm_s for s in plan.stages)), ms(sum(s.cost_s for s in plan.stages)),
              format_bytes(sum(s.memory_bytes for s in plan.stages)), "", format_bytes(plan.cut_bytes), ""]
    lines = table(header, rows + [total], left=(len(header) - 1,))
    lines.insert(len(lines) - 1, lines[1])
    return lines


def priced_for(options: dict[str, Any], rates: dict[str, Any]) -> str:
    """The device, precision, links and memory budget a plan is priced for, in one line."""
    budget = options.get("device_memory")
    dtype = options.get("dtype", "fp32")
    mixed = " mixed precision" if dtype in ("bf16", "fp16") else ""
    return (f"priced for {rates.get('name', options.get('device', 'cpu'))} in {dtype}{mixed}; links "
            f"{rates.get('link', '?')} within a node, {rates.get('inter_node_link', '?')} between nodes; memory "
            f"budget {format_bytes(budget) + ' per device' if budget else 'none'}")


def _headroom_note(largest: float, budget: float | None) -> str:
    """``; 96% of the budget, more than smp plan allows: ...`` when the largest stage eats into the memory a plan keeps
    free for the allocator (:mod:`partitioner.layout.headroom`'s default), else nothing."""
    from partitioner.layout.headroom import DEFAULT

    usable = DEFAULT.usable(budget)
    if not budget or usable is None or largest <= usable:
        return ""
    return (f"; {100 * largest / budget:.0f}% of the budget, more than the {format_bytes(usable)} smp plan allows: "
            f"it keeps {DEFAULT.describe()} free for the CUDA allocator and NCCL, which this estimate omits")


def _memory_table(memory: Sequence[dict[str, Any]]) -> list[str]:
    header = ["stage", "weights", "gradients", "optimizer", "master", "activations in flight", "total"]
    keys = ("weights_bytes", "gradient_bytes", "optimizer_bytes", "master_bytes")
    rows = [[str(m["stage"]), *(format_bytes(m[k]) for k in keys),
             f"{m['in_flight']} x {format_bytes(m['activation_bytes_per_microbatch'])} = "
             f"{format_bytes(m['activation_bytes'])}", format_bytes(m["total_bytes"])] for m in memory]
    return table(header, rows)


def format_report(plan: Any, graph: Any = None) -> str:
    """What ``smp inspect`` prints: the device line, one row per stage, totals, what each stage's rank holds,
    bounds, schedule, baselines."""
    lines = [priced_for(plan.options, plan.rates), *_stage_table(plan, graph)]
    memory = plan.extra.get("memory")
    if memory:
        lines.append("")
        tp = plan.tensor_parallel.get("degree", 1)
        sdp = plan.extra.get("sharded_data_parallel")
        lines.append(f"memory per rank ({plan.options.get('dtype', 'fp32')}, {plan.options.get('optimizer', 'adam')}"
                     "; what the rank running each stage holds at its peak, activations in flight by the "
                     "simulated schedule" + (f"; tp rank 0 of {tp} ranks per stage" if tp > 1 else "")
                     + (f"; parameters sharded over {sdp['degree']} replicas: weights, gradients at rest and optimizer "
                        "state / D, gradients whole during the step, gathered layers whole" if sdp else "") + "):")
        lines += memory_table(sdp) if sdp else _memory_table(memory)
    worst = max(plan.stages, key=lambda s: s.cost_s).index
    lines.append("")
    lines.append(f"lower bound {ms(plan.lower_bound)} ms per microbatch (max of total compute/{plan.num_stages} and "
                 f"the largest op); bottleneck {ms(plan.bottleneck)} ms (stage {worst}); balance {plan.balance:.3f}")
    mw = plan.options.get("memory_weight", 0.2)
    largest = max(s.memory_bytes for s in plan.stages)
    lines.append(f"cut {format_bytes(plan.cut_bytes)} per microbatch; largest stage memory {format_bytes(largest)} "
                 f"(weights, gradients, {plan.options.get('optimizer', 'adam')} state, activations in flight"
                 f"{_headroom_note(largest, plan.options.get('device_memory'))}); method {plan.method}, "
                 f"memory_weight {mw:g}")
    if plan.shared_params:
        lines.append("shared parameters (replicated, gradients summed): " +
                     ", ".join(f"{k} on stages {v}" for k, v in sorted(plan.shared_params.items())))
    sched = plan.extra.get("schedule")
    if sched:
        lines.append(f"schedule {pipeline_title(sched['pipeline'], sched['schedule'])}, {plan.num_stages} stages x "
                     f"{sched['microbatches']} microbatches: "
                     f"predicted step {format_seconds(sched['predicted_step_s'])}, "
                     f"bubble {100 * sched['bubble']:.1f}%, "
                     f"{sched.get('throughput_microbatches_per_s', 0):.1f} microbatches/s")
    measured = plan.extra.get("measured")
    if measured:
        lines.append(f"with measured stage times: predicted step {format_seconds(measured['predicted_step_s'])}, "
                     f"bubble {100 * measured['bubble']:.1f}%")
    base = plan.extra.get("baselines")
    if base:
        lines.append("baselines (same cost model and schedule; the plan minimises the worst stage's blend of time "
                     "and memory, --memory-weight 0 for time alone):")
        step = sched["predicted_step_s"] if sched else None
        for name, b in base.items():
            extra = ""
            if step and b.get("predicted_step_s"):
                extra = (f"  step {format_seconds(b['predicted_step_s'])} "
                         f"({100 * (b['predicted_step_s'] / step - 1):+.1f}% vs plan)")
            mem = f"  max memory {format_bytes(b['max_memory_bytes'])}" if b.get("max_memory_bytes") is not None else ""
            lines.append(f"  {name:<8} balance {b['balance']:.3f}  bottleneck {ms(b['bottleneck_s'])} ms  "
                         f"cut {format_bytes(b['cut_bytes'])}{mem}{extra}")
    return "\n".join(lines)
