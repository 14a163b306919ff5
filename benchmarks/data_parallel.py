"""Data parallelism through ``@smp.step`` against torch's ``DistributedDataParallel``: step time, collectives and bytes
per step, and each one's gradients against one process.

Model: a Llama causal LM from ``transformers.LlamaConfig`` (``--layers`` 4, hidden 256, intermediate 688, 4 heads,
vocabulary 8,000: about 7.3M parameters, 29 MB of fp32 gradients), random weights from seed 0, its loss in the model
(``labels=``), fp32, SGD; a global batch of ``--batch`` sequences of ``--seq`` tokens from one seed, split over the
replicas; gloo on this host, one thread per rank, rank r pinned to core ``r % cores`` (``--no-pin`` to not).

Configurations, each in its own set of processes, alternating over ``--rounds`` rounds (the order rotating):

* ``ddp``: 2 ranks, torch's ``DistributedDataParallel`` (its defaults: 25 MB buckets, the first 1 MB), half the
  batch each;
* ``smp dp2``: 2 ranks, ``"ddp": True`` with ``pipeline_parallel_degree`` 1 and 1 microbatch, ``@smp.step``: the
  averages all-reduced in buckets during the backward (``overlapping_allreduce``, the default; 25 MB buckets);
* ``smp dp2 blocking``: the same with ``overlapping_allreduce`` False: one all-reduce after the backward (the engine
  before the buckets);
* with ``--hybrid``, ``pp2 x dp2`` and ``pp2 x dp2 blocking``: 4 ranks, two stages, 2 microbatches per replica, overlap
  on and off (on two cores 4 ranks oversubscribe the CPU: the pair compares the two settings, nothing else).

A step is forward, backward and the averaging, then ``SGD.step()``, timed from a barrier to a barrier after
``--warmup`` untimed steps. Before timing, every configuration's first step's averaged gradients are compared with one
process's gradients of the whole batch (``rel err``: the largest difference over the largest gradient, on rank 0).
``colls`` and ``MB`` are the all-reduces of gradients per step and their bytes (DDP's from its logging data, the
buckets it settled on; smp's from ``model.grad_averaging.last``), ``early`` how many of smp's were launched during the
backward. ``vs ddp``: the median over rounds of DDP's step time over the configuration's, so above 1.0x is faster
than DDP. The load average is printed before and after: other work on the cores makes every figure noisy.

Run: ``python benchmarks/data_parallel.py [--rounds 4] [--steps 8] [--warmup 3] [--batch 8] [--seq 64] [--layers 4]
[--hybrid] [--no-pin]``: about 2 minutes on two cores (4 with ``--hybrid``).
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import LossOnly, load_average, pin  # noqa: E402
from smp.testing import run_ranks  # noqa: E402

CONFIGS = {  # name -> (ranks, pipeline degree, overlap)
    "ddp": (2, 1, True),
    "smp dp2": (2, 1, True),
    "smp dp2 blocking": (2, 1, False),
    "pp2 x dp2": (4, 2, True),
    "pp2 x dp2 blocking": (4, 2, False),
}



def build(cfg: dict) -> tuple[torch.nn.Module, torch.Tensor]:
    """The Llama (seed 0) and the global batch of token ids (seed 1)."""
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=cfg["layers"], hidden_size=256, intermediate_size=688,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=8000,
                                      max_position_embeddings=cfg["seq"], use_cache=False)
    torch.manual_seed(0)
    model = LossOnly(transformers.LlamaForCausalLM(config))
    ids = torch.randint(0, 8000, (cfg["batch"], cfg["seq"]), generator=torch.Generator().manual_seed(1))
    return model, ids


def reference_grads(cfg: dict) -> dict[str, torch.Tensor]:
    """One process's gradients of the mean loss over the whole batch (sequences of equal length: the mean of the
    replicas' mean losses)."""
    model, ids = build(cfg)
    parts = ids.chunk(cfg["replicas"] * cfg["microbatches"])
    (sum(model(p, p) for p in parts) / len(parts)).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def rel_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    scale = max(float(g.abs().max()) for g in want.values())
    return max(float((g - want[n]).abs().max()) for n, g in got.items()) / scale


