"""``smp simulate``: predict the step time, throughput and bubble of a P-stage pipeline, up to 1024+ stages,
compare schedules on the same stage costs and links, and show how the step scales with p and m.

Stage costs and links, and each schedule's step on them, come from :mod:`pipeline.stage_pricing`; every schedule runs
through :mod:`pipeline.simulate`. The simulated actions of all schedules are added up before the model is built
(:mod:`smp.cli.limits`). ``--sdp D`` adds the sharded parameters' collectives to the stages and the step
(:mod:`smp.cli.sharded_dp`).
"""
from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from partitioner.units import format_bytes, format_seconds
from smp.cli.context_parallel import context_target
from smp.cli.errors import CLIError
from smp.cli.expert_parallel import expert_target
from smp.cli.limits import check_actions, schedule_actions
from smp.cli.options import (
    RANKS_PER_NODE,
    Options,
    add_plan_args,
    add_target_args,
    check_output,
    duration,
    positive_int,
    size,
)
from smp.cli.plan_table import pipeline_title, priced_for
from smp.cli.sharded_dp import check_budget, sdp_lines
from smp.cli.target import load_target, priced_options, pricing_threads, trace_target
from smp.cli.tensor_parallel import replicated_warnings, shard_target, tp_lines, warn
from smp.cli.text import Progress, ms, table

if TYPE_CHECKING:
    from pipeline.stage_pricing import PipelineCosts

__all__ = ["register", "run", "COMPARED", "check_work", "sim_row"]

