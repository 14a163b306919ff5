"""``smp plan``: choose the whole layout of a training job on N devices, and write the smp config that runs it.

The search is :mod:`partitioner.layout.search` over the layouts :func:`partitioner.layout.search.candidates` lists
(pp x tp x dp = N, microbatching, schedule, activation checkpointing, ZeRO-1, placement, sharded data parallelism
over a divisor of dp, and for a mixture-of-experts model expert parallelism over a divisor of dp), each priced by
:mod:`partitioner.layout.score` with the pipeline simulator of :func:`pipeline.stage_simulation.pipeline_simulator`
(the schedules and the simulation ``smp simulate`` runs), on tp rank 0's graph at each microbatch size
(:mod:`partitioner.layout.costs`: two traces on meta, whatever the number of sizes; tp with sequence parallelism
where it applies, as the runtime runs it by default). Fixed degrees (``--tp``, ``--pp``, ``--dp``, ``--sdp``,
``--ep``, ``--microbatch-size``) narrow the search; with all of them, one schedule and no
checkpointing, the layout is priced exactly as ``smp simulate`` prices it (``--sequence-parallel`` with tp above 1;
with ``--sdp``, as ``smp simulate --sdp`` with dp = sdp; on one node, as ``smp inspect``).

By default only what ``smp.init`` runs from a config is proposed: the 1F1B and GPipe pipelines (``--schedules`` adds
interleaved virtual stages and zero bubble, which the pipeline runtime has and the smp config cannot select yet),
with or without activation checkpointing (which the script turns on with ``smp.set_activation_checkpointing``) and
ZeRO-1 (``shard_optimizer_state``) or sharded data parallelism (``sharded_data_parallel_degree``). ``--config``
writes the best layout as an smp config (:func:`smp_config`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any

from partitioner.cost.devices import DEVICES, LINKS, PRECISIONS
from smp.cli.errors import CLIError
from smp.cli.options import (
    RANKS_PER_NODE,
    add_target_args,
    budget,
    check_output,
    memory_headroom,
    positive_int,
    times_ops,
)
from smp.cli.plan_output import print_plan
from smp.cli.target import load_target, pricing_threads
from smp.cli.text import Progress

__all__ = ["register", "run", "smp_config", "CONFIG_SCHEDULES"]

# Layout schedule -> the smp config's "pipeline" (SMP's names): what smp.init can run.
CONFIG_SCHEDULES = {"1f1b": "interleaved", "gpipe": "simple"}
_PLACEMENT_NAMES = {"DPT": "cluster"}  # SMP's name where it has one


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``smp plan`` to the command's subparsers."""
    p = sub.add_parser("plan", help="choose the layout (pp x tp x dp, microbatches, schedule) for N devices",
                       description="Search every layout of TARGET on N devices and print the best: degrees, "
                                   "microbatches, schedule, predicted step, throughput, MFU and memory per device.")
    add_target_args(p)
    p.add_argument("--devices", type=positive_int, required=True, help="devices (ranks) the job runs on")
    p.add_argument("--global-batch", type=positive_int, required=True,
                   help="samples per training step over every data-parallel replica")
    p.add_argument("--device", metavar="NAME", choices=DEVICES, default="cpu",
                   help=f"the device profile: {', '.join(DEVICES)} (default cpu: this machine, measured)")
    p.add_argument("--dtype", metavar="NAME", choices=PRECISIONS, default="fp32",
                   help=f"training precision: {', '.join(PRECISIONS)} (default fp32)")
    p.add_argument("--ranks-per-node", type=positive_int,
                   help=f"devices per node (default {RANKS_PER_NODE} on GPU profiles; on cpu all of them, one machine)")
    p.add_argument("--link", metavar="NAME", choices=sorted(LINKS), help="link within a node (default: the device's)")
    p.add_argument("--inter-node-link", metavar="NAME", choices=sorted(LINKS),
                   help="link between nodes (default: the device's)")
    p.add_argument("--device-memory", metavar="SIZE", type=budget,
                   help="memory per device, e.g. 80GB, or unlimited (default: the device's; no limit on cpu)")
    p.add_argument("--optimizer", metavar="NAME", default="adam", help="adam (default), adamw, sgd or none")
    p.add_argument("--tp", type=positive_int, help="fix the tensor-parallel degree")
    p.add_argument("--pp", type=positive_int, help="fix the pipeline-parallel degree")
    p.add_argument("--dp", type=positive_int, help="fix the (reduced) data-parallel degree, SMP's rdp")
    p.add_argument("--sdp", type=positive_int,
                   help="fix the sharded data-parallel degree (a divisor of dp; 1: no sharding; default: try every "
                        "divisor)")
    p.add_argument("--ep", type=positive_int,
                   help="fix the expert-parallel degree of a mixture-of-experts model (a divisor of dp and of every "
                        "layer's experts; 1: none; default: try every such divisor)")
    p.add_argument("--cp", type=positive_int,
                   help="fix the context-parallel degree (a divisor of dp and of the sequence; 1: none; default: try "
                        "every such divisor for sequences of 16,384 tokens or more, else 1)")
    p.add_argument("--sdp-threshold", "--sdp-param-persistence-threshold", dest="sdp_threshold", metavar="N",
                   type=positive_int,
                   help="under sdp, parameters of fewer than N elements stay whole on every replica (SMP's "
                        "sdp_param_persistence_threshold, default 1000000; written to the config); a degree that "
                        "shards nothing is not searched")
    p.add_argument("--memory-headroom", metavar="H", type=memory_headroom,
                   help="memory every device keeps free for the CUDA allocator, context and NCCL: a fraction of the "
                        "budget (0.1, 10%%) or a size (8GiB); layouts use at most the budget less this (default "
                        "10%%: see docs/cli.md)")
    p.add_argument("--microbatch-size", type=positive_int, help="fix the samples per microbatch")
    p.add_argument("--schedules", default="1f1b,gpipe",
                   help="schedules to consider, comma-separated: 1f1b, gpipe, interleaved-virtual, zero-bubble "
                        "(default 1f1b,gpipe: what an smp config runs)")
    p.add_argument("--virtual-stages", type=positive_int, default=2,
                   help="model chunks per rank of interleaved-virtual (default 2)")
    p.add_argument("--checkpointing", default="none,full",
                   help="activation checkpointing to consider: none, full or none,full (default)")
    p.add_argument("--zero1", choices=("auto", "on", "off"), default="auto",
                   help="ZeRO-1, the optimizer state sharded over the dp replicas: auto (try both, default), on, off")
    p.add_argument("--placement", choices=("auto", "cluster", "PDT"), default="auto",
                   help="rank order of the axes: cluster (DPT, SMP's default), PDT, or auto (both)")
    p.add_argument("--estimate", action="store_true",
                   help="on --device cpu, price the ops with the cost model's roofline instead of timing them here")
    p.add_argument("--exhaustive", action="store_true",
                   help="price every layout the bounds cannot rule out (slower; by default the walk stops once "
                        "the optimistic estimate reaches the K-th best)")
    p.add_argument("--top", type=positive_int, default=5, help="layouts to print (default 5)")
    p.add_argument("--json", metavar="FILE", help='write {"layouts": [...]}, best first')
    p.add_argument("--config", metavar="FILE", help="write the best layout as an smp config (smp.init(FILE))")
    p.set_defaults(func=run)


