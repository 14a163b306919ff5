"""``smp inspect``: partition TARGET and print the plan, why, and what it costs; write it as JSON and pictures.

The work is bounded before the model is built: the plan and the three baselines are each simulated for
``--microbatches`` (:mod:`smp.cli.limits`), and every output file is checked before anything is computed.
``--sdp D`` prices the plan's ranks with their parameters sharded over D replicas (:mod:`smp.cli.sharded_dp`).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from partitioner.units import format_seconds
from smp.cli.analysis import analyse
from smp.cli.context_parallel import context_target, cp_lines
from smp.cli.drawing import write_graph, write_timeline
from smp.cli.expert_parallel import ep_lines, expert_target
from smp.cli.limits import check_actions, schedule_actions
from smp.cli.options import Options, add_plan_args, add_target_args, check_output
from smp.cli.plan_table import format_report
from smp.cli.sharded_dp import price_plan, sdp_lines
from smp.cli.target import load_target, priced_options, pricing_threads, trace_target
from smp.cli.tensor_parallel import replicated_warnings, shard_target, tp_lines, warn
from smp.cli.text import Progress

__all__ = ["register", "run", "check_work"]

def register(sub: argparse._SubParsersAction) -> None:
    """Add ``smp inspect`` to the command's subparsers."""
    p = sub.add_parser("inspect", help="show the partition plan, why, and what it costs",
                       description="Partition TARGET and print a table per stage, the bounds, the predicted step "
                                   "time and the baselines.")
    add_target_args(p)
    add_plan_args(p)
    p.add_argument("--measure", dest="measure_stages", action="store_true",
                   help="also time every stage's forward+backward for real")
    p.add_argument("--json", metavar="FILE", help="write the plan as JSON")
    p.add_argument("--graph", metavar="FILE", help="draw the module graph coloured by stage (.png, .svg or .dot)")
    p.add_argument("--timeline", metavar="FILE", help="the simulated schedule: Gantt chart (.png) or Chrome trace "
                                                       "(.json)")
    p.add_argument("--seed", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def check_work(opts: Options) -> None:
    """Refuse up front what the plan's, the baselines' (and the measured) simulations would not finish."""
    from partitioner.cut.baselines import BASELINES

    one = schedule_actions(opts.partitions, opts.microbatches)
    work = {name: one for name in ("plan", *BASELINES)}
    if opts.measure_stages:
        work["measured"] = one
    if opts.sdp > 1:
        work["sharded"] = one
    check_actions(work, opts.max_actions)


def run(ns: argparse.Namespace) -> int:
    """Run ``smp inspect`` on parsed arguments."""
    check_output(ns.json, "--json", (".json",))
    check_output(ns.graph, "--graph", (".png", ".svg", ".dot"))
    check_output(ns.timeline, "--timeline", (".png", ".json"))
    opts = Options.from_args(ns)
    check_work(opts)
    with pricing_threads(opts.partition.device, opts.partitions * opts.tp * opts.sdp * opts.ep * opts.cp):
        return _inspect(ns, opts)


def _inspect(ns: argparse.Namespace, opts: Options) -> int:
    progress = Progress(ns.quiet)
    target = load_target(ns.target, size=ns.size, batch=ns.batch, progress=progress)
    opts = priced_options(opts, target)
    whole = trace_target(target, progress, opts)
    graph, sharding = shard_target(whole, opts.tp, progress, getattr(ns, "sequence_parallel", False))
    if sharding is not None:
        warn(replicated_warnings(sharding))
    one_rank = graph  # what one process of the tp group runs on the whole sequence
    graph = expert_target(context_target(graph, opts.cp, progress), opts.ep, progress)
    plan, sim = analyse(graph, opts, target=target, progress=progress)
    if opts.sdp > 1:
        progress(f"pricing parameters sharded over {opts.sdp} replicas")
        price_plan(plan, graph, opts, sim)
    print(f"{target.spec}: {whole.describe()}" + (f"; tp rank 0 of {opts.tp}: {graph.describe()}" if sharding else ""))
    print(format_report(plan, graph))
    if sharding is not None:
        from partitioner.cost.precision import weight_bytes

        dtype = opts.partition.dtype
        print("\n".join(tp_lines(plan.tensor_parallel, plan.rates, opts.microbatches,
                                 float(weight_bytes(whole, dtype).sum()), float(weight_bytes(graph, dtype).sum()),
                                 dtype, plan.extra["schedule"]["predicted_step_s"])))
    if opts.ep > 1:
        from partitioner.cost.precision import weight_bytes

        dtype = opts.partition.dtype
        whole_w, local_w = float(weight_bytes(whole, dtype).sum()), float(weight_bytes(graph, dtype).sum())
        print("\n".join(ep_lines(graph, whole_w, local_w, opts.partition.resolve_rates(), dtype, opts.microbatches,
                                 plan.extra["schedule"]["predicted_step_s"])))
    if opts.cp > 1:
        print("\n".join(cp_lines(graph, one_rank, opts.partition.resolve_rates(), opts.partition.dtype,
                                  opts.microbatches, plan.extra["schedule"]["predicted_step_s"])))
    if opts.sdp > 1:
        print("\n".join(sdp_lines(plan.extra["sharded_data_parallel"], opts.microbatches,
                                   plan.extra["schedule"]["predicted_step_s"])))
    _write_outputs(plan, graph, sim, json_path=ns.json, graph_path=ns.graph, timeline_path=ns.timeline,
                   progress=progress)
    return 0


def _write_outputs(plan: Any, graph: Any, sim: Any, *, json_path: str | None, graph_path: str | None,
                   timeline_path: str | None, progress: Callable[[str], None]) -> None:
    if json_path:
        plan.to_json(json_path)
        progress(f"wrote {json_path}")
    if graph_path:
        write_graph(plan, graph, graph_path)
        progress(f"wrote {graph_path}")
    if timeline_path:
        sched = plan.extra.get("schedule", {})
        title = (f"{plan.extra.get('target', 'model')}: p={plan.num_stages}, m={sched.get('microbatches')}, "
                 f"{sched.get('schedule', '')}, step {format_seconds(sim.step_s)}, bubble {100 * sim.bubble:.0f}%")
        write_timeline(sim, timeline_path, title)
        progress(f"wrote {timeline_path}")
