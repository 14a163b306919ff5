"""Overhead of the ``smp`` layer over the bare pipeline runtime, on the same split of the same model.

Model: ``--layers`` x (Linear(width, width) + GELU) as one ``nn.Sequential``, MSE loss against a random
target, fp32, batch ``--batch`` in ``--microbatches`` microbatches, 2 gloo ranks on this host, one thread
per rank (``torch.set_num_threads(1)``), rank r pinned to core r (``--no-pin`` to not).

What runs, alternating inside every round (``--rounds`` rounds of ``--steps`` timed steps each; the order
flips every round):

* ``smp``: ``smp.DistributedModel`` + an ``@smp.step`` function (``model(x)``, ``F.mse_loss``,
  ``model.backward(loss)``, ``return loss``) and ``.reduce_mean()`` of its StepOutput, as a user writes it;
* ``runner``: ``pipeline.PipelineRunner.step((x,), target=y, loss_fn=F.mse_loss)`` built on the plan smp made
  (``model.runner.plan``), same schedule (1F1B, smp's ``"interleaved"``), same microbatches, the same
  parameter tensors.

What smp adds: one thread per microbatch running the user's function, the hand-over of inputs, outputs and
loss between those threads and the executor, and the broadcast of the returned values over the pipeline
(pickled objects) instead of one tensor of losses. A step is timed from a barrier to a barrier; gradients
are reset outside the timed span. Reported: median wall seconds per step, the median of the per-round
ratios smp / runner (robust to slow drifts of a shared machine), and CPU seconds per step summed over the
ranks, and the same comparison by fastest step and by CPU time, which suffer less from other jobs on a
shared host. Goal: smp <= 3 % slower than the runner.

Run: ``python benchmarks/smp_overhead.py [--rounds 15] [--steps 3] [--batch 64] [--width 1024] [--layers 8]
[--microbatches 4]``: well under a minute on two idle cores.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load_average, pin  # noqa: E402
from smp.testing import run_ranks  # noqa: E402

GOAL_OVERHEAD = 0.03  # smp at most 3 % slower than the bare runner


def build(cfg: dict) -> tuple[torch.nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)  # every rank builds the same model and batch
    layers: list[torch.nn.Module] = []
    for _ in range(cfg["layers"]):
        layers += [torch.nn.Linear(cfg["width"], cfg["width"]), torch.nn.GELU()]
    return (torch.nn.Sequential(*layers), torch.randn(cfg["batch"], cfg["width"]),
            torch.randn(cfg["batch"], cfg["width"]))


def worker(rank: int, world: int, cfg: dict) -> dict[str, Any] | None:
    import torch.distributed as dist

    import smp
    from pipeline import PipelineRunner

    torch.set_num_threads(1)
    pin(rank, cfg)
    smp.init({"pipeline_parallel_degree": world, "microbatches": cfg["microbatches"], "pipeline": "interleaved"})
    net, x, y = build(cfg)
    model = smp.DistributedModel(net)

    @smp.step
    def train_step(model, x, y):
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    train_step(model, x, y)  # partitions
    plan = model.runner.plan
    runner = PipelineRunner(plan, schedule="1f1b", microbatches=cfg["microbatches"],
                            max_in_flight=smp.runtime.state.get().config.max_in_flight, timeout_s=120)
    pin(rank, cfg)  # gloo threads started since
    losses: dict[str, float] = {}

    def run_smp() -> None:
        losses["smp"] = float(train_step(model, x, y).reduce_mean())

    def run_runner() -> None:
        losses["runner"] = runner.step((x,), target=y, loss_fn=F.mse_loss).loss

    runs = {"smp": run_smp, "runner": run_runner}
    wall: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    ratios: list[float] = []
    for fn in runs.values():  # warm-up
        for _ in range(3):
            net.zero_grad(set_to_none=True)
            fn()
    for rnd in range(cfg["rounds"]):
        order = list(runs) if rnd % 2 == 0 else list(runs)[::-1]
        this_round: dict[str, list[float]] = {k: [] for k in runs}
        for name in order:
            for _ in range(cfg["steps"]):
                net.zero_grad(set_to_none=True)
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                runs[name]()
                dist.barrier()
                w, c = time.perf_counter() - t0, time.process_time() - c0
                wall[name].append(w)
                cpu[name].append(c)
                this_round[name].append(w)
        ratios.append(statistics.median(this_round["smp"]) / statistics.median(this_round["runner"]))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, cpu)
    if rank != 0:
        return None
    cpu_total = {k: [sum(g[k][i] for g in gathered) for i in range(len(cpu[k]))] for k in cpu}
    return {"wall": wall, "cpu": cpu_total, "ratios": ratios, "losses": losses, "summary": plan.summary()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per configuration per round")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin rank r to core r")
    args = ap.parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("rounds", "steps", "batch", "width", "layers", "microbatches", "pin")}
    print(f"smp overhead: {args.layers} x (Linear {args.width} + GELU), batch {args.batch}, m = {args.microbatches}, "
          f"2 ranks (gloo), 1F1B, 1 thread per rank{', rank r on core r' if args.pin else ''}, fp32, MSE loss")
    print(f"{args.rounds} rounds x {args.steps} steps per configuration, alternating. Before: {load_average()}")
    began = time.perf_counter()
    res = run_ranks(worker, 2, cfg, timeout=900, pg_timeout=300)[0]
    print("plan (made by smp, used by both):")
    print(res["summary"])
    print("mean microbatch loss of the last step (must agree): " +
          ", ".join(f"{k} {v:.6f}" for k, v in res["losses"].items()))
    print()
    wall = {k: statistics.median(v) for k, v in res["wall"].items()}
    cpu = {k: statistics.median(v) for k, v in res["cpu"].items()}
    head = f"{'':<8} {'ms/step':>8} {'min':>8} {'max':>8} {'cpu ms/step':>11} {'vs runner':>9}"
    print(head)
    print("-" * len(head))
    for name in ("runner", "smp"):
        t = res["wall"][name]
        print(f"{name:<8} {wall[name] * 1e3:>8.2f} {min(t) * 1e3:>8.2f} {max(t) * 1e3:>8.2f} {cpu[name] * 1e3:>11.2f} "
              f"{wall[name] / wall['runner']:>8.3f}x")
    ratio = statistics.median(res["ratios"])
    overhead = ratio - 1
    print(f"medians of {len(res['wall']['smp'])} steps each; cpu = CPU seconds per step summed over both ranks.")
    print(f"smp overhead: {overhead * 100:+.2f} % (median of {len(res['ratios'])} per-round ratios; "
          f"per-round range {min(res['ratios']):.3f} .. {max(res['ratios']):.3f}); "
          f"goal <= {GOAL_OVERHEAD * 100:.0f} %: {'PASS' if overhead <= GOAL_OVERHEAD else 'MISS'}")
    by_min = min(res["wall"]["smp"]) / min(res["wall"]["runner"]) - 1
    by_cpu = cpu["smp"] / cpu["runner"] - 1
    print(f"the same by fastest step: {by_min * 100:+.2f} %; by CPU time: {by_cpu * 100:+.2f} % (both less "
          "sensitive to other jobs on the host than the median wall clock)")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > (os.cpu_count() or 1):
        print(f"NOTE: the host was busy (load {load:.1f} on {os.cpu_count()} cores): wall-clock medians are noisy; "
              "trust the fastest-step and CPU-time figures more.")
    print(f"After: {load_average()}; {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
