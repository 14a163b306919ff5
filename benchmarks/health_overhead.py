"""What watching a run costs: the training-health rules every step and the system monitor at 200 ms, against
the same steps unwatched.

Model: the zoo's GPT-2 (``smp.zoo.build("gpt2", size=--size)``; ``base``: 12 layers, hidden 256, 8 heads, sequence
32, a 512-token vocabulary, random weights), ``@smp.step`` with its cross-entropy loss, ``smp.DistributedOptimizer``
over AdamW, fp32, batch ``--batch`` in ``--microbatches`` microbatches, 2 gloo ranks on this host (pipeline degree
2, 1F1B), one thread per rank, rank r pinned to core r (``--no-pin`` to not).

What runs, alternating inside every round (``--rounds`` rounds of ``--steps`` timed steps each, the order rotating
every round), each a full training step (the step function and ``optimizer.step()``):

* ``plain``: nothing watches;
* ``rules``: ``with smp.debug(every_n_steps=1):`` all six training-health rules checked after every step
  (per-layer gradient norms, taps on the activations crossing stages, one all-gather of the statistics at the
  next step's start, the weight-update probe on one check in 10);
* ``monitor``: ``with smp.profile(dir):`` the profile of the steps with its system monitor sampling every 200 ms
  (this also counts the profile's own recording of every pass, so it over-states the monitor alone);
* ``both``: the two together.

Each configuration's ``--steps`` steps run back to back, as in training (a barrier before and after the block, none
between steps: the ranks' steps overlap as they do in a real run), after one untimed step in the block; the time per
step is the block's wall time over its steps. The timed steps come after the first 12 (``PoorWeightInitialization``
reads every layer's output during the first 10 training steps only, a cost of the start of training, not of the
run). Reported: wall seconds per step (median and fastest over the rounds), and each configuration's median of
per-round ratios against ``plain`` (robust to slow drifts of a shared machine). A block's mean counts what comes
once in several steps (the weight-update probe on one check in 10, the monitor's samples every 200 ms), which a
median of steps would hide. Goal: ``both`` <= 3 % slower than ``plain``.

Run: ``python benchmarks/health_overhead.py [--rounds 6] [--steps 10] [--batch 16] [--microbatches 4] [--size base]``:
about two minutes on two idle cores.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load_average, pin  # noqa: E402
from smp.testing import run_ranks  # noqa: E402

GOAL_OVERHEAD = 0.03  # rules every step and the monitor at 200 ms: at most 3 % of the step
MODES = ("plain", "rules", "monitor", "both")


def worker(rank: int, world: int, cfg: dict) -> dict[str, Any] | None:
    import torch.distributed as dist

    import smp
    from smp import zoo

    torch.set_num_threads(1)
    pin(rank, cfg)
    warnings.simplefilter("ignore")  # a rule that fires on random data warns once; the cost is what counts here
    smp.init({"pipeline_parallel_degree": world, "microbatches": cfg["microbatches"]})
    zm = zoo.build("gpt2", batch=cfg["batch"], size=cfg["size"])
    model = smp.DistributedModel(zm.model)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = zm.loss_fn(model(ids), target)
        model.backward(loss)
        return loss

    def one() -> None:
        train_step(model, zm.args[0], zm.target)
        optimizer.step()
        optimizer.zero_grad()

    out = tempfile.mkdtemp(prefix="smp-watch-") if rank == 0 else ""
    box = [out]
    dist.broadcast_object_list(box, src=0)
    out = box[0]

    def watched(mode: str, rnd: int) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if mode in ("rules", "both"):
            stack.enter_context(smp.debug(every_n_steps=1))
        if mode in ("monitor", "both"):
            stack.enter_context(smp.profile(os.path.join(out, f"{mode}-{rnd}")))
        return stack

    for _ in range(12):  # partition, warm up, and leave the first 10 steps, where PoorWeightInitialization taps
        one()             # every layer's output: the start of training pays that, the steady state measured here not
    pin(rank, cfg)  # gloo's threads started since
    wall: dict[str, list[float]] = {m: [] for m in MODES}
    ratios: dict[str, list[float]] = {m: [] for m in MODES[1:]}
    for rnd in range(cfg["rounds"]):
        order = MODES[rnd % len(MODES):] + MODES[:rnd % len(MODES)]
        this_round: dict[str, float] = {}
        for mode in order:
            with watched(mode, rnd):
                one()  # the block's first step: a new session starts its checks
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(cfg["steps"]):
                    one()
                dist.barrier()
                per_step = (time.perf_counter() - t0) / cfg["steps"]
            wall[mode].append(per_step)
            this_round[mode] = per_step
        for mode in MODES[1:]:
            ratios[mode].append(this_round[mode] / this_round["plain"])
    if rank != 0:
        return None
    samples = sum(1 for p in Path(out).rglob("trace.json"))
    return {"wall": wall, "ratios": ratios, "profiles": samples}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per configuration per round")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--size", choices=("small", "base"), default="base", help="the zoo's GPT-2 size (default base)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin rank r to core r")
    args = ap.parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("rounds", "steps", "batch", "microbatches", "size", "pin")}
    print(f"watching a run: zoo GPT-2 ({args.size}), batch {args.batch} in {args.microbatches} microbatches, "
          f"2 ranks (gloo), 1F1B, fp32, AdamW, 1 thread per rank{', rank r on core r' if args.pin else ''}")
    print(f"{args.rounds} rounds x {args.steps} steps per configuration, rotating. Before: {load_average()}")
    began = time.perf_counter()
    res = run_ranks(worker, 2, cfg, timeout=1800, pg_timeout=600)[0]
    head = f"{'':<8} {'ms/step':>9} {'fastest':>9} {'vs plain':>9}"
    print(head)
    print("-" * len(head))
    for mode in MODES:
        t = res["wall"][mode]
        ratio = statistics.median(res["ratios"][mode]) if mode != "plain" else 1.0
        print(f"{mode:<8} {statistics.median(t) * 1e3:>9.1f} {min(t) * 1e3:>9.1f} {(ratio - 1) * 100:>+8.2f}%")
    print(f"per step over blocks of {args.steps} steps, medians of {len(res['wall']['plain'])} rounds; 'vs plain' is "
          f"the median of per-round ratios; {res['profiles']} profiles written by the monitored blocks")
    overhead = statistics.median(res["ratios"]["both"]) - 1
    print(f"rules every step + monitor at 200 ms: {overhead * 100:+.2f} % (goal <= {GOAL_OVERHEAD * 100:.0f} %: "
          f"{'PASS' if overhead <= GOAL_OVERHEAD else 'MISS'})")
    print(f"After: {load_average()}; {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