def smp_config(layout: Any, dtype: str, threshold: int | None = None) -> dict[str, Any]:
    """The smp config (:mod:`smp.runtime.config` keys only) that runs ``layout`` trained in ``dtype``, its sdp
    keeping parameters of fewer than ``threshold`` elements whole (None: SMP's default)."""
    if layout.schedule not in CONFIG_SCHEDULES:
        raise CLIError(f"{layout.describe()}: the smp config cannot select this schedule yet (it runs "
                       f"{', '.join(CONFIG_SCHEDULES)}); plan with --schedules 1f1b,gpipe to write a config")
    cfg: dict[str, Any] = {"pipeline_parallel_degree": layout.pp, "microbatches": layout.microbatches,
                           "pipeline": CONFIG_SCHEDULES[layout.schedule], "tensor_parallel_degree": layout.tp,
                           "ddp": layout.tp * layout.dp > 1,
                           "placement_strategy": _PLACEMENT_NAMES.get(layout.placement, layout.placement)}
    if layout.zero1:
        cfg["shard_optimizer_state"] = True
    if layout.ep > 1:
        cfg["expert_parallel_degree"] = layout.ep
    if layout.cp > 1:
        cfg["context_parallel_degree"] = layout.cp
    if layout.sdp > 1:
        cfg["sharded_data_parallel_degree"] = layout.sdp
        if threshold is not None:
            cfg["sdp_param_persistence_threshold"] = threshold
    if layout.tp > 1 and layout.replica_batch % layout.tp or \
            layout.cp > 1 and layout.replica_batch % (layout.tp * layout.cp * layout.microbatches):
        cfg["prescaled_batch"] = True  # the tp (cp) group reads one batch: its ranks' shares would not split
    if dtype in ("bf16", "fp16"):
        cfg[dtype] = True
    return cfg


