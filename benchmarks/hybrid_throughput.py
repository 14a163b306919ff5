"""Training throughput of pipeline x data parallelism (pp=2 x dp=2, 4 ranks) against the pipeline alone (pp=2,
2 ranks), through the smp API.

Model: ``--layers`` x (Linear(width, width) + GELU), MSE loss against a random target, fp32, SGD; ``@smp.step``
with ``--microbatches`` microbatches per replica, 1F1B (smp's ``"interleaved"``), one thread per rank, rank r
pinned to core ``r % cores`` (``--no-pin`` to not; with "cluster" placement that puts stage 0 of every
replica on core 0 and stage 1 on core 1). A step is forward + backward of the global batch, the
data-parallel gradient all-reduce (dp > 1) and the optimizer step, timed from a barrier to a barrier.

Configurations, each in its own set of processes, alternating over ``--rounds`` rounds:

* ``pp2``: 2 ranks, global batch ``--batch``;
* ``pp2 x dp2``: 4 ranks, the same global batch, ``--batch / 2`` per replica (strong scaling);
* ``pp2 x dp2 weak``: 4 ranks, ``--batch`` per replica, so twice the global batch (weak scaling).

Throughput is samples per second of wall clock (global batch / median step time). Next to it, the CPU
seconds per sample summed over all ranks, which says whether the work per sample stayed the same.

Honest caveat, printed with the table: on a host with fewer cores than ranks (this project's machine has 2),
4 ranks oversubscribe the cores, so dp=2 cannot add compute; the hybrid rows then measure the cost of the
extra ranks and the gradient all-reduce rather than the scaling that 4 real devices would give.

Run: ``python benchmarks/hybrid_throughput.py [--rounds 2] [--steps 10] [--batch 128] [--width 1024]
[--layers 8] [--microbatches 4]``: about 2 minutes on two cores.
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

CONFIGS = {  # name -> (ranks, global batch as a multiple of --batch)
    "pp2": (2, 1),
    "pp2 x dp2": (4, 1),
    "pp2 x dp2 weak": (4, 2),
}


def worker(rank: int, world: int, cfg: dict, global_batch: int) -> dict[str, Any] | None:
    import torch.distributed as dist

    import smp

    torch.set_num_threads(1)
    pin(rank, cfg)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": cfg["microbatches"], "pipeline": "interleaved",
              "ddp": world > 2})
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(cfg["layers"]):
        layers += [torch.nn.Linear(cfg["width"], cfg["width"]), torch.nn.GELU()]
    model = smp.DistributedModel(torch.nn.Sequential(*layers))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    x = torch.randn(global_batch, cfg["width"])
    y = torch.randn(global_batch, cfg["width"])
    d, n = smp.dp_rank(), smp.dp_size()
    x, y = x.chunk(n)[d], y.chunk(n)[d]  # this replica's shard of the global batch

    @smp.step
    def train_step(model, x, y):
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    def one_step() -> float:
        loss = float(train_step(model, x, y).reduce_mean())
        opt.step()
        opt.zero_grad()
        return loss

    for _ in range(3):  # partition + warm-up
        one_step()
    pin(rank, cfg)  # gloo threads started since
    wall, cpu = [], []
    for _ in range(cfg["steps"]):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = one_step()
        dist.barrier()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    cpus: list[Any] = [None] * world
    dist.all_gather_object(cpus, cpu)
    if rank != 0:
        return None
    return {"wall": wall, "cpu": [sum(c[i] for c in cpus) for i in range(len(cpu))], "loss": loss,
            "summary": model.runner.plan.summary()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds over the configurations")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per configuration per round")
    ap.add_argument("--batch", type=int, default=128, help="global batch of pp2 (default 128)")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=4, help="microbatches per replica (default 4)")
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin rank r to core r %% cores")
    args = ap.parse_args(argv)
    if args.batch % (2 * args.microbatches):
        ap.error("--batch must be divisible by 2 x --microbatches")
    cfg = {k: getattr(args, k) for k in ("steps", "width", "layers", "microbatches", "pin")}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"hybrid throughput: {args.layers} x (Linear {args.width} + GELU), m = {args.microbatches} per replica, "
          f"1F1B, SGD, fp32, 1 thread per rank{', rank r on core r % cores' if args.pin else ''}; "
          f"{cores} usable cores")
    print(f"{args.rounds} rounds x {args.steps} timed steps per configuration, alternating. Before: {load_average()}")
    began = time.perf_counter()
    wall: dict[str, list[float]] = {k: [] for k in CONFIGS}
    cpu: dict[str, list[float]] = {k: [] for k in CONFIGS}
    losses: dict[str, float] = {}
    for rnd in range(args.rounds):
        for name in (list(CONFIGS) if rnd % 2 == 0 else list(CONFIGS)[::-1]):
            ranks, mult = CONFIGS[name]
            res = run_ranks(worker, ranks, cfg, args.batch * mult, timeout=900, pg_timeout=300)[0]
            wall[name] += res["wall"]
            cpu[name] += res["cpu"]
            losses[name] = res["loss"]
            if rnd == 0 and name == "pp2":
                print("plan (pp2; each replica of the hybrid runs are partitioned the same way by the same "
                      "partitioner):")
                print(res["summary"])
    print()
    head = (f"{'config':<15} {'ranks':>5} {'global batch':>12} {'ms/step':>8} {'samples/s':>9} {'vs pp2':>7} "
            f"{'cpu ms/step':>11} {'cpu ms/sample':>13}")
    print(head)
    print("-" * len(head))
    base = None
    for name, (ranks, mult) in CONFIGS.items():
        g = args.batch * mult
        t = statistics.median(wall[name])
        c = statistics.median(cpu[name])
        tput = g / t
        base = base or tput
        print(f"{name:<15} {ranks:>5} {g:>12} {t * 1e3:>8.1f} {tput:>9.1f} {tput / base:>6.2f}x {c * 1e3:>11.1f} "
              f"{c / g * 1e3:>13.3f}")
    print(f"medians of {args.rounds * args.steps} steps each; cpu = CPU seconds summed over all ranks of the run.")
    print("last-step loss on rank 0 (its replica's shard of the batch): " +
          ", ".join(f"{k} {v:.5f}" for k, v in losses.items()))
    if cores < 4:
        print(f"NOTE: {cores} cores for 4 ranks: the hybrid runs oversubscribe the CPU {4 / cores:.0f}x, so "
              "data parallelism adds no compute here; these rows show what dp costs on this machine (extra "
              "ranks, gradient all-reduce, time slicing), not how pp x dp scales on 4 real devices.")
    print(f"After: {load_average()}; {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