def worker(rank: int, world: int, cfg: dict, name: str) -> dict[str, Any] | None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    pin(rank, cfg)
    want = reference_grads(cfg) if rank == 0 else {}
    net, ids = build(cfg)
    if name == "ddp":  # the process group is smp.testing.run_ranks's
        model: Any = torch.nn.parallel.DistributedDataParallel(net)
        params = dict(model.module.named_parameters())
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        mine = ids.chunk(world)[rank]

        def step() -> None:
            model(mine, mine).backward()

        def counts() -> tuple[int, int, int]:
            logged = model._get_ddp_logging_data()  # the buckets DDP rebuilt after its first step, in bytes
            sizes = [int(s) for s in str(logged.get("rebuilt_bucket_sizes") or logged["bucket_sizes"]).split(", ")]
            return len(sizes), sum(sizes), len(sizes)
    else:
        import smp

        _, pp, overlap = CONFIGS[name]
        smp.init({"pipeline_parallel_degree": pp, "ddp": True, "microbatches": cfg["microbatches"]})
        model = smp.DistributedModel(net, overlapping_allreduce=overlap)
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
        mine = ids.chunk(smp.dp_size())[smp.dp_rank()]

        @smp.step
        def train_step(model: Any, x: torch.Tensor) -> torch.Tensor:
            loss = model(x, x)
            model.backward(loss)
            return loss

        def step() -> None:
            train_step(model, mine)

        def counts() -> tuple[int, int, int]:
            return tuple(model.grad_averaging.last)  # type: ignore[return-value]

        params = dict(model.local_named_parameters())
    step()
    got = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
    err = rel_err(got, {n: want[n] for n in got}) if rank == 0 else None
    opt.step()
    opt.zero_grad()
    for _ in range(cfg["warmup"]):
        step()
        opt.step()
        opt.zero_grad()
    pin(rank, cfg)  # gloo threads started since
    wall = []
    for _ in range(cfg["steps"]):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        opt.step()
        dist.barrier()
        wall.append(time.perf_counter() - t0)
        opt.zero_grad()
    if rank != 0:
        return None
    return {"wall": wall, "err": err, "counts": counts(), "params": sum(p.numel() for p in net.parameters())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds over the configurations")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per configuration per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="global batch, sequences")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hybrid", action="store_true", help="also pp2 x dp2 on 4 ranks, overlap on and off")
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin rank r to core r %% cores")
    args = ap.parse_args(argv)
    names = [n for n in CONFIGS if args.hybrid or CONFIGS[n][0] == 2]
    cfg = {k: getattr(args, k) for k in ("steps", "warmup", "batch", "seq", "layers", "pin")}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"data parallelism: Llama {args.layers} layers, hidden 256, vocabulary 8,000; global batch {args.batch} x "
          f"{args.seq} tokens; SGD, fp32, gloo, 1 thread per rank{', rank r on core r % cores' if args.pin else ''}; "
          f"{cores} usable cores")
    print(f"{args.rounds} rounds x {args.steps} timed steps per configuration, alternating. Before: {load_average()}")
    began = time.perf_counter()
    medians: dict[str, list[float]] = {n: [] for n in names}
    results: dict[str, dict[str, Any]] = {}
    for rnd in range(args.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            ranks, pp, _ = CONFIGS[name]
            run = {**cfg, "replicas": ranks // pp, "microbatches": 2 if pp > 1 else 1}
            res = run_ranks(worker, ranks, run, name, timeout=900, pg_timeout=300)[0]
            medians[name].append(statistics.median(res["wall"]))
            results[name] = res
    print()
    head = (f"{'config':<20} {'ranks':>5} {'ms/step':>8} {'vs ddp':>7} {'colls':>5} {'MB':>6} {'early':>5} "
            f"{'rel err':>8}")
    print(head)
    print("-" * len(head))
    for name in names:
        ranks = CONFIGS[name][0]
        colls, nbytes, early = results[name]["counts"]
        ratio = statistics.median(d / m for d, m in zip(medians["ddp"], medians[name]))
        print(f"{name:<20} {ranks:>5} {statistics.median(medians[name]) * 1e3:>8.1f} {ratio:>6.2f}x {colls:>5} "
              f"{nbytes / 1e6:>6.1f} {early if name != 'ddp' else '-':>5} {results[name]['err']:>8.1e}")
    print(f"{results['ddp']['params'] / 1e6:.1f}M parameters; ms/step: median over rounds of each round's median; "
          "colls, MB: gradient all-reduces per step on rank 0 and their bytes; early: launched during the backward")
    print(f"After: {load_average()}; {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
