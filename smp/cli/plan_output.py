"""What ``smp plan`` prints: the search's summary, the table of the best layouts (an ``ep`` column for a
mixture-of-experts model, a ``cp`` column where context parallelism is among them), and the best layout's step, what
it is made of and its smp config."""
from __future__ import annotations

import argparse
import json
import math
from typing import Any

from partitioner.units import format_bytes, format_seconds
from smp.cli.sharded_dp import whole_line
from smp.cli.text import table

__all__ = ["print_plan"]


def _percent(x: float | None) -> str:
    """MFU as a percentage, to two significant digits below 1%."""
    if x is None:
        return "-"
    return f"{100 * x:.1f}%" if x >= 0.01 else f"{100 * x:.2g}%"


def print_plan(ns: argparse.Namespace, spec: str, costs: Any, scorer: Any, result: Any, rpn: int, elapsed: float,
               config: dict[str, Any] | None) -> None:
    """Print the plan of ``result`` (:class:`partitioner.layout.search.SearchResult`) for the parsed arguments ``ns``,
    ``config`` being the best layout's smp config (None: the config cannot run its schedule)."""
    device, usable = scorer.device_budget, scorer.budget
    nodes = math.ceil(ns.devices / rpn)
    tokens = costs.tokens_per_sample
    print(f"{spec}: {next(iter(costs.whole.traced.values())).describe()}")
    print(f"{ns.devices} devices ({nodes} node(s) of {rpn}) {scorer.rates.name} in {ns.dtype}, global batch "
          f"{ns.global_batch} samples" + (f" of {tokens:g} tokens" if tokens else "") + "; " + _budget_line(scorer))
    unsharded = f", {result.unsharded} whose sdp would shard nothing" if result.unsharded else ""
    print(f"searched {result.enumerated} layouts in {elapsed:.1f} s: {result.memory_pruned} over the memory budget "
          f"(bound), {result.bound_pruned} ruled out by the step bound or estimate{unsharded}, {result.scored} priced "
          f"({result.partitions} partitions)")
    mfu = any(p.score.mfu is not None for p in result.proposals)  # none on a measured profile: no peak (cpu)
    ep = bool(costs.experts)  # a mixture of experts: the degree its experts are split over
    cp = any(p.layout.cp > 1 for p in result.proposals)  # long sequences: the degree they are split over
    axes = [name for name, on in (("ep", ep), ("cp", cp)) if on]
    rows = []
    for i, p in enumerate(result.proposals, 1):
        lay, s = p.layout, p.score
        sched = f"{lay.schedule} v={lay.virtual_stages}" if lay.virtual_stages > 1 else lay.schedule
        share = f" ({100 * s.memory_bytes / device:.0f}%)" if device and usable else ""
        rows.append([str(i), str(lay.pp), str(lay.tp), *(str(getattr(lay, a)) for a in axes), str(lay.dp), str(lay.sdp),
                     f"{lay.microbatches} x {lay.microbatch_size}", sched, lay.checkpointing,
                     "yes" if lay.zero1 else "no", lay.placement,
                     format_seconds(s.step_s), f"{s.samples_per_s:,.1f}",
                     "-" if s.tokens_per_s is None else f"{s.tokens_per_s:,.0f}",
                     f"{s.flops_per_s_per_device / 1e12:,.2f}", *([_percent(s.mfu)] if mfu else []),
                     format_bytes(s.memory_bytes) + share, f"{100 * s.bubble:.1f}%", format_seconds(s.exposed_comm_s)])
    left = tuple(range(6 + len(axes), 10 + len(axes)))
    print("\n".join(table(["#", "pp", "tp", *axes, "dp", "sdp", "m x mb", "schedule", "ckpt", "zero1",
                           "place", "step", "samples/s", "tokens/s", "TFLOP/s/dev", *(["MFU"] if mfu else []),
                           "memory/device", "bubble", "exposed comm"], rows, left=left)))
    best = result.proposals[0]
    lay = best.layout
    graph = scorer.priced(lay)[0]
    print(f"best: {lay.describe()}; {_step_terms(best, graph)}")
    if lay.ep > 1:
        print(_experts_line(lay, graph, scorer))
    if lay.cp > 1:
        print(_context_line(lay, graph, scorer))
    if lay.sdp > 1 and (whole := whole_line(graph, scorer.plan(lay), lay.sdp, scorer.pricing.sdp_threshold)):
        print(whole)
    if config is not None:
        print(f"smp config: {json.dumps(config)}")


