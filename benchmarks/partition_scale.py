"""How partition() scales: synthetic op graphs of 10^4, 10^5 and 10^6 ops.

Two families, built directly as :class:`partitioner.OpGraph` numpy arrays (seeded, random costs and bytes):

* ``chain``: a chain with skip connections -- every op feeds the next, and with probability 0.2 also an op
  2..64 positions further on (residual-style), and 2% of ops feed one op up to 2000 positions on (long skips);
* ``branches``: blocks of ``width`` parallel branches of ``depth`` ops each between a fork and a merge
  (inception-style), repeated until the graph has n ops.

Every op gets log-uniform forward FLOPs (10^5..10^8), output bytes (1 KiB..1 MiB) and every third op a
parameter (up to 4 MiB). The wall time of ``partition(graph, k)`` covers everything after the graph exists:
pricing every op, the DP, METIS with acyclic repair, refinement, scoring and building the plan.

Run: ``python benchmarks/partition_scale.py [--sizes 1e4,1e5,1e6] [--stages 4,8] [--methods auto,dp,metis]``.
Goals: 10^4 ops in < 1 s, 10^6 ops in < 15 s (method auto).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import partitioner  # noqa: E402
from partitioner import OpGraph  # noqa: E402

GOALS = {10_000: 1.0, 1_000_000: 15.0}


def _finish(n: int, src: np.ndarray, dst: np.ndarray, rng: np.random.Generator) -> OpGraph:
    """Random costs for an edge list (one value per producer), nodes ``0..n-1``, the last one the output."""
    pairs = np.unique(src.astype(np.int64) * n + dst.astype(np.int64))
    src, dst = pairs // n, pairs % n
    producers, value = np.unique(src, return_inverse=True)
    flops = 10 ** rng.uniform(5, 8, n)
    out = (2 ** rng.uniform(10, 20, n)).astype(np.int64)
    flops[-1] = 0.0
    out[-1] = 0
    has_param = np.arange(n - 1)[::3]
    kinds = ["aten.mm"] * (n - 1) + ["output"]
    return OpGraph(
        names=[f"op{i}" for i in range(n)], kinds=kinds, modules=[""] * n,
        flops=flops, out_bytes=out, act_bytes=out.copy(), move_bytes=3 * out,
        src=src, dst=dst, value=value.astype(np.int64), value_bytes=out[producers],
        param_names=[f"p{i}" for i in range(len(has_param))],
        param_bytes=(2 ** rng.uniform(10, 22, len(has_param))).astype(np.int64),
        param_trainable=np.ones(len(has_param), bool), use_node=has_param,
        use_param=np.arange(len(has_param), dtype=np.int64),
    )


def chain_graph(n: int, seed: int = 0) -> OpGraph:
    rng = np.random.default_rng(seed)
    i = np.arange(n - 1)
    src = [i]
    dst = [i + 1]
    skip = i[rng.random(n - 1) < 0.2]
    to = skip + rng.integers(2, 65, len(skip))
    src.append(skip[to < n])
    dst.append(to[to < n])
    far = i[rng.random(n - 1) < 0.02]
    to = far + rng.integers(65, 2001, len(far))
    src.append(far[to < n])
    dst.append(to[to < n])
    return _finish(n, np.concatenate(src), np.concatenate(dst), rng)


def branch_graph(n: int, width: int = 4, depth: int = 6, seed: int = 0) -> OpGraph:
    """fork -> ``width`` branches of ``depth`` ops (numbered branch after branch) -> merge, repeated."""
    rng = np.random.default_rng(seed)
    block = 1 + width * depth          # fork + branch ops; the merge is the next block's fork
    blocks = max(1, (n - 2) // block)
    starts = np.arange(blocks) * block  # the fork of each block
    b = np.arange(width)
    d = np.arange(depth)
    first = starts[:, None] + 1 + b[None, :] * depth                      # first op of each branch
    chain_src = (first[:, :, None] + d[None, None, :-1]).ravel()          # within-branch edges
    chain_dst = chain_src + 1
    last = first + depth - 1
    merge = np.broadcast_to((starts + block)[:, None], last.shape)         # next fork merges the branches
    fork = np.broadcast_to(starts[:, None], first.shape)
    m = blocks * block + 1                                                 # ops so far (+ final merge)
    src = np.concatenate([fork.ravel(), chain_src, last.ravel()])
    dst = np.concatenate([first.ravel(), chain_dst, merge.ravel()])
    tail = np.arange(m - 1, n - 1)                                         # pad with a chain to n ops
    src = np.concatenate([src, tail])
    dst = np.concatenate([dst, tail + 1])
    return _finish(n, src, dst, rng)


FAMILIES = {"chain": chain_graph, "branches": branch_graph}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1e4,1e5,1e6")
    ap.add_argument("--stages", default="4,8")
    ap.add_argument("--methods", default="auto,dp,metis")
    ap.add_argument("--families", default="chain,branches")
    ap.add_argument("--profile", action="store_true", help="cProfile the largest auto run and print the top")
    opts = ap.parse_args(argv)
    torch.set_num_threads(1)
    sizes = [int(float(s)) for s in opts.sizes.split(",")]
    stages = [int(k) for k in opts.stages.split(",")]
    methods = opts.methods.split(",")
    rates = partitioner.DeviceRates()  # fixed: the graphs are synthetic, and calibration is not timed
    print("# partition() time on synthetic graphs (1 thread; DeviceRates() defaults; memory_weight=0.2); "
          "cpu = process CPU time (what a busy shared machine does not inflate)")
    head = (f"{'family':<9} {'ops':>9} {'edges':>9} {'k':>2} {'method':>10} {'wall s':>8} {'cpu s':>7} {'balance':>8} "
            f"{'cut MiB':>9}  goal (wall)")
    print(head)
    print("-" * len(head))
    missed = []
    for family in opts.families.split(","):
        for n in sizes:
            t0 = time.perf_counter()
            g = FAMILIES[family](n)
            t_build = time.perf_counter() - t0
            for k in stages:
                for method in methods:
                    t0, c0 = time.perf_counter(), time.process_time()
                    plan = partitioner.partition(g, k, method=method, rates=rates)
                    dt, dc = time.perf_counter() - t0, time.process_time() - c0
                    goal = GOALS.get(n)
                    verdict = "" if goal is None or method != "auto" else (
                        f"< {goal:g} s " + ("ok" if dt < goal else "MISSED"))
                    if verdict.endswith("MISSED"):
                        missed.append(f"{family} n={n} k={k}: {dt:.2f} s > {goal} s")
                    shown = ("auto>" + plan.method) if method == "auto" else method
                    print(f"{family:<9} {n:>9} {g.num_edges:>9} {k:>2} {shown:>10} {dt:>8.3f} {dc:>7.3f} "
                          f"{plan.balance:>8.3f} {plan.cut_bytes / 2**20:>9.2f}  {verdict}", flush=True)
            print(f"# ({family}, n={n}: graph built in {t_build:.2f} s, not counted)")
            if opts.profile and n == max(sizes):
                import cProfile
                import pstats
                prof = cProfile.Profile()
                prof.enable()
                partitioner.partition(g, max(stages), rates=rates)
                prof.disable()
                pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    for m in missed:
        print(f"# MISSED: {m}")
    if not missed:
        print("# all goals met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
