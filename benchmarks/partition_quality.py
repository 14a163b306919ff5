"""Partition quality on the model zoo: predicted balance, baselines, cut bytes, and *measured* balance.

For every zoo model and stage count this prints one row:

* ``lower bound``: max(total predicted compute / stages, largest op) -- no plan can beat it;
* ``ours``: the predicted balance (bottleneck / lower bound; bottleneck includes communication) of
  ``partitioner.partition`` and the method that won the portfolio;
* ``uniform / params / layers``: the same number for the three baselines of :mod:`partitioner.cut.baselines`,
  scored by the same cost model;
* ``cut`` bytes per microbatch, ours and each baseline's;
* ``dominated``: whether some baseline is at least as good as ours in bottleneck, cut bytes and largest-stage
  memory and strictly better in one (the goal is "no");
* ``part s``: wall time of ``partition()``;
* ``measured``: the balance of *real* per-stage time -- every stage's forward and backward timed separately
  in this process (median over ``--repeats``), ``max(stage) / (sum / stages)``.

How a stage is timed: the stages run forward in order on real tensors; every float tensor a stage receives
from an earlier stage is detached into a fresh leaf, so each stage's backward is its own autograd graph.
Then, from the last stage to the first, ``torch.autograd.backward`` runs on the stage's outputs with the
gradients that the later stages left on their input leaves (the last stage's outputs get a fixed random
gradient, standing in for the loss). Forward and backward are timed separately and summed per stage.

Run: ``python benchmarks/partition_quality.py [--models gpt2,bert] [--stages 2,4,8] [--repeats 7]``.
One thread (``torch.set_num_threads(1)``), fp32, batch 4, ``size="base"`` (every model then has >= 8
repeated blocks). The quality table uses ``memory_weight=0.0`` (pure speed); ``--memory-weight 0.2``
shows SMP's default blend instead.

``--llama`` prints predicted rows instead for Llama-shaped models built on the meta device (no weights):
a Llama-2-7B shape (32 layers, hidden 4096) and a Llama-3-70B shape (80 layers, hidden 8192, 64 heads / 8
KV heads, vocabulary 128256), sequence 2048, one sequence per microbatch, planned for ``--device``
(``h100-80gb``) in ``--dtype`` (``bf16``) with 16 microbatches of 1F1B and no memory limit (at these stage
counts a 70B model does not fit 80 GB with Adam; ``fits`` says whether our plan would); ``--stages``
defaults to 4,8,16 there. Goals: balance <= 1.03 for the 70B shape on 8 stages (with the default
``memory_weight=0.0``: a memory weight trades balance for memory on purpose), never dominated, under 30 s
per plan.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import partitioner  # noqa: E402
from benchmarks.common import llama_on_meta, load_average  # noqa: E402
from partitioner.capture.stage_modules import split  # noqa: E402
from partitioner.cut.baselines import BASELINES, all_baselines  # noqa: E402
from partitioner.cut.dp import dp_partition  # noqa: E402
from partitioner.cut.objective import Problem, dominates, evaluate  # noqa: E402
from partitioner.cut.portfolio import make_problem  # noqa: E402
from smp import zoo  # noqa: E402

# Predicted-balance goal applies where every stage gets at least two repeated blocks.
BALANCE_GOAL_MODELS = ("gpt2", "bert", "vit")
BALANCE_GOAL = 1.05
MEASURED_GOAL = 1.15


def balance(times: list[float]) -> float:
    """max / mean of per-stage seconds."""
    return max(times) / (sum(times) / len(times))


def time_stages(graph: partitioner.OpGraph, assignment: dict[str, int], num_stages: int, args: tuple,
                kwargs: dict, repeats: int) -> partitioner.StageTimes:
    """Every stage's forward and backward timed on this thread's CPU time (see the module docstring)."""
    return partitioner.measure_stages(split(graph, assignment, num_stages), args, kwargs, repeats=repeats)


def _dominated_by(ours: partitioner.PartitionPlan, base: dict[str, partitioner.PartitionPlan]) -> list[str]:
    """The baselines at least as good as ``ours`` in bottleneck, cut bytes and largest-stage memory, and
    strictly better in one."""
    return [b for b, bp in base.items() if dominates(bp.axes, ours.axes)]


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def granularity_floor(graph: partitioner.OpGraph, costs, k: int) -> float:
    """The smallest max/mean stage time any contiguous plan reaches with these per-op costs and free
    communication: how far balance is limited by the size of the ops themselves."""
    free = dataclasses.replace(partitioner.DeviceRates(), link_bytes_per_s=1e30, link_latency_s=0.0)
    p = Problem(graph=graph, costs=costs, num_stages=k, rates=free,
                options=partitioner.PartitionOptions(memory_weight=0.0))
    ev = evaluate(p, dp_partition(p)[0])  # the fastest contiguous plan
    return float(ev.compute_s.max() / (ev.compute_s.sum() / k))


# (layers, hidden, intermediate, heads, KV heads, vocabulary) of Llama-2-7B and Llama-3-70B.
LLAMA_SHAPES = {"llama-7b": (32, 4096, 11008, 32, 32, 32000), "llama-70b": (80, 8192, 28672, 64, 8, 128256)}
LLAMA_BALANCE_GOAL = 1.03
PLAN_TIME_GOAL_S = 30.0


def llama_meta(shape: str, seq: int = 2048) -> tuple[torch.nn.Module, tuple]:
    """A Llama-shaped causal LM (``shape``: a key of :data:`LLAMA_SHAPES`) on the meta device and one sequence."""
    return llama_on_meta(LLAMA_SHAPES[shape], seq)


def llama_rows(opts: argparse.Namespace) -> list[str]:
    """Predicted quality of our plans and the baselines' on meta-built Llama shapes; returns missed goals."""
    stage_counts = [int(s) for s in (opts.stages if opts.stages != "2,4,8" else "4,8,16").split(",") if s]
    options = partitioner.PartitionOptions(device=opts.device, dtype=opts.dtype, microbatches=16,
                                           memory_weight=opts.memory_weight, device_memory="unlimited")
    rates = options.resolve_rates()
    print(f"# Llama shapes on the meta device, seq 2048, 1 sequence per microbatch; {opts.device}, {opts.dtype}, "
          f"16 microbatches 1F1B, memory_weight={opts.memory_weight}, no memory limit; {load_average()}")
    cols = "".join(f" {b:>8}" for b in BASELINES) + f" {'cut GiB':>8}"
    cols += "".join(f" {b[:6] + ' cut':>10}" for b in BASELINES)
    cols += f" {'mem GiB':>8}" + "".join(f" {b[:6] + ' mem':>10}" for b in BASELINES)
    head = f"{'model':<10} {'k':>3} {'ours':>6} {'method':>8}{cols} {'fits':>4} {'dominated':>9} {'part s':>7}"
    print(head)
    print("-" * len(head))
    failures = []
    for shape in LLAMA_SHAPES:
        t0 = time.perf_counter()
        model, args = llama_meta(shape)
        graph = partitioner.trace(model, args)
        print(f"# {shape}: {graph.describe()}, built and traced in {time.perf_counter() - t0:.0f} s", flush=True)
        for k in stage_counts:
            t0 = time.perf_counter()
            plan = partitioner.partition(graph, k, options)
            t_part = time.perf_counter() - t0
            base = all_baselines(make_problem(graph, k, options))
            dominated = _dominated_by(plan, base)
            gib = 2.0 ** 30
            fits = plan.max_memory_bytes <= rates.memory_bytes if rates.memory_bytes else True
            print(f"{shape:<10} {k:>3} {plan.balance:>6.3f} {plan.method:>8}"
                  + "".join(f" {bp.balance:>8.3f}" for bp in base.values())
                  + f" {plan.cut_bytes / gib:>8.3f}" + "".join(f" {bp.cut_bytes / gib:>10.3f}" for bp in base.values())
                  + f" {plan.max_memory_bytes / gib:>8.1f}"
                  + "".join(f" {bp.max_memory_bytes / gib:>10.1f}" for bp in base.values())
                  + f" {'yes' if fits else 'no':>4} {(','.join(dominated) or 'no'):>9} {t_part:>7.1f}", flush=True)
            if shape == "llama-70b" and k == 8 and opts.memory_weight == 0 and plan.balance > LLAMA_BALANCE_GOAL:
                failures.append(f"{shape} k={k}: balance {plan.balance:.3f} > {LLAMA_BALANCE_GOAL}")
            if dominated:
                failures.append(f"{shape} k={k}: dominated by {', '.join(dominated)}")
            if t_part > PLAN_TIME_GOAL_S:
                failures.append(f"{shape} k={k}: partition() took {t_part:.1f} s > {PLAN_TIME_GOAL_S:.0f} s")
    print(f"# {load_average()}")
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(zoo.NAMES), help="comma-separated zoo names")
    ap.add_argument("--stages", default="2,4,8", help="comma-separated stage counts")
    ap.add_argument("--repeats", type=int, default=7, help="timed repeats per stage (median)")
    ap.add_argument("--size", default="base", choices=zoo.SIZES)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--memory-weight", type=float, default=0.0)
    ap.add_argument("--no-measure", action="store_true", help="skip every timed column (predictions only)")
    ap.add_argument("--no-measured-costs", action="store_true",
                    help="skip the floor and the measure=True plan (the slowest columns)")
    ap.add_argument("--measure-baselines", action="store_true",
                    help="also time the baselines' stages (measured balance per baseline)")
    ap.add_argument("--verbose", action="store_true", help="per-stage predicted vs measured milliseconds")
    ap.add_argument("--llama", action="store_true",
                    help="predicted rows for meta-built Llama 7B/70B shapes instead of the zoo (stages 4,8,16)")
    ap.add_argument("--device", default="h100-80gb", choices=partitioner.DEVICES, help="with --llama")
    ap.add_argument("--dtype", default="bf16", choices=partitioner.PRECISIONS, help="with --llama")
    opts = ap.parse_args(argv)

    torch.set_num_threads(1)
    if opts.llama:
        failures = llama_rows(opts)
        for f in failures:
            print(f"# MISSED: {f}")
        if not failures:
            print("# all goals met")
        return 0
    models = [m for m in opts.models.split(",") if m]
    stage_counts = [int(s) for s in opts.stages.split(",") if s]
    with_costs = not (opts.no_measure or opts.no_measured_costs)
    rates = partitioner.calibrate()
    print(f"# partition quality: size={opts.size}, batch={opts.batch}, fp32, 1 thread, "
          f"memory_weight={opts.memory_weight} ({'pure speed' if opts.memory_weight == 0 else 'speed + memory'})")
    print(f"# calibrated rates: {rates.flops_per_s / 1e9:.0f} GFLOP/s, {rates.bytes_per_s / 1e9:.1f} GB/s streaming, "
          f"{rates.grad_bytes_per_s / 1e9:.2f} GB/s fresh writes, {rates.op_overhead_s * 1e6:.1f} us/op; link "
          f"{rates.link_bytes_per_s / 1e9:.1f} GB/s + {rates.link_latency_s * 1e6:.0f} us")
    print("# ours/baselines = predicted balance (bottleneck / lower bound, comm included); cut = bytes crossing "
          "stages per microbatch;\n# dominated = a baseline as good in bottleneck and cut and better in one; "
          "p.comp = predicted max/mean stage compute (no comm: what 'measured' checks);\n# "
          f"measured = max/mean stage time (fwd+bwd CPU time, median of {opts.repeats}; m.best: fastest repeat);\n"
          "# floor = best max/mean any contiguous plan reaches with per-op measured costs (op granularity); "
          "m.pred / m.meas = the plan of partition(measure=True)")
    bl_cols = "".join(f" {b:>8}" for b in BASELINES)
    cut_cols = "".join(f" {b[:7] + ' cut':>11}" for b in BASELINES)
    meas_cols = "".join(f" {'m.' + b[:6]:>8}" for b in BASELINES) if opts.measure_baselines else ""
    cost_cols = f" {'floor':>6} {'m.pred':>6} {'m.meas':>6}" if with_costs else ""
    head = (f"{'model':<10} {'k':>2} {'blk/st':>6} {'LB ms':>8} {'ours':>6} {'method':>6}{bl_cols}"
            f" {'cut MiB':>8}{cut_cols} {'dominated':>9} {'part s':>7} {'p.comp':>6} {'measured':>8} {'m.best':>7}"
            f"{cost_cols}{meas_cols}")
    print(head)
    print("-" * len(head))
    failures: list[str] = []
    t_start = time.perf_counter()
    for name in models:
        zm = zoo.build(name, batch=opts.batch, size=opts.size)
        g = partitioner.trace(zm.model, zm.args, zm.kwargs)
        n_blocks = len(zm.model.get_submodule(zm.blocks))
        op_costs = partitioner.measure(g, zm.args, zm.kwargs, rates=rates) if with_costs else None
        for k in stage_counts:
            t0 = time.perf_counter()
            plan = partitioner.partition(g, k, memory_weight=opts.memory_weight, rates=rates)
            t_part = time.perf_counter() - t0
            problem = make_problem(g, k, memory_weight=opts.memory_weight, rates=rates)
            base = all_baselines(problem)
            dominated = _dominated_by(plan, base)
            measured = f"{'-':>8} {'-':>7}"
            times = None
            if not opts.no_measure:
                times = time_stages(g, plan.assignment, k, zm.args, zm.kwargs, opts.repeats)
                measured = f"{balance(times.total_s):>8.3f} {balance(times.best_s):>7.3f}"
            cc = ""
            floor = None
            if with_costs:
                floor = granularity_floor(g, op_costs, k)
                mplan = partitioner.partition(g, k, memory_weight=opts.memory_weight, rates=rates, measure=True,
                                              example_inputs=zm.args, example_kwargs=zm.kwargs)
                mtimes = time_stages(g, mplan.assignment, k, zm.args, zm.kwargs, opts.repeats)
                cc = f" {floor:>6.3f} {mplan.balance:>6.3f} {balance(mtimes.total_s):>6.3f}"
            mb = ""
            if opts.measure_baselines and not opts.no_measure:
                mb = "".join(
                    f" {balance(time_stages(g, bp.assignment, k, zm.args, zm.kwargs, opts.repeats).total_s):>8.3f}"
                    for bp in base.values())
            blk = n_blocks / k
            comp = [st.forward_s + st.backward_s for st in plan.stages]
            p_comp = max(comp) / (sum(comp) / k)
            print(f"{name:<10} {k:>2} {blk:>6.1f} {plan.lower_bound * 1e3:>8.2f} {plan.balance:>6.3f} "
                  f"{plan.method:>6}" + "".join(f" {bp.balance:>8.3f}" for bp in base.values())
                  + f" {_mib(plan.cut_bytes):>8}" + "".join(f" {_mib(bp.cut_bytes):>11}" for bp in base.values())
                  + f" {(','.join(dominated) or 'no'):>9} {t_part:>7.3f} {p_comp:>6.3f} {measured}{cc}{mb}", flush=True)
            if opts.verbose and times is not None:
                pred = [s.forward_s + s.backward_s for s in plan.stages]
                print("    predicted compute ms: " + " ".join(f"{x * 1e3:7.2f}" for x in pred))
                print("    predicted comm ms:    " + " ".join(f"{s.comm_s * 1e3:7.2f}" for s in plan.stages))
                print("    measured fwd ms:      " + " ".join(f"{x * 1e3:7.2f}" for x in times.forward_s))
                print("    measured bwd ms:      " + " ".join(f"{x * 1e3:7.2f}" for x in times.backward_s))
            if name in BALANCE_GOAL_MODELS and blk >= 2 and plan.balance > BALANCE_GOAL:
                failures.append(f"{name} k={k}: predicted balance {plan.balance:.3f} > {BALANCE_GOAL}")
            if dominated:
                failures.append(f"{name} k={k}: dominated by {', '.join(dominated)}")
            if times is not None and balance(times.total_s) > MEASURED_GOAL:
                why = (f" (op granularity: no contiguous plan beats {floor:.3f})"
                       if floor is not None and floor > MEASURED_GOAL else "")
                failures.append(f"{name} k={k}: measured balance {balance(times.total_s):.3f} > {MEASURED_GOAL}{why}")
    print(f"# total {time.perf_counter() - t_start:.0f} s")
    print(f"# goals: predicted balance <= {BALANCE_GOAL} on {', '.join(BALANCE_GOAL_MODELS)} with >= 2 blocks "
          f"per stage; no baseline dominates; measured balance <= {MEASURED_GOAL}")
    for f in failures:
        print(f"# MISSED: {f}")
    if not failures:
        print("# all goals met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
