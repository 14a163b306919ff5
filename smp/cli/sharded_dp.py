"""``--sdp D`` of ``smp inspect`` and ``smp simulate``: each stage's parameters sharded over D data-parallel replicas
(SMP's ``sharded_data_parallel_degree``), as the library prices them, held to the budget, printed.

The sharding group and its link are :mod:`partitioner.sdp.group`'s (replicas of a stage are a pipeline, P stages x tp
ranks, apart: SMP's "cluster" placement, :mod:`smp.runtime.topology`); a plan's step with the collectives is
:func:`pipeline.sharded_step.sharded_step`'s. The stages are cut without the memory budget; the sharded ranks are held
to it instead (:func:`check_budget`, which says so in the command line's terms). ``--sdp 1`` changes nothing.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from partitioner.units import format_bytes, format_seconds
from smp.cli.errors import CLIError
from smp.cli.options import RANKS_PER_NODE, Options
from smp.cli.text import table

__all__ = ["check_budget", "price_plan", "memory_table", "sdp_lines", "whole_line", "MAX_LISTED", "WHOLE_SAID"]

MAX_LISTED = 4  # gathered parameters named per stage; the rest are counted
WHOLE_SAID = 0.01  # the share of a model's elements sdp leaves whole above which smp plan says so (norms, biases: less)


def check_budget(ranks: Sequence[Any], budget: float | None, degree: int) -> None:
    """Refuse sharded ranks (:class:`partitioner.sdp.shards.ShardedRank`) whose peak exceeds ``budget`` bytes
    (:func:`partitioner.sdp.group.over_budget`)."""
    from partitioner.sdp.group import over_budget

    worst = over_budget(ranks, budget)
    if worst is None or budget is None:
        return
    raise CLIError(f"--sdp {degree}: the rank of stage(s) {list(worst.stages)} needs {format_bytes(worst.peak_bytes)} "
                   f"at its peak (weights {format_bytes(worst.weights_bytes)}, gradients during the step "
                   f"{format_bytes(worst.gradient_peak_bytes)}, optimizer state {format_bytes(worst.optimizer_bytes)}, "
                   f"master weights {format_bytes(worst.master_bytes)}, gathered {format_bytes(worst.gathered_bytes)}, "
                   f"activations {format_bytes(worst.activation_bytes)}), more than --device-memory "
                   f"{format_bytes(budget)}: raise --sdp, use more stages (-p) or fewer microbatches in flight, or "
                   "raise --device-memory")


def price_plan(plan: Any, graph: Any, opts: Options, sim: Any) -> None:
    """``smp inspect --sdp``: price ``plan``'s ranks sharded (:func:`pipeline.sharded_step.sharded_step`; activations
    in flight as ``sim``, the pipeline's simulation, keeps them), hold them to the budget and record it all in
    ``plan.extra["sharded_data_parallel"]`` (:func:`partitioner.sdp.group.sharded_dp_record`)."""
    from partitioner import DeviceRates
    from partitioner.sdp.group import group_link, sharded_dp_record
    from pipeline.sharded_step import sharded_step

    rates = DeviceRates.from_dict(plan.rates)
    link = group_link(rates, opts.sdp, plan.num_stages * opts.tp, RANKS_PER_NODE)
    group = opts.sharding(link)
    priced = sharded_step(plan, graph, opts.partition, sim, group)
    budget = opts.partition.budget(rates)
    check_budget(priced.ranks, budget, opts.sdp)
    plan.extra["sharded_data_parallel"] = sharded_dp_record(priced.ranks, group.threshold, link, budget,
                                                            priced.step_s, priced.bubble)


def memory_table(rec: dict[str, Any]) -> list[str]:
    """The memory per rank table of a sharded plan (its ``sharded_data_parallel`` record)."""
    header = ["stage", "weights", "grads at rest", "grads in step", "optimizer", "master", "gathered", "activations",
              "peak"]
    keys = ("weights_bytes", "gradient_bytes", "gradient_peak_bytes", "optimizer_bytes", "master_bytes",
            "gathered_bytes", "activation_bytes", "peak_bytes")
    rows = [[",".join(map(str, r["stages"])), *(format_bytes(r[k]) for k in keys)] for r in rec["ranks"]]
    return table(header, rows)


def sdp_lines(rec: dict[str, Any], microbatches: int, step_s: float | None = None) -> list[str]:
    """What sharding does: the degree and what it shards, the collectives per microbatch and step on the worst rank,
    the step with them (next to the pipeline's ``step_s``) and the parameters gathered at each rank's peak."""
    ranks, link = rec["ranks"], rec["link"]
    sharded, params = sum(r["sharded"] for r in ranks), sum(r["params"] for r in ranks)
    worst = max(ranks, key=lambda r: r["all_gather_s"] + r["reduce_scatter_s"] + r["all_reduce_s"])
    where = f"stage(s) {','.join(map(str, worst['stages']))}"
    lines = [f"sharded data parallelism: degree {rec['degree']} of {rec['replicas']} replicas per stage (ZeRO-3); "
             f"{sharded} of {params} parameters sharded ({rec['threshold']} elements or more, used by one stage); the "
             "rest stay whole and are all-reduced",
             f"  collectives on {link['name']} ({format_bytes(link['bytes_per_s'])}/s + "
             f"{format_seconds(link['latency_s'])} per ring step), worst on {where}: all-gathers "
             f"{format_seconds(worst['gather_forward_s'] + worst['gather_backward_s'])} per microbatch (forward and "
             f"backward, a unit prefetched while the one before computes), {format_seconds(worst['all_gather_s'])} "
             f"per step (x {microbatches}); reduce-scatters {format_seconds(worst['reduce_scatter_s'])} during its "
             f"last backward and all-reduce {format_seconds(worst['all_reduce_s'])} after it; the step has what the "
             "compute does not hide"]
    if "predicted_step_s" in rec:
        more = f" ({100 * (rec['predicted_step_s'] / step_s - 1):+.1f}% over the pipeline alone)" if step_s else ""
        lines.append(f"  predicted step with them {format_seconds(rec['predicted_step_s'])}{more}, bubble "
                     f"{100 * rec['bubble']:.1f}%")
    for r in ranks:
        if r["gathered"]:
            names = r["gathered"][:MAX_LISTED] + ([f"... {len(r['gathered']) - MAX_LISTED} more"]
                                                  if len(r["gathered"]) > MAX_LISTED else [])
            lines.append(f"  gathered at the peak of stage(s) {','.join(map(str, r['stages']))}: "
                         f"{format_bytes(r['gathered_bytes'])} ({', '.join(names)})")
    return lines


def whole_line(graph: Any, plan: Any, degree: int, threshold: int) -> str | None:
    """What sharding of ``degree`` leaves whole on every replica of ``plan``'s stages (made from ``graph``) at
    ``threshold`` elements (SMP's ``sdp_param_persistence_threshold``, whose default, SMP v1's, leaves the matrices
    of a small model whole), with how to shard everything; None when it leaves less than :data:`WHOLE_SAID`."""
    from partitioner.sdp.shards import shardable

    found = shardable(graph, threshold, plan.stage_of_ops(graph), plan.num_stages)
    if degree <= 1 or found.whole_share < WHOLE_SAID:
        return None
    shared = f" and {found.shared} used by several stages" if found.shared else ""
    return (f"sdp leaves whole {found.whole_share:.3f} of the parameters' elements on every replica (all-reduced as "
            f"under plain data parallelism): {found.params - found.over} parameters under "
            f"sdp_param_persistence_threshold={threshold:,} elements{shared}; set it to 1 (--sdp-threshold 1; 0 in "
            "the smp config) to shard every parameter as FSDP2 does")