# --schedules name -> pipeline.schedule name.
COMPARED = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved-virtual": "interleaved-virtual", "zero-bubble": "zb-h1"}
SPLIT_BACKWARD = {"zb-h1"}  # schedules with a W pass per microbatch and stage
SCALING_SIM_MAX = 1 << 16  # p * m up to which a scaling cell is simulated (well under a second)


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``smp simulate`` to the command's subparsers."""
    p = sub.add_parser("simulate", help="predict step time, throughput and bubble, up to 1024+ stages",
                       description="Predict the step time, throughput and bubble of a pipeline of TARGET, and "
                                   "compare schedules.")
    add_target_args(p)
    add_plan_args(p, microbatches_required=True)
    p.add_argument("--ranks-per-node", type=positive_int, default=RANKS_PER_NODE,
                   help="ranks per node: consecutive stages on one node use the plan's (intra-node) link, "
                        f"stage boundaries between nodes the inter-node link (default {RANKS_PER_NODE})")
    p.add_argument("--inter-node-bandwidth", metavar="SIZE", type=size,
                   help="inter-node bytes per second, e.g. 1.25GB (default: the --inter-node-link's, 1.25GB = "
                        "10 Gb/s Ethernet on cpu)")
    p.add_argument("--inter-node-latency", metavar="TIME", type=duration,
                   help="inter-node latency (default: the --inter-node-link's, 100us on cpu)")
    p.add_argument("--virtual-stages", type=positive_int, default=2,
                   help="model chunks per rank for the interleaved-virtual row (default 2)")
    p.add_argument("--schedules", default="all",
                   help="schedules to compare, comma-separated: gpipe, 1f1b, interleaved-virtual, zero-bubble "
                        "(default all; each takes seconds at 1024 stages x 2048 microbatches)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.set_defaults(func=run)


def _schedule_list(text: str, chosen: str) -> list[str]:
    """The --schedules keys in table order, the chosen pipeline's schedule always among them."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if names == ["all"]:
        names = list(COMPARED)
    bad = [s for s in names if s not in COMPARED]
    if bad or not names:
        raise CLIError(f"--schedules {text!r}: choose from {', '.join(COMPARED)} (comma-separated) or all")
    return [k for k in COMPARED if k in names or k == chosen]


def _skip_virtual(P: int, M: int, V: int) -> str | None:
    if V == 1:
        return "needs --virtual-stages > 1"
    return f"needs microbatches % partitions == 0 (m={M}, p={P})" if M % P else None


def _scaling_cells(P: int, M: int) -> tuple[list[int], list[int], bool]:
    ps = sorted({max(1, P // 4), max(1, P // 2), P})
    ms_ = sorted({max(1, M // 4), max(1, M // 2), M})
    return ps, ms_, P * M <= SCALING_SIM_MAX


def sim_row(name: str, costs: PipelineCosts, microbatches: int, ranks: int, ranks_per_node: int,
            inter: tuple[float, float], virtual: int = 1) -> dict[str, Any]:
    """One schedule simulated on ``costs`` (:func:`pipeline.stage_pricing.simulate_costs`: step, bubble, peak
    activations per rank; with ``--sdp`` the reduce-scatter and all-reduce in the step) as its JSON row."""
    from pipeline.stage_pricing import simulate_costs

    r = simulate_costs(name, costs, microbatches, ranks, ranks_per_node, inter, virtual)
    return {"schedule": name, "virtual_stages": virtual, "predicted_step_s": r.step_s, "bubble": r.bubble,
            "throughput_microbatches_per_s": microbatches / r.step_s if r.step_s > 0 else 0.0,
            "peak_activation_bytes": r.peak_activation_bytes}


def check_work(opts: Options, compared: list[str], V: int) -> None:
    """Refuse up front a comparison (and scaling table) that would not finish in minutes or fit in memory."""
    P, M = opts.partitions, opts.microbatches
    work = {}
    for key in compared:
        name = COMPARED[key]
        if name == "interleaved-virtual":
            if _skip_virtual(P, M, V) is None:
                work[key] = schedule_actions(P * V, M)
        else:
            work[key] = schedule_actions(P, M, name in SPLIT_BACKWARD)
    ps, ms_, simulated = _scaling_cells(P, M)
    if simulated:
        work["scaling table"] = sum(schedule_actions(p, m) for p in ps for m in ms_ if (p, m) != (P, M))
    check_actions(work, opts.max_actions)


def run(ns: argparse.Namespace) -> int:
    """Run ``smp simulate`` on parsed arguments."""
    check_output(ns.json, "--json", (".json",))
    opts = Options.from_args(ns)
    with pricing_threads(opts.partition.device, opts.partitions * opts.tp * opts.sdp * opts.ep * opts.cp):
        return _simulate(ns, opts)


def _simulate(ns: argparse.Namespace, opts: Options) -> int:
    from partitioner import DeviceRates
    from partitioner.sdp.group import group_link
    from pipeline.stage_pricing import pipeline_costs

    compared = _schedule_list(ns.schedules, opts.schedule)
    P, M, V, rpn = opts.partitions, opts.microbatches, ns.virtual_stages, ns.ranks_per_node
    if rpn % opts.tp:
        raise CLIError(f"--tp {opts.tp} does not divide --ranks-per-node {rpn}: a tensor-parallel group must share "
                       "one node's links (NVLink), so choose a degree that divides the ranks of a node")
    check_work(opts, compared, V)
    progress = Progress(ns.quiet)
    target = load_target(ns.target, size=ns.size, batch=ns.batch, progress=progress)
    opts = priced_options(opts, target)
    whole = trace_target(target, progress, opts)
    graph, sharding = shard_target(whole, opts.tp, progress, getattr(ns, "sequence_parallel", False))
    if sharding is not None:
        warn(replicated_warnings(sharding))
    graph = expert_target(context_target(graph, opts.cp, progress), opts.ep, progress)
    rpn //= opts.tp  # pipeline stages per node: each stage's tp group fills tp ranks of it
    progress(f"pricing {P} stages")
    rates = opts.partition.resolve_rates()
    inter = (rates.inter_node_bytes_per_s if ns.inter_node_bandwidth is None else ns.inter_node_bandwidth,
             rates.inter_node_latency_s if ns.inter_node_latency is None else ns.inter_node_latency)

    def sdp_group(ranks: int) -> Any:
        """The sharding group, on its link when a pipeline takes ``ranks`` of the nodes' ``rpn`` (None: no --sdp)."""
        return opts.sharding(group_link(rates, opts.sdp, ranks, rpn, inter)) if opts.sdp > 1 else None

    costs = pipeline_costs(graph, opts.partition, P, sdp=sdp_group(P))
    if costs.sdp:
        check_budget(costs.sdp, opts.partition.budget(rates), opts.sdp)
    rows: dict[str, dict[str, Any]] = {}
    for key in compared:
        name = COMPARED[key]
        if name == "interleaved-virtual":
            label = f"interleaved-virtual (v={V})"
            why = _skip_virtual(P, M, V)
            if why:
                rows[label] = {"schedule": name, "virtual_stages": V, "skipped": why}
                continue
            progress(f"simulating {label}: {P * V} virtual stages x {M} microbatches")
            rows[label] = sim_row(name, pipeline_costs(graph, opts.partition, P * V, exact=costs.exact,
                                                       sdp=sdp_group(P)), M, P, rpn, inter, virtual=V)
        else:
            label = "zero-bubble (ZB-H1)" if name == "zb-h1" else key
            progress(f"simulating {label}: {P} stages x {M} microbatches")
            rows[label] = sim_row(name, costs, M, P, rpn, inter)
    progress("scaling table")
    main_row = rows[opts.schedule]
    scaling = _scaling(graph, opts, costs, rpn, inter, main_row, sdp_group)
    ok = {k: r for k, r in rows.items() if "skipped" not in r}
    best = min(ok, key=lambda k: ok[k]["predicted_step_s"])
    _print(target.spec, graph, opts, costs, rpn, inter, rows, best, scaling)
    tp = _tensor_parallel(whole, graph, opts, costs, main_row["predicted_step_s"])
    sdp = _sharded(opts, costs, sdp_group(P))
    if ns.json:
        out = {"target": target.spec, "partitions": P, "microbatches": M, "pipeline": opts.pipeline,
               "schedule": opts.schedule, "ranks_per_node": rpn, "exact": costs.exact, "note": costs.note,
               "intra_node": {"bytes_per_s": costs.rates.get("link_bytes_per_s"),
                              "latency_s": costs.rates.get("link_latency_s")},
               "inter_node": {"bytes_per_s": inter[0], "latency_s": inter[1]}, "rates": costs.rates,
               "options": opts.partition.to_dict(DeviceRates.from_dict(costs.rates)),
               "stage_forward_s": costs.forward_s, "stage_backward_s": costs.backward_s,
               "predicted_step_s": main_row["predicted_step_s"], "bubble": main_row["bubble"],
               "throughput_microbatches_per_s": main_row["throughput_microbatches_per_s"],
               "schedules": rows, "winner": best, "scaling": scaling}
        if tp:
            out["tensor_parallel"] = tp
        if sdp:
            out["sharded_data_parallel"] = sdp
        try:
            text = json.dumps(out, indent=1, sort_keys=True, allow_nan=False)
        except ValueError:
            raise CLIError(f"--json {ns.json!r}: the results are not finite numbers (predicted step "
                           f"{main_row['predicted_step_s']} s): check the link and stage numbers") from None
        with open(ns.json, "w") as fh:
            fh.write(text + "\n")
        progress(f"wrote {ns.json}")
    return 0


def _print(spec: str, graph: Any, opts: Options, costs: PipelineCosts, rpn: int, inter: tuple[float, float],
           rows: dict[str, dict[str, Any]], best: str, scaling: list[dict[str, Any]]) -> None:
    from partitioner import DeviceRates

    P, M = opts.partitions, opts.microbatches
    main_row = rows[opts.schedule]
    T = sum(costs.forward_s) + sum(costs.backward_s)
    print(f"{spec}: {graph.describe()}" + (f" (tp rank 0 of {opts.tp})" if opts.tp > 1 else ""))
    nodes = (f"{math.ceil(P / rpn)} node(s) of {rpn} ranks" if opts.tp == 1 else
             f"{math.ceil(P / rpn)} node(s) of {rpn * opts.tp} ranks (tp groups of {opts.tp}, {P * opts.tp} ranks)")
    print(f"{P} stages on {nodes}, {M} microbatches, {pipeline_title(opts.pipeline, opts.schedule)}")
    print(priced_for(opts.partition.to_dict(DeviceRates.from_dict(costs.rates)), costs.rates))
    print(f"stage costs: {costs.note}")
    print(f"links: within a node {format_bytes(costs.rates.get('link_bytes_per_s', 0))}/s + "
          f"{format_seconds(costs.rates.get('link_latency_s', 0))} per tensor (the plan's link); between nodes "
          f"{format_bytes(inter[0])}/s + {format_seconds(inter[1])}")
    ideal = M * max(f + b for f, b in zip(costs.forward_s, costs.backward_s))
    print(f"predicted step {format_seconds(main_row['predicted_step_s'])}, throughput "
          f"{main_row['throughput_microbatches_per_s']:.1f} microbatches/s, bubble {100 * main_row['bubble']:.1f}% "
          f"(bottleneck stage x m = {format_seconds(ideal)}; one device would take {format_seconds(M * T)})")
    print()
    print(f"schedules at p={P}, m={M} (same stage costs and links):")
    body = []
    for label, r in rows.items():
        if "skipped" in r:
            body.append([label, "-", "-", "-", "-", r["skipped"]])
            continue
        peak = r.get("peak_activation_bytes")
        body.append([label, format_seconds(r["predicted_step_s"]), f"{r['throughput_microbatches_per_s']:.1f}",
                     f"{100 * r['bubble']:.1f}%", format_bytes(peak) if peak is not None else "-",
                     "<- fastest" if label == best else ""])
    print("\n".join("  " + line for line in table(
        ["schedule", "step", "microbatches/s", "bubble", "peak activations/rank", ""], body, left=(0, 5))))
    chosen = main_row["predicted_step_s"]
    gain = (f", {100 * (1 - rows[best]['predicted_step_s'] / chosen):.1f}% faster than {opts.schedule}"
            if rows[best] is not main_row else f" (the {opts.pipeline} pipeline you chose)")
    print(f"winner: {best}{gain}")
    print()
    simulated = all(r["simulated"] for r in scaling)
    rates = costs.device_rates()
    runtime = (f" + 2 o) + s with the runtime's o = {ms(rates.pass_overhead_s)} ms per pass and s = "
               f"{ms(rates.step_overhead_s)} ms per step" if rates.pass_overhead_s or rates.step_overhead_s else ")")
    how = ("simulated with the links above" if simulated else
           f"equal stages, compute only: (m + p - 1) (T/p{runtime} per step, bubble (p - 1)/(m + p - 1)")
    print(f"how it scales with p and m ({opts.schedule}; a microbatch costs T = {ms(T)} ms of compute, T/p per "
          f"stage; {how}):")
    grid = {(r["p"], r["m"]): r for r in scaling}
    ps, ms_ = sorted({p for p, _ in grid}), sorted({m for _, m in grid})
    cells = [[str(p)] + [f"{format_seconds(grid[(p, m)]['step_s'])} ({100 * grid[(p, m)]['bubble']:.1f}%)"
                         for m in ms_] for p in ps]
    print("\n".join("  " + line for line in table(["p \\ m"] + [str(m) for m in ms_], cells)))
    if not simulated:
        formula = grid[(P, M)]["step_s"]
        print(f"  (too large to simulate every cell quickly; at p={P}, m={M} the simulation above adds "
              f"{format_seconds(main_row['predicted_step_s'] - formula)} of communication to the formula's "
              f"{format_seconds(formula)})")


def _scaling(graph: Any, opts: Options, costs: PipelineCosts, rpn: int, inter: tuple[float, float],
             main_row: dict[str, Any], sdp_group: Callable[[int], Any]) -> list[dict[str, Any]]:
    """The chosen schedule at p in {P/4, P/2, P} x m in {M/4, M/2, M}: simulated with the same pricing rule
    and links as the main result when every cell has p * m <= SCALING_SIM_MAX; otherwise, for every cell, the
    equal-stage compute-only formula (:func:`pipeline.stage_simulation.formula_step`), bubble = (p - 1) / (m + p - 1),
    which the simulator reproduces when communication is free."""
    from pipeline.stage_pricing import pipeline_costs
    from pipeline.stage_simulation import formula_step

    P, M = opts.partitions, opts.microbatches
    total = sum(costs.forward_s) + sum(costs.backward_s)
    ps, ms_, simulated = _scaling_cells(P, M)
    cache: dict[int, PipelineCosts] = {P: costs}
    out = []
    for p in ps:
        for m in ms_:
            if not simulated:
                out.append({"p": p, "m": m, "step_s": formula_step(p, m, total, costs.device_rates()),
                            "bubble": (p - 1) / (m + p - 1), "simulated": False})
                continue
            if (p, m) == (P, M):
                r = main_row
            else:
                if p not in cache:
                    cache[p] = pipeline_costs(graph, opts.partition, p, exact=costs.exact, sdp=sdp_group(p))
                r = sim_row(opts.schedule, cache[p], m, p, rpn, inter)
            out.append({"p": p, "m": m, "step_s": r["predicted_step_s"], "bubble": r["bubble"], "simulated": True})
    return out


def _tensor_parallel(whole: Any, graph: Any, opts: Options, costs: PipelineCosts, step_s: float) -> dict[str, Any]:
    """Print what ``--tp`` does (the tp collectives per microbatch and step, the parameter state per rank) and
    return it for the JSON; nothing for ``--tp 1``."""
    from partitioner.cost.precision import weight_bytes

    if opts.tp == 1:
        return {}
    dtype, M = opts.partition.dtype, opts.microbatches
    record = {"degree": opts.tp, "comm_s": costs.tp_comm_s, "sharding": graph.fx.sharding.to_dict()}
    print()
    print("\n".join(tp_lines(record, costs.rates, M, float(weight_bytes(whole, dtype).sum()),
                             float(weight_bytes(graph, dtype).sum()), dtype, step_s)))
    s = max(range(len(costs.param_state)), key=lambda i: sum(costs.param_state[i].values()))
    held = costs.param_state[s]
    where = f"on stage {s} (the most parameter state" if costs.exact else f"(the model's total / {len(costs.forward_s)}"
    print(f"  per rank {where}; {dtype}, {opts.partition.optimizer}): weights "
          f"{format_bytes(held['weights'])}, gradients {format_bytes(held['gradients'])}, optimizer state "
          f"{format_bytes(held['optimizer'])}, master weights {format_bytes(held['master'])}; activations: the "
          "peak activations/rank column above")
    return {**record, "per_step_s": [M * c for c in costs.tp_comm_s], "param_state": costs.param_state}


def _sharded(opts: Options, costs: PipelineCosts, group: Any) -> dict[str, Any]:
    """Print what ``--sdp`` does (the collectives per microbatch and step, and with a real plan what the rank of the
    largest peak holds) and return it for the JSON; nothing for ``--sdp 1`` (``group`` None)."""
    from partitioner import DeviceRates
    from partitioner.sdp.group import sharded_dp_record

    if group is None:
        return {}
    threshold, link, M = group.threshold, group.link, opts.microbatches
    print()
    if not costs.sdp:  # the model spread evenly over the stages
        print(f"sharded data parallelism: degree {opts.sdp} on {link.link}; per stage (the model's total / "
              f"{len(costs.forward_s)}): all-gathers expose {format_seconds(costs.sdp_gather_s[0])} per microbatch "
              f"(inside the stage costs; the rest hides behind the compute), all-reduce and reduce-scatters "
              f"{format_seconds(costs.sdp_end_s[0])} once per step")
        return {"degree": opts.sdp, "threshold": threshold, "gather_s": costs.sdp_gather_s, "end_s": costs.sdp_end_s}
    rec = sharded_dp_record(costs.sdp, threshold, link, opts.partition.budget(DeviceRates.from_dict(costs.rates)))
    print("\n".join(sdp_lines(rec, M)))
    r = max(costs.sdp, key=lambda x: x.peak_bytes)
    print(f"  per rank on stage {r.rank} (the largest peak; {opts.partition.dtype}, {opts.partition.optimizer}): "
          f"weights {format_bytes(r.weights_bytes)}, gradients {format_bytes(r.gradient_bytes)} at rest and "
          f"{format_bytes(r.gradient_peak_bytes)} in the step, optimizer state {format_bytes(r.optimizer_bytes)}, "
          f"master weights {format_bytes(r.master_bytes)}, gathered {format_bytes(r.gathered_bytes)}, activations "
          f"{format_bytes(r.activation_bytes)} ({opts.schedule}'s microbatches in flight): peak "
          f"{format_bytes(r.peak_bytes)}")
    return rec
