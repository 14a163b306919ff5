"""Partition quality on the model zoo: predicted balance, baselines, cut bytes, and *measured* balance.

For every zoo model and stage count this prints one row:

* ``lower bound``: max(total predicted compute / stages, largest op) -- no plan can beat it;
* ``ours``: the predicted balance (bottleneck / lower bound; bottleneck includes communication) of
  ``partitioner.partition`` and the method that won the portfolio;
* ``uniform / params / layers``: the same number for the three baselines of :mod:`partitioner.baselines`,
  scored by the same cost model;
* ``cut`` bytes per microbatch, ours and each baseline's;
* ``dominated``: whether some baseline is at least as good as ours in both bottleneck and cut bytes and
  strictly better in one (the goal is "no");
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
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import partitioner  # noqa: E402
from partitioner import zoo  # noqa: E402
from partitioner.baselines import BASELINES, all_baselines  # noqa: E402
from partitioner.objective import Problem, evaluate  # noqa: E402
from partitioner.partition import dp_partition, make_problem  # noqa: E402
from partitioner.split import MODEL_INPUT, split  # noqa: E402
from partitioner.trace import flatten_inputs  # noqa: E402

# Predicted-balance goal applies where every stage gets at least two repeated blocks.
BALANCE_GOAL_MODELS = ("gpt2", "bert", "vit")
BALANCE_GOAL = 1.05
MEASURED_GOAL = 1.15


@dataclass
class StageTimes:
    forward_s: list[float]            # medians
    backward_s: list[float]
    best_s: list[float]               # fastest repeat of forward + backward, per stage

    @property
    def total_s(self) -> list[float]:
        return [f + b for f, b in zip(self.forward_s, self.backward_s)]

    @property
    def balance(self) -> float:
        """max / mean of the per-stage medians (forward median + backward median)."""
        tot = self.total_s
        return max(tot) / (sum(tot) / len(tot))

    @property
    def best_balance(self) -> float:
        """max / mean of each stage's fastest repeat (other load only ever adds time)."""
        return max(self.best_s) / (sum(self.best_s) / len(self.best_s))


def _is_grad_tensor(v) -> bool:
    return isinstance(v, torch.Tensor) and v.requires_grad


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def time_stages(graph: partitioner.OpGraph, assignment: dict[str, int], num_stages: int, args: tuple,
                kwargs: dict, repeats: int, clock: str = "cpu") -> StageTimes:
    """Median forward and backward seconds of every stage, each stage timed on its own (see module doc).

    ``clock="cpu"`` reads this thread's CPU time (one intra-op thread: the ops and the autograd engine's
    CPU work all run on it), which a shared, busy machine does not inflate; ``"wall"`` reads wall time."""
    now = CLOCKS[clock]
    sm = split(graph, assignment, num_stages)
    flat = flatten_inputs(sm.program, args, kwargs)
    params = [p for s in sm.stages for p in s.module.parameters()]
    fwd: list[list[float]] = [[] for _ in sm.stages]
    bwd: list[list[float]] = [[] for _ in sm.stages]
    gen = torch.Generator().manual_seed(0)
    out_grads: list | None = None
    for rep in range(repeats + 1):  # the first pass warms up and is not counted
        for p in params:
            p.grad = None
        values = dict(zip(sm.program.input_names, flat))
        leaves: list[dict[str, torch.Tensor]] = []
        outs_of: list[tuple] = []
        for st in sm.stages:
            ins, mine = [], {}
            for name in st.inputs:
                v = values[name]
                if st.sources[name] != MODEL_INPUT and _is_grad_tensor(v):
                    v = v.detach().requires_grad_(True)
                    mine[name] = v
                ins.append(v)
            t0 = now()
            outs = st.module(*ins)
            t1 = now()
            if rep:
                fwd[st.index].append(t1 - t0)
            values.update(zip(st.outputs, outs))
            leaves.append(mine)
            outs_of.append(tuple(outs))
        if out_grads is None:
            out_grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) if _is_grad_tensor(o) else None
                         for o in outs_of[-1]]
        for st in reversed(sm.stages):
            tensors, grads = [], []
            for i, (name, o) in enumerate(zip(st.outputs, outs_of[st.index])):
                if not _is_grad_tensor(o):
                    continue
                if st.index == num_stages - 1:
                    g = out_grads[i]
                else:
                    parts = [leaves[c][name].grad for c in st.consumers.get(name, [])
                             if name in leaves[c] and leaves[c][name].grad is not None]
                    if not parts:
                        continue
                    g = parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)
                tensors.append(o)
                grads.append(g)
            t0 = now()
            if tensors:
                torch.autograd.backward(tensors, grads)
            t1 = now()
            if rep:
                bwd[st.index].append(t1 - t0)
    for p in params:
        p.grad = None
    return StageTimes([statistics.median(t) for t in fwd], [statistics.median(t) for t in bwd],
                      [min(f + b for f, b in zip(tf, tb)) for tf, tb in zip(fwd, bwd)])