def _names(text: str, known: tuple[str, ...], flag: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise CLIError(f"{flag} {text!r}: choose from {', '.join(known)} (comma-separated)")
    return names


def _fixed(value: int | None) -> tuple[int, ...] | None:
    """A fixed degree as the one value to search (None: search them all)."""
    return None if value is None else (value,)


def _space(ns: argparse.Namespace, rpn: int) -> Any:
    from partitioner.layout.layout import CHECKPOINTING, SCHEDULES
    from partitioner.layout.search import SearchSpace

    schedules = _names(ns.schedules, SCHEDULES, "--schedules")
    if ns.config and set(schedules) - set(CONFIG_SCHEDULES):
        raise CLIError(f"--config writes an smp config, which runs {' and '.join(CONFIG_SCHEDULES)} only: drop "
                       f"{', '.join(sorted(set(schedules) - set(CONFIG_SCHEDULES)))} from --schedules")
    if ns.tp is not None and rpn % ns.tp:
        raise CLIError(f"--tp {ns.tp} does not divide --ranks-per-node {rpn}: a tensor-parallel group shares one "
                       "node's links; choose a degree that divides the ranks of a node")
    if ns.sdp is not None and ns.sdp > 1 and ns.zero1 == "on":
        raise CLIError(f"--sdp {ns.sdp} with --zero1 on: sharded data parallelism shards the optimizer state already; "
                       "drop one of them")
    if ns.ep is not None and ns.ep > 1 and ((ns.sdp or 1) > 1 or ns.zero1 == "on"):
        raise CLIError(f"--ep {ns.ep} with {'--sdp ' + str(ns.sdp) if (ns.sdp or 1) > 1 else '--zero1 on'}: expert "
                       "parallelism splits the experts over replicas that hold the other parameters and their "
                       "optimizer state whole (the runtime refuses sharded data parallelism with it); drop one of them")
    if ns.cp is not None and ns.cp > 1 and ((ns.sdp or 1) > 1 or (ns.ep or 1) > 1):
        raise CLIError(f"--cp {ns.cp} with {'--sdp ' + str(ns.sdp) if (ns.sdp or 1) > 1 else '--ep ' + str(ns.ep)}: "
                       "context parallelism is not combined with sharded data or expert parallelism yet (the runtime "
                       "refuses context_parallel_degree with them); drop one of them")
    if ns.sdp is not None and ns.dp is not None and ns.dp % ns.sdp:
        raise CLIError(f"--sdp {ns.sdp} does not divide --dp {ns.dp}: the parameters are sharded over that many of "
                       "the dp replicas; choose a divisor of --dp")
    fixed = [(f, v) for f, v in (("--tp", ns.tp), ("--pp", ns.pp), ("--dp", ns.dp)) if v is not None]
    product = math.prod(v for _, v in fixed)
    if ns.devices % product or (len(fixed) == 3 and product != ns.devices):
        raise CLIError(f"{' x '.join(f'{f} {v}' for f, v in fixed)} = {product} does not make --devices "
                       f"{ns.devices}: pp x tp x dp must equal the devices")
    return SearchSpace(devices=ns.devices, global_batch=ns.global_batch, ranks_per_node=rpn, tp=_fixed(ns.tp),
                       pp=_fixed(ns.pp), dp=_fixed(ns.dp), sdp=_fixed(ns.sdp), ep=_fixed(ns.ep), cp=_fixed(ns.cp),
                       microbatch_size=_fixed(ns.microbatch_size), schedules=schedules,
                       virtual_stages=(ns.virtual_stages,),
                       checkpointing=_names(ns.checkpointing, CHECKPOINTING, "--checkpointing"),
                       zero1={"auto": (False, True), "on": (True,), "off": (False,)}[ns.zero1],
                       placements={"auto": ("DPT", "PDT"), "cluster": ("DPT",), "PDT": ("PDT",)}[ns.placement])


def run(ns: argparse.Namespace) -> int:
    """Run ``smp plan`` on parsed arguments."""
    from partitioner.cut.options import PartitionOptions

    check_output(ns.json, "--json", (".json",))
    check_output(ns.config, "--config", (".json",))
    rpn = ns.ranks_per_node or (ns.devices if ns.device == "cpu" else RANKS_PER_NODE)
    space = _space(ns, rpn)
    try:
        options = PartitionOptions(device=ns.device, dtype=ns.dtype, link=ns.link, inter_node_link=ns.inter_node_link,
                                   device_memory=ns.device_memory, optimizer=ns.optimizer)
    except (TypeError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    progress = Progress(ns.quiet)
    start = time.perf_counter()
    target = load_target(ns.target, size=ns.size, batch=ns.batch, progress=progress)
    with pricing_threads(ns.device, ns.devices):
        return _plan(ns, target, space, options, rpn, progress, start)


def _plan(ns: argparse.Namespace, target: Any, space: Any, options: Any, rpn: int, progress: Any,
          start: float) -> int:
    from partitioner.layout.costs import head_counts, layout_costs
    from partitioner.layout.headroom import DEFAULT as DEFAULT_HEADROOM
    from partitioner.layout.score import LayoutScorer, Pricing
    from partitioner.layout.search import candidates, search, tp_choices
    from partitioner.sdp.shards import PERSISTENCE_THRESHOLD
    from pipeline.stage_simulation import pipeline_simulator
    from smp.engine.materialize import has_meta

    tps = [t for t in tp_choices(ns.devices, rpn, head_counts(target.model)) if ns.tp in (None, t)]
    if not tps:
        raise CLIError(f"no tensor-parallel degree divides --devices {ns.devices}, --ranks-per-node {rpn} and the "
                       f"model's attention heads {head_counts(target.model)}" + (f" (--tp {ns.tp})" if ns.tp else ""))
    sizes = {lay.microbatch_size for lay in candidates(dataclasses.replace(space, ep=None), tps)}  # experts unknown
    if not sizes:
        raise CLIError(f"no pp x tp x dp = {ns.devices} splits --global-batch {ns.global_batch} into equal "
                       "microbatches with these fixed degrees; change the batch, the devices or the degrees")
    pricing = Pricing(options, rpn, sdp_threshold=ns.sdp_threshold or PERSISTENCE_THRESHOLD,
                      headroom=ns.memory_headroom or DEFAULT_HEADROOM)
    # Timed as smp inspect times them (a meta model cannot run: the roofline then).
    timed = times_ops(ns.device, ns.dtype, ns.estimate) and not has_meta(target.model)
    costs = layout_costs(target.model, target.args, target.kwargs, sizes=sizes, tp_degrees=tps,
                         rates=pricing.rates, dtype=ns.dtype, progress=progress, timed=timed)
    for tp, why in sorted(costs.skipped.items()):
        progress(f"tp {tp} left out: {why}")
    _check_ep(ns.ep, costs.experts)
    unsharded = _unsharded(ns, costs, pricing.sdp_threshold, progress)
    whole = next(iter(costs.whole.traced.values()))
    space = dataclasses.replace(space, max_stages=sum(k != "output" for k in whole.kinds))
    progress(f"searching layouts of {ns.devices} devices")
    scorer = LayoutScorer(costs, pricing, pipeline_simulator)
    result = search(candidates(space, costs.tp_degrees, unsharded, costs.experts, costs.sequence), scorer, ns.top,
                    exhaustive=ns.exhaustive)
    elapsed = time.perf_counter() - start
    best = result.proposals[0]
    print_plan(ns, target.spec, costs, scorer, result, rpn, elapsed,
               _config_or_none(best.layout, ns.dtype, ns.sdp_threshold))
    if ns.json:
        rows = [{**p.to_dict(), "smp_config": _config_or_none(p.layout, ns.dtype, ns.sdp_threshold)}
                for p in result.proposals]
        device = scorer.device_budget
        out = {"target": target.spec, "devices": ns.devices, "global_batch": ns.global_batch, "device": ns.device,
               "dtype": ns.dtype, "ranks_per_node": rpn, "budget_bytes": scorer.budget, "device_memory_bytes": device,
               "memory_headroom_bytes": None if device is None or scorer.budget is None else device - scorer.budget,
               "search": {"enumerated": result.enumerated, "memory_pruned": result.memory_pruned,
                          "bound_pruned": result.bound_pruned, "unsharded": result.unsharded,
                          "scored": result.scored, "partitions": result.partitions, "seconds": elapsed},
               "layouts": rows}
        with open(ns.json, "w") as fh:
            fh.write(json.dumps(out, indent=1, allow_nan=False) + "\n")
        progress(f"wrote {ns.json}")
    if ns.config:
        _write_config(ns.config, best.layout, ns.dtype, progress, _cut(scorer, best.layout), ns.sdp_threshold)
    return 0


def _check_ep(ep: int | None, experts: tuple[int, ...]) -> None:
    """Refuse a fixed ``--ep`` above 1 that the model's expert layers (``experts`` each) cannot be split over."""
    if ep is None or ep == 1:
        return
    if not experts:
        raise CLIError(f"--ep {ep}: this model has no mixture-of-experts layer expert parallelism can split; drop --ep")
    odd = sorted({x for x in experts if x % ep})
    if odd:
        raise CLIError(f"--ep {ep} does not divide the {odd} experts of this model's layers: choose a divisor of "
                       "every layer's experts")


def _unsharded(ns: argparse.Namespace, costs: Any, threshold: int, progress: Any) -> set[int]:
    """The tp degrees under which sdp would shard nothing (:func:`partitioner.layout.sharded.unsharded_tps`), said
    once; a fixed ``--sdp`` above 1 that shards nothing at every tp degree is refused with the fix."""
    from partitioner.layout.sharded import unsharded_tps

    found = unsharded_tps(costs, threshold)
    if not found or ns.sdp == 1:
        return set(found)
    first = next(iter(found.values()))
    lower = (f"lower --sdp-threshold to {first.largest_numel:,} or less to shard the parameters of that many "
             "elements or more" if first.largest else "")
    everywhere = set(found) >= set(costs.tp_degrees)
    if ns.sdp is not None and everywhere:
        raise CLIError(f"--sdp {ns.sdp} would shard nothing: {first.why_none()} (--sdp-threshold, SMP's "
                       f"sdp_param_persistence_threshold); every parameter would stay whole and be all-reduced as "
                       f"without it. Fix: {lower + ', or ' if lower else ''}drop --sdp")
    where = "" if everywhere else f" at tp {', '.join(map(str, sorted(found)))}"
    progress(f"sdp above 1 left out{where}, where it would shard nothing: {first.why_none()}"
             + (f"; {lower}" if lower else ""))
    return set(found)


def _cut(scorer: Any, layout: Any) -> Any:
    """The partition the planner priced for ``layout`` (None for one stage, or with tensor or expert parallelism,
    where a run partitions its own shards), its example inputs at the layout's microbatch size."""
    from partitioner.capture.plan_inputs import record_at_batch

    if layout.pp == 1 or layout.tp > 1 or layout.ep > 1:
        return None
    plan = scorer.plan(layout)
    return dataclasses.replace(plan, inputs=record_at_batch(plan.inputs, layout.microbatch_size))


def _config_or_none(layout: Any, dtype: str, threshold: int | None = None) -> dict[str, Any] | None:
    return smp_config(layout, dtype, threshold) if layout.schedule in CONFIG_SCHEDULES else None


def _write_config(path: str, layout: Any, dtype: str, progress: Any, cut: Any, threshold: int | None) -> None:
    """Write the smp config of ``layout``, checked by smp's own parser first, and beside it the partition ``cut``
    (``FILE`` ending ``.plan.json``, the config's ``partition_file``: the run trains the cut that was priced, not
    one it makes again from ops it times anew); say what the script must do (with a cut: call the model with the
    inputs it was traced from)."""
    from partitioner.capture.plan_inputs import traced_call
    from smp.runtime.config import load_config

    cfg, checked = smp_config(layout, dtype, threshold), {}
    if cut is not None:
        plan_path = os.path.splitext(path)[0] + ".plan.json"
        cut.to_json(plan_path)
        progress(f"wrote {plan_path}")
        cfg["partition_file"] = os.path.basename(plan_path)  # a config file's paths are relative to its folder
        checked["partition_file"] = plan_path
    load_config({**cfg, **checked})  # what smp.init will read: refuse to write a config it would refuse
    with open(path, "w") as fh:
        fh.write(json.dumps(cfg, indent=1) + "\n")
    progress(f"wrote {path}")
    if "prescaled_batch" in cfg:  # every rank of a tp group reads its replica's whole batch
        per_rank, over = layout.replica_batch, "smp.rdp_size()"
    else:
        per_rank, over = layout.replica_batch // layout.tp, "smp.dp_size()"
    notes = [f"each rank's batch: {per_rank} samples per step (the global batch {layout.global_batch} over "
             f"{over} ranks)"]
    if cut is not None and cut.inputs:
        notes.append(f"the plan was traced from {traced_call(cut.inputs)}; the step must call the model with exactly "
                     "these inputs (a labels= keyword traces the loss too: return it among the factory's example "
                     "inputs to plan it)")
    if layout.checkpointing == "full":
        notes.append("this layout recomputes activations: call smp.set_activation_checkpointing(block) on every "
                     "block of the model in the script (the smp config has no key for it)")
    for note in notes:
        print(f"smp: {note}", file=sys.stderr)
