"""Stage memory: does each rank hold only its share of a model too large for one device?

Model: a Llama-style causal LM from a ``transformers.LlamaConfig`` (``--layers`` layers of hidden ``--hidden``,
intermediate 2.75x, vocabulary 32,000, untied head; about 300M parameters at the defaults), random weights,
trained with Adam (``smp.DistributedOptimizer``) for ``--steps`` steps on batch 4 x 128 tokens in 4
microbatches, 1F1B, on 1, 2 and 4 gloo ranks of this host (``pipeline_parallel_degree`` = ranks). Each rank
builds the model two ways:

- ``normal``: built with its weights on every rank; after partitioning the other stages' tensors are released;
- ``delayed``: built under ``smp.delay_param_initialization()`` (parameters on the meta device), so a rank
  allocates and initialises only its own stages' parameters.

Printed per rank: the resident set size (RSS) right after building, the peak RSS of the whole run (``VmHWM``),
the peak after partitioning (``VmHWM`` reset by writing 5 to ``/proc/self/clear_refs`` after the first step),
and the parameters the rank holds. The verdicts: with ``delayed``, every rank of p peaks at most at
``1.2 x (single-process peak / p) + 300 MB``; with ``normal``, no rank's peak after partitioning exceeds the
single-process peak. Memory does not depend on the machine's load (printed anyway).

Run: ``python benchmarks/stage_memory.py [--layers 18] [--hidden 1024] [--steps 2] [--ranks 1 2 4]``: a few
minutes on two idle cores, about 12 GB of memory at the defaults.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import load_average  # noqa: E402
from smp.testing import run_ranks  # noqa: E402

_MB = 2 ** 20


def _status(field: str) -> int:
    """A ``/proc/self/status`` figure (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _config(layers: int, hidden: int) -> object:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
                       num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                       max_position_embeddings=256, use_cache=False, tie_word_embeddings=False)


def _rank(rank: int, world: int, mode: str, layers: int, hidden: int, steps: int) -> dict:
    from transformers import LlamaForCausalLM

    import smp

    smp.init({"pipeline_parallel_degree": world, "microbatches": 4, "timeout_s": 600})
    torch.manual_seed(0)
    if mode == "delayed":
        with smp.delay_param_initialization():
            net = LlamaForCausalLM(_config(layers, hidden))
    else:
        net = LlamaForCausalLM(_config(layers, hidden))
    built = _status("VmRSS")
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(model, ids):
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    ids = torch.randint(0, 32000, (4, 128), generator=torch.Generator().manual_seed(0))
    for i in range(steps):
        train_step(model, ids)
        opt.step()
        opt.zero_grad()
        if i == 0:  # built, partitioned, one step: the peak so far; then the peak from here on
            first = _status("VmHWM")
            with open("/proc/self/clear_refs", "w") as fh:  # resets VmHWM
                fh.write("5")
    after = _status("VmHWM")
    held = sum(p.numel() * p.element_size() for p in net.parameters() if not p.is_meta)
    total = sum(p.numel() for p in net.parameters())
    return {"built": built, "peak": max(first, after), "after": after, "held": held, "params": total}


def main(argv: list[str] | None = None) -> int:
    """Run every (ranks, mode) pair and print the table and the verdicts; exit 1 if a goal is missed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=2, help="at least 2")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args(argv)
    print(f"load average before: {load_average()}")
    rows = {}
    for world in args.ranks:
        for mode in ("normal", "delayed"):
            rows[world, mode] = run_ranks(_rank, world, mode, args.layers, args.hidden, args.steps, timeout=3600,
                                          pg_timeout=1200)
    params = rows[args.ranks[0], "normal"][0]["params"]
    print(f"model: Llama-style, {args.layers} layers, hidden {args.hidden}, {params / 1e6:.0f}M parameters; Adam\n")
    print(f"{'ranks':>5} {'mode':>8} {'rank':>4} {'built MB':>9} {'peak MB':>8} {'after MB':>9} {'params MB':>10}")
    for (world, mode), ranks in rows.items():
        for r, got in enumerate(ranks):
            print(f"{world:>5} {mode:>8} {r:>4} {got['built'] / _MB:>9.0f} {got['peak'] / _MB:>8.0f} "
                  f"{got['after'] / _MB:>9.0f} {got['held'] / _MB:>10.0f}")
    single = max(g["peak"] for g in rows.get((1, "normal"), rows[args.ranks[0], "normal"]))
    ok = True
    print()
    for world in args.ranks:
        goal = 1.2 * single / world + 300 * _MB
        worst = max(g["peak"] for g in rows[world, "delayed"])
        after = max(g["after"] for g in rows[world, "normal"])
        ok &= worst <= goal and after <= single
        print(f"p={world}: delayed worst peak {worst / _MB:.0f} MB vs goal {goal / _MB:.0f} MB "
              f"({'met' if worst <= goal else 'MISSED'}); normal worst peak after partitioning {after / _MB:.0f} MB vs "
              f"single-process peak {single / _MB:.0f} MB ({'met' if after <= single else 'MISSED'})")
    print(f"load average after: {load_average()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
