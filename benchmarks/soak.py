"""Soak: does memory per rank stay flat over a long ``@smp.step`` training run?

Model: a 3-layer MLP (``--width`` hidden, ``--out``-wide output: a large output is what a leak of the last
stage's microbatches shows first), cross-entropy loss, SGD, fp32, batch ``--batch`` in ``--microbatches``
microbatches, 1F1B ("interleaved"), 2 gloo ranks on this host, one thread per rank. Each rank trains
``--steps`` steps as an SMP v1 script does (``model(x)``, ``model.backward(loss)``, ``.reduce_mean()``,
``optimizer.step()``) with no ``gc.collect()``: what a user's job does.

Printed: the resident set size (RSS, from ``/proc/self/statm``) of each rank after the first step and every
``--every`` steps, twice: as the job has it (``rss``), and right after ``malloc_trim(0)`` hands the heap's free
pages back to the OS (``trim``; glibc only). The first moves with the allocator: glibc keeps freed heap
memory (up to twice its dynamic mmap threshold, which grows to tens of MiB once large tensors have been
freed), so on the last stage's rank, where the 512 KiB logits of each microbatch come and go, it swings by
tens of MiB from one sample to the next, with or without ``MALLOC_ARENA_MAX=1``. The second counts the memory
the process still uses, which is what a leak makes grow. The verdict: on every rank, after step ``--every``
(warm: the allocator and the optimizer state are set up by then), ``trim`` stays within 5 % of its value at
step ``--every``; the range of ``rss`` is printed beside it. The load average is printed before and after;
memory does not depend on it, but a run that took much longer than usual does.

Run: ``python benchmarks/soak.py [--steps 1000] [--every 100] [--out 8192] [--width 256] [--batch 64]
[--microbatches 4]``: a few minutes on two idle cores.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load_average  # noqa: E402
from smp.testing import run_ranks  # noqa: E402

TOLERANCE = 0.05  # RSS after warm-up may vary by at most 5 %


def rss_mib() -> float:
    """This process's resident set size in MiB."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def trimmed_rss_mib() -> float:
    """RSS after glibc's ``malloc_trim(0)`` returned the free heap pages (plain RSS without glibc)."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
    return rss_mib()


def worker(rank: int, world: int, cfg: dict) -> dict[str, Any]:
    """Train ``cfg["steps"]`` steps; RSS after the first step and every ``cfg["every"]`` steps."""
    import smp

    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": world, "microbatches": cfg["microbatches"], "pipeline": "interleaved"})
    torch.manual_seed(0)  # every rank builds the same model and batch
    width = cfg["width"]
    net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                              torch.nn.ReLU(), torch.nn.Linear(width, cfg["out"]))
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    x, y = torch.randn(cfg["batch"], width), torch.randint(cfg["out"], (cfg["batch"],))
    rss: dict[int, tuple[float, float]] = {}
    loss = float("nan")
    t0 = time.perf_counter()
    for step in range(1, cfg["steps"] + 1):
        loss = float(train_step(model, x, y).reduce_mean())
        opt.step()
        opt.zero_grad()
        if step == 1 or step % cfg["every"] == 0:
            rss[step] = (rss_mib(), trimmed_rss_mib())
    return {"rss": rss, "loss": loss, "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--out", type=int, default=8192, help="width of the model's output (default 8192)")
    ap.add_argument("--width", type=int, default=256, help="hidden width (default 256)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4)
    args = ap.parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("steps", "every", "out", "width", "batch", "microbatches")}
    print(f"soak: {args.steps} steps of a 3-layer MLP (hidden {args.width}, output {args.out}), batch {args.batch}, "
          f"m = {args.microbatches}, 2 ranks (gloo), 1F1B, 1 thread per rank, fp32, SGD")
    print(f"Before: {load_average()}")
    results = run_ranks(worker, 2, cfg, timeout=3600, pg_timeout=300)
    steps = sorted(results[0]["rss"])
    print("RSS in MiB per rank")
    print(f"{'step':>6} " + " ".join(f"{f'rank {r} rss':>11} {'trim':>7}" for r in range(len(results))))
    for s in steps:
        print(f"{s:>6} " + " ".join(f"{res['rss'][s][0]:>11.1f} {res['rss'][s][1]:>7.1f}" for res in results))
    ok = True
    warm = [s for s in steps if s >= args.every]
    for r, res in enumerate(results):
        if not warm:
            break
        for i, kind in enumerate(("rss", "trim")):
            base = res["rss"][warm[0]][i]
            values = [res["rss"][s][i] for s in warm]
            worst = max(abs(v / base - 1) for v in values)
            ok &= kind == "rss" or worst <= TOLERANCE
            end = (values[-1] / base - 1) * 100
            print(f"rank {r} {kind:>4}: from step {warm[0]} on {min(values):.1f} .. {max(values):.1f} MiB, at most "
                  f"{worst * 100:.1f} % from {base:.1f}; at the end {end:+.1f} %")
        print(f"rank {r}: {res['seconds']:.0f} s, last loss {res['loss']:.4f}")
    print(f"goal: memory in use (trim) within {TOLERANCE * 100:.0f} % after warm-up on every rank: "
          f"{'PASS' if ok else 'MISS'}")
    print(f"After: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