def _budget_line(scorer: Any) -> str:
    """``memory budget 74.5 GiB per device, 10% kept free for the allocator: plans use at most 67.1 GiB``."""
    device, usable = scorer.device_budget, scorer.budget
    if device is None or usable is None:
        return "memory budget none"
    line = f"memory budget {format_bytes(device)} per device"
    if usable < device:
        line += (f", {scorer.pricing.headroom.describe()} kept free for the allocator: plans use at most "
                 f"{format_bytes(usable)}")
    return line


def _step_terms(best: Any, graph: Any) -> str:
    """The best layout's step and what it is made of: the pipeline, the gradient reduction after it (none at dp 1),
    the optimizer step and the tp collectives (none at tp 1; with sequence parallelism where the runtime applies it,
    as priced) and expert all-to-alls (none at ep 1)."""
    lay, s = best.layout, best.score
    what = "reduce-scatter and all-reduce" if lay.sdp > 1 else "all-reduce"
    reduction = "" if lay.dp == 1 else f" + gradient {what} {format_seconds(s.dp_comm_s)}"
    text = (f"step {format_seconds(s.step_s)} = pipeline {format_seconds(s.pipeline_s)}{reduction} + optimizer step "
            f"{format_seconds(s.optimizer_s)}{' (dp 1: no gradient reduction)' if lay.dp == 1 else ''}")
    what = " and ".join(name for name, on in (("tp collectives", lay.tp > 1), ("expert all-to-alls", lay.ep > 1),
                                              ("context gathers", lay.cp > 1)) if on)
    sharding = graph.fx.sharding if graph.fx is not None else None
    sequence = " (sequence parallel)" if lay.tp > 1 and sharding is not None and sharding.sequence else ""
    return text + (f"; {what} {format_seconds(s.tp_comm_s)} per step{sequence}" if what else "")


def _experts_line(lay: Any, graph: Any, scorer: Any) -> str:
    """What the best layout's expert parallelism holds per rank, where its all-to-alls run and how its experts'
    gradients are averaged."""
    found = graph.fx.experts.found
    experts = found.layers[0].experts
    link = "between nodes" if scorer.priced_across(lay) else "within a node"
    average = (f"their gradients averaged over the {lay.dp // lay.ep} replicas holding the same experts"
               if lay.dp > lay.ep else "no other replica holds the same experts (no gradient average for them)")
    return (f"expert parallelism: the {experts} experts of each of {len(found.layers)} mixture-of-experts layers split "
            f"over {lay.ep} of the {lay.dp} replicas, {experts // lay.ep} per rank (their weights, gradients and "
            f"optimizer state at 1/{lay.ep}); all-to-alls {link}; {average}")


def _context_line(lay: Any, graph: Any, scorer: Any) -> str:
    """What the best layout's context parallelism splits, where its gathers run and what a group shares."""
    context = graph.fx.context
    link = "between nodes" if scorer.priced_across(lay) else "within a node"
    return (f"context parallelism: each sequence's {context.sequence} tokens split over {lay.cp} of the {lay.dp} "
            f"replicas, {context.sequence // lay.cp} per rank (the activations of its tokens; {context.attentions} "
            f"attentions reading the group's gathered keys and values); gathers {link}; each group of {lay.cp} runs "
            f"one replica's share of the batch")
