"""What a change of input shapes costs with one plan (pipeline.shape_classes): the first step at a new shape class,
and later steps while shapes keep changing, against steps of a fixed-shape run.

Model: GPT-2 from ``transformers`` with random weights (``--size base``: 4 layers, hidden 128, 4 heads, a 512-token
vocabulary; ``small``: 2 layers, hidden 32), no dropout, trained with the pipeline API
(``smp.engine.planning.pipeline_runner``, its loss on the last stage, SGD) on 2 gloo ranks on this host (1F1B, one
thread per rank, rank r pinned to core r; ``--no-pin`` to not), batch ``--batch`` in 2 microbatches, fp32.

Every round (``--rounds``, the order of the two blocks rotating) takes a sequence length ``n`` no earlier round used
and, on every rank, runs

* ``first``: one step at ``n``, the first at that shape: the runner traces the model for it (fake tensors),
  re-binds the plan by op names, splits the stages and builds their executor, then steps;
* ``fixed``: ``--steps`` steps at ``n`` back to back, as a run whose shapes never change;
* ``changing``: ``--steps`` steps at ``n``, each after a step at the base length (both classes cached): the cost of
  switching between known shape classes.

Each step is timed on rank 0 after a barrier (every rank steps the same batch; the step ends with the loss broadcast,
so the time covers the pipeline). Reported: milliseconds per step, the median over rounds of each round's median,
and each block's median of per-round ratios to ``fixed`` (1.00x: no overhead; robust to a shared machine's
drift); ``first`` also gives the part spent making the stages (``runner.specialise``). The load average is
printed before and after.

Run: ``python benchmarks/shape_change.py [--rounds 5] [--steps 4] [--batch 8] [--size base]``: about a minute on two
idle cores.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load_average, pin  # noqa: E402
from smp.testing import run_ranks  # noqa: E402

SIZES = {"base": {"n_layer": 4, "n_embd": 128, "n_head": 4}, "small": {"n_layer": 2, "n_embd": 32, "n_head": 2}}
VOCAB, BASE_LENGTH = 512, 32


def _model(size: str) -> torch.nn.Module:
    import transformers as T
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(**SIZES[size], vocab_size=VOCAB, n_positions=128, resid_pdrop=0.0,
                                          embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _loss(out: Any, _target: Any) -> torch.Tensor:
    return out.loss


def _bench(rank: int, world: int, cfg: dict) -> dict[str, list[float]]:
    import torch.distributed as dist

    from smp.engine.planning import pipeline_runner
    pin(rank, cfg)
    model, batch, m = _model(cfg["size"]), cfg["batch"], 2
    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (batch, n), generator=g)

    first = ids(BASE_LENGTH)[: batch // m]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner = pipeline_runner(model, (first,), {"labels": first}, microbatches=m, timeout_s=120,
                                 shape_cache_size=cfg["rounds"] + 2)
    sgd = torch.optim.SGD(runner.local_parameters(), lr=1e-3)
    specialise = runner.specialise
    made: list[float] = []

    def timed_specialise(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        misses = runner.shapes.misses
        out = specialise(*args, **kwargs)
        if runner.shapes.misses > misses:
            made.append(time.perf_counter() - start)
        return out

    runner.specialise = timed_specialise  # type: ignore[method-assign]

    def step(x: torch.Tensor) -> float:
        dist.barrier()
        start = time.perf_counter()
        runner.step((x,), {"labels": x}, loss_fn=_loss, return_outputs=False)
        took = time.perf_counter() - start
        sgd.step()
        sgd.zero_grad()
        return took

    for _ in range(2):  # warm-up at the base length
        step(ids(BASE_LENGTH))
    out: dict[str, list[float]] = {"first": [], "made": [], "fixed": [], "changing": []}
    for r in range(cfg["rounds"]):
        n = BASE_LENGTH - 1 - r  # a length no earlier round used
        out["first"].append(step(ids(n)))
        out["made"].append(made[-1])
        blocks = ["fixed", "changing"] if r % 2 == 0 else ["changing", "fixed"]
        for block in blocks:
            times = []
            for _ in range(cfg["steps"]):
                if block == "changing":
                    step(ids(BASE_LENGTH))
                times.append(step(ids(n)))
            out[block].append(statistics.median(times))
    return out


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print its table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", choices=sorted(SIZES), default="base")
    ap.add_argument("--no-pin", dest="pin", action="store_false")
    args = ap.parse_args(argv)
    if args.rounds >= BASE_LENGTH:
        ap.error(f"--rounds must be below {BASE_LENGTH}: each round needs a sequence length of its own")
    cfg = vars(args)
    print(f"shape change: GPT-2 {args.size} {SIZES[args.size]}, batch {args.batch} in 2 microbatches, 2 ranks, "
          f"base length {BASE_LENGTH}, new lengths {BASE_LENGTH - 1}..{BASE_LENGTH - args.rounds}; {args.rounds} "
          f"rounds x {args.steps} steps")
    print(load_average())
    got = run_ranks(_bench, 2, cfg, timeout=1200)[0]
    print(load_average())
    fixed = got["fixed"]
    print(f"{'block':<10} {'ms/step':>9} {'fastest':>9} {'vs fixed':>9}")
    for block in ("fixed", "first", "changing"):
        ratio = statistics.median(t / f for t, f in zip(got[block], fixed))
        print(f"{block:<10} {statistics.median(got[block]) * 1e3:>9.1f} {min(got[block]) * 1e3:>9.1f} "
              f"{ratio:>8.2f}x")
    print(f"first step at a new shape: {statistics.median(got['made']) * 1e3:.1f} ms of it make the stages "
          "(trace, re-bind by op names, split, executor)")


if __name__ == "__main__":
    main()
