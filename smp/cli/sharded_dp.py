"""``--sdp D`` of ``smp inspect`` and ``smp simulate``: each stage's parameters sharded over D data-parallel replicas
(SMP's ``sharded_data_parallel_degree``), priced by :func:`partitioner.sdp.shards.sharded_dp`.

The stages are cut as without sharding (the partitioner counts parameters whole), but without the memory budget:
the sharded ranks are held to it instead (:func:`check_budget`). The sharding group's collectives run on the plan's
link within a node when the D replicas of a stage share one, else on the inter-node link (a ring is as slow as its
slowest hop). Replicas of a stage are a pipeline (P stages x tp ranks) apart, SMP's "cluster" placement
(:mod:`smp.runtime.topology`). The engine gathers synchronously, so each microbatch's all-gathers add to its stage's
forward and backward; the reduce-scatter and all-reduce run once, after the rank's last backward of the step
(:func:`with_end_of_step`). ``--sdp 1`` changes nothing.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from partitioner.units import format_bytes, format_seconds
from smp.cli.errors import CLIError
from smp.cli.options import RANKS_PER_NODE, Options
from smp.cli.text import table

__all__ = ["group_link", "check_budget", "with_end_of_step", "record", "price_plan", "memory_table", "sdp_lines",
           "MAX_LISTED"]

MAX_LISTED = 4  # gathered parameters named per stage; the rest are counted


def group_link(rates: dict[str, Any], degree: int, ranks_apart: int, ranks_per_node: int,
               inter: tuple[float, float] | None = None) -> Any:
    """The :class:`partitioner.DeviceRates` whose ``link_*`` a stage's sharding group runs on: the plan's ``rates``
    link when the ``degree`` replicas, ``ranks_apart`` ranks apart, fit in ``ranks_per_node``; else the inter-node
    link (``inter``: its bandwidth and latency, default the rates')."""
    from partitioner import DeviceRates

    intra = DeviceRates.from_dict(rates)
    if degree * ranks_apart <= ranks_per_node:
        return intra
    bw, lat = inter or (intra.inter_node_bytes_per_s, intra.inter_node_latency_s)
    return replace(intra, link=intra.inter_node_link, link_bytes_per_s=bw, link_latency_s=lat)


def check_budget(ranks: Sequence[Any], budget: float | None, degree: int) -> None:
    """Refuse sharded ranks (:class:`partitioner.sdp.shards.ShardedRank`) whose peak exceeds ``budget`` bytes."""
    worst = max(ranks, key=lambda r: r.peak_bytes)
    if budget is None or worst.peak_bytes <= budget:
        return
    raise CLIError(f"--sdp {degree}: the rank of stage(s) {list(worst.stages)} needs {format_bytes(worst.peak_bytes)} "
                   f"at its peak (weights {format_bytes(worst.weights_bytes)}, gradients during the step "
                   f"{format_bytes(worst.gradient_peak_bytes)}, optimizer state {format_bytes(worst.optimizer_bytes)}, "
                   f"master weights {format_bytes(worst.master_bytes)}, gathered {format_bytes(worst.gathered_bytes)}, "
                   f"activations {format_bytes(worst.activation_bytes)}), more than --device-memory "
                   f"{format_bytes(budget)}: raise --sdp, use more stages (-p) or fewer microbatches in flight, or "
                   "raise --device-memory")


def with_end_of_step(sim: Any, end_s: Sequence[float]) -> tuple[float, float]:
    """The step and bubble of a simulated schedule (:class:`pipeline.simulate.SimResult`) when each rank then
    spends ``end_s[rank]`` on the step's reduce-scatter and all-reduce (counted busy); the step's fixed cost
    (:func:`pipeline.step_model.predict_step`) is kept."""
    last = [e[-1] if e else 0.0 for e in sim.ends]
    step = max(t + x for t, x in zip(last, end_s)) + sim.step_s - max(last, default=0.0)
    busy = sum(sim.busy_s) + sum(end_s)
    return step, (1.0 - busy / (len(sim.busy_s) * step) if step > 0 else 0.0)


def record(ranks: Sequence[Any], threshold: int, link: Any, budget: float | None, step_s: float | None = None,
           bubble: float | None = None) -> dict[str, Any]:
    """What a plan or a simulation records of sharded data parallelism (JSON-ready): the degree, the replicas, the
    threshold, the link, the budget, each rank's :meth:`partitioner.sdp.shards.ShardedRank.to_dict` and the
    predicted step with the collectives."""
    out = {"degree": ranks[0].degree, "replicas": ranks[0].replicas, "threshold": threshold,
           "link": {"name": link.link, "bytes_per_s": link.link_bytes_per_s, "latency_s": link.link_latency_s},
           "device_memory": budget, "ranks": [r.to_dict() for r in ranks]}
    if step_s is not None:
        out.update(predicted_step_s=step_s, bubble=bubble)
    return out


def price_plan(plan: Any, graph: Any, opts: Options, sim: Any) -> None:
    """``smp inspect --sdp``: price ``plan``'s ranks sharded (activations in flight as ``sim``, the pipeline's
    simulation, keeps them), hold them to the budget, simulate the step with the collectives and record it all
    in ``plan.extra["sharded_data_parallel"]``."""
    from partitioner import DeviceRates
    from partitioner.sdp.shards import PERSISTENCE_THRESHOLD, sharded_dp
    from pipeline.schedule import peak_in_flight
    from smp.cli.analysis import plan_sim

    threshold = opts.sdp_threshold or PERSISTENCE_THRESHOLD
    link = group_link(plan.rates, opts.sdp, plan.num_stages * opts.tp, RANKS_PER_NODE)
    ranks = sharded_dp(plan, graph, opts.sdp, threshold=threshold, link=link, in_flight=peak_in_flight(sim.schedule))
    budget = opts.partition.budget(DeviceRates.from_dict(plan.rates))
    check_budget(ranks, budget, opts.sdp)
    with_gathers = plan_sim(plan, graph, opts, forward_s=[s.forward_s + r.gather_forward_s
                                                          for s, r in zip(plan.stages, ranks)],
                            backward_s=[s.backward_s + r.gather_backward_s for s, r in zip(plan.stages, ranks)])
    step, bubble = with_end_of_step(with_gathers, [r.end_of_step_s for r in ranks])
    plan.extra["sharded_data_parallel"] = record(ranks, threshold, link, budget, step, bubble)


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
             f"backward, inside its stage time), {format_seconds(worst['all_gather_s'])} per step (x {microbatches}); "
             f"reduce-scatter {format_seconds(worst['reduce_scatter_s'])} and all-reduce "
             f"{format_seconds(worst['all_reduce_s'])} once per step, after its last backward"]
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