def _dominates(b, ours, rel: float = 1e-9) -> bool:
    """``b`` is at least as good as ``ours`` in bottleneck and cut bytes, and strictly better in one."""
    bt, ot = b.bottleneck, ours.bottleneck
    no_worse = bt <= ot * (1 + rel) and b.cut_bytes <= ours.cut_bytes
    better = bt < ot * (1 - rel) or b.cut_bytes < ours.cut_bytes
    return no_worse and better


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def granularity_floor(graph: partitioner.OpGraph, costs, k: int) -> float:
    """The smallest max/mean stage time any contiguous plan reaches with these per-op costs and free
    communication: how far balance is limited by the size of the ops themselves."""
    free = dataclasses.replace(partitioner.DeviceRates(), link_bytes_per_s=1e30, link_latency_s=0.0)
    p = Problem(graph=graph, costs=costs, num_stages=k, rates=free, memory_weight=0.0)
    ev = evaluate(p, dp_partition(p))
    return float(ev.compute_s.max() / (ev.compute_s.sum() / k))


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
    ap.add_argument("--clock", default="cpu", choices=sorted(CLOCKS),
                    help="cpu: this thread's CPU time (robust on a busy machine); wall: wall-clock time")
    ap.add_argument("--verbose", action="store_true", help="per-stage predicted vs measured milliseconds")
    opts = ap.parse_args(argv)

    torch.set_num_threads(1)
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
          f"measured = max/mean stage time (fwd+bwd {opts.clock} time, median of {opts.repeats}; m.best: fastest repeat);\n"
          "# floor = best max/mean any contiguous plan reaches with per-op measured costs (op granularity); "
          "m.pred / m.meas = the plan of partition(measure=True)")
    bl_cols = "".join(f" {b:>8}" for b in BASELINES)
    cut_cols = "".join(f" {b[:7] + ' cut':>11}" for b in BASELINES)
    meas_cols = "".join(f" {'m.' + b[:6]:>8}" for b in BASELINES) if opts.measure_baselines else ""
    cost_cols = f" {'floor':>6} {'m.pred':>6} {'m.meas':>6}" if with_costs else ""
    head = (f"{'model':<10} {'k':>2} {'blk/st':>6} {'LB ms':>8} {'ours':>6} {'method':>6}{bl_cols}"
            f" {'cut MiB':>8}{cut_cols} {'dominated':>9} {'part s':>7} {'p.comp':>6} {'measured':>8} {'m.best':>7}{cost_cols}{meas_cols}")
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
            dominated = [b for b, bp in base.items() if _dominates(bp, plan)]
            measured = f"{'-':>8} {'-':>7}"
            times = None
            if not opts.no_measure:
                times = time_stages(g, plan.assignment, k, zm.args, zm.kwargs, opts.repeats, opts.clock)
                measured = f"{times.balance:>8.3f} {times.best_balance:>7.3f}"
            cc = ""
            floor = None
            if with_costs:
                floor = granularity_floor(g, op_costs, k)
                mplan = partitioner.partition(g, k, memory_weight=opts.memory_weight, rates=rates, measure=True,
                                              example_inputs=zm.args, example_kwargs=zm.kwargs)
                mtimes = time_stages(g, mplan.assignment, k, zm.args, zm.kwargs, opts.repeats, opts.clock)
                cc = f" {floor:>6.3f} {mplan.balance:>6.3f} {mtimes.balance:>6.3f}"
            mb = ""
            if opts.measure_baselines and not opts.no_measure:
                mb = "".join(f" {time_stages(g, bp.assignment, k, zm.args, zm.kwargs, opts.repeats, opts.clock).balance:>8.3f}"
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
            if times is not None and times.balance > MEASURED_GOAL:
                why = (f" (op granularity: no contiguous plan beats {floor:.3f})"
                       if floor is not None and floor > MEASURED_GOAL else "")
                failures.append(f"{name} k={k}: measured balance {times.balance:.3f} > {MEASURED_GOAL}{why}")
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
