"""Stage memory: does each rank hold only its share of a model too large for one device?

Model: a Llama-style causal LM from a ``transformers.LlamaConfig`` (``--layers`` layers of hidden ``--hidden``,
intermediate 2.75x, vocabulary 32,000, untied head; about 300M parameters at the defaults), random weights,
trained with Adam (``smp.DistributedOptimizer``) for ``--steps`` steps on batch 4 x 128 tokens in 4
microbatches, 1F1B, under ``"optimize": --optimize`` (SMP's key: ``memory`` weighs memory balance 0.8 against
time, ``speed`` 0.2), in each layout of gloo ranks of this host: ``ppN`` is N pipeline ranks
(``pipeline_parallel_degree`` = N, one per ``--ranks`` entry), ``sdpD`` is D ranks of sharded data parallelism
(``sharded_data_parallel_degree`` = D) and ``ppPxsdpD`` P stages each sharded over D replicas (one per ``--sharded``
entry); the replicas split the same global batch. A layout is a name, a rank count and the smp
config keys that make it (:class:`Layout`); everything per layout is a function of one. Each rank builds the
model two ways:

- ``normal``: built with its weights on every rank; after partitioning the other stages' tensors are released;
- ``delayed``: built under ``smp.delay_param_initialization()`` (parameters on the meta device), so a rank
  allocates and initialises only its own stages' parameters.

Printed per rank: the resident set size (RSS) right after building, the peak RSS of the whole run (``VmHWM``),
the peak after partitioning (``VmHWM`` reset by writing 5 to ``/proc/self/clear_refs`` after the first step),
and the parameters the rank holds. F is the RSS of a process once torch, transformers and smp are imported,
measured in the single-process run; the single-process peak S is the peak of the first layout's ``normal``
run (``pp1`` at the defaults). The verdicts, per layout of p ranks: with ``delayed``, every rank peaks at most
at ``1.2 x (S - F) / p + F + 100 MB`` (its share of what the model costs one process, 20 % and 100 MB of
slack, plus what every process pays before any model exists); with ``normal``, no rank's peak after
partitioning exceeds S. A sharded layout is printed against the same goal, which it need not meet (each replica
keeps the whole model's activations for its part of the batch and, with several microbatches, its stage's whole
gradients until the step's last backward); it must have no more parameters whole at once than the plan says
(``partitioner.sdp.shards``: the largest first-to-last-read window), from the trace of each rank's gathers in the
last step (rank 0's printed per layer), and its worst peak above F is printed beside the plan's predicted peak.
Memory does not depend on the machine's load (printed anyway).

Run: ``python benchmarks/stage_memory.py [--layers 18] [--hidden 1024] [--steps 2] [--ranks 1 2 4]
[--sharded sdp2 sdp4 pp2xsdp2] [--optimize memory]``: ten minutes or so on two idle cores, about 12 GB of memory at
the defaults.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import load_average  # noqa: E402
from smp.testing import run_ranks  # noqa: E402

_MB = 2 ** 20
MODES = ("normal", "delayed")


@dataclass(frozen=True)
class Layout:
    """One way to run the model: its name in the table, how many ranks, and the smp config keys that make it."""

    name: str
    ranks: int
    config: dict[str, Any]


def pipeline(ranks: int) -> Layout:
    """``ranks`` pipeline stages, one per rank."""
    return Layout(f"pp{ranks}", ranks, {"pipeline_parallel_degree": ranks})


def sharded(name: str) -> Layout:
    """``sdpD`` (D ranks, sharded data parallelism of degree D) or ``ppPxsdpD`` (P stages, each sharded over D
    replicas): the global batch is the same as a single process's, split over the D replicas."""
    pp, _, sdp = name.rpartition("sdp")
    stages = int(pp.removeprefix("pp").removesuffix("x")) if pp else 1
    return Layout(name, stages * int(sdp), {"pipeline_parallel_degree": stages, "ddp": True,
                                            "sharded_data_parallel_degree": int(sdp)})


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


def _rank(rank: int, world: int, layout: Layout, mode: str, optimize: str, layers: int, hidden: int,
          steps: int) -> dict:
    from transformers import LlamaForCausalLM

    import smp

    floor = _status("VmRSS")  # F: torch, transformers and smp imported, nothing else yet
    replicas = world // layout.config["pipeline_parallel_degree"]  # each reads its part of the one global batch
    smp.init({**layout.config, "microbatches": 4 // replicas, "optimize": optimize, "timeout_s": 600})
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

    ids = torch.randint(0, 32000, (4, 128), generator=torch.Generator().manual_seed(0)).chunk(replicas)[smp.dp_rank()]
    for i in range(steps):
        gather = model.runner.gather if model.runner is not None else None
        if gather is not None and i == steps - 1:  # the last step's gathers, for the trace
            gather.record = True
        train_step(model, ids)
        opt.step()
        opt.zero_grad()
        if i == 0:  # built, partitioned, one step: the peak so far; then the peak from here on
            first = _status("VmHWM")
            with open("/proc/self/clear_refs", "w") as fh:  # resets VmHWM
                fh.write("5")
    after = _status("VmHWM")
    held = sum(local.numel() * local.element_size() for local in (p.to_local() if isinstance(p, DTensor) else p
                                                                  for p in net.parameters()) if not local.is_meta)
    total = sum(p.numel() for p in net.parameters())
    out = {"floor": floor, "built": built, "peak": max(first, after), "after": after, "held": held, "params": total}
    if gather is not None:  # what the plan says is whole at once on this rank, and what was
        from partitioner.sdp.shards import sharded_dp
        plan = model.partition_plan()
        assert plan is not None  # partitioned at the first step
        planned = sharded_dp(plan, plan.traced_graph(), layout.config["sharded_data_parallel_degree"],
                             replicas=replicas)[smp.pp_rank()]
        out.update(trace=[tuple(e) for e in gather.trace], planned=planned.gathered_bytes,
                   predicted=planned.peak_bytes)
    return out


def run_layout(layout: Layout, args: argparse.Namespace) -> dict[str, list[dict]]:
    """Every mode of ``layout``: per mode, each rank's figures (:func:`_rank`)."""
    return {mode: run_ranks(_rank, layout.ranks, layout, mode, args.optimize, args.layers, args.hidden, args.steps,
                            timeout=3600, pg_timeout=1200) for mode in MODES}


def goal(layout: Layout, single: float, floor: float) -> float:
    """The most a rank of ``layout`` may peak at with delayed initialisation: its share of what the model costs
    a single process (peak ``single``, ``floor`` of it before any model), with 20 % and 100 MB to spare."""
    return 1.2 * (single - floor) / layout.ranks + floor + 100 * _MB


def verdict(layout: Layout, rows: dict[str, list[dict]], single: float, floor: float) -> tuple[bool, str]:
    """Whether ``layout`` met its goals, and the line that says so with the numbers. A pipeline layout must meet the
    share goal; a sharded one is shown against it (a replica keeps the whole model's activations for its part of the
    batch, and with several microbatches its stage's whole gradients until the step's last backward), and must
    have no more whole at once than its plan says, with its measured peak above F beside the plan's prediction."""
    most = goal(layout, single, floor)
    worst = max(g["peak"] for g in rows["delayed"])
    after = max(g["after"] for g in rows["normal"])
    ok = after <= single
    trace = rows["delayed"][0].get("trace")
    extra = ""
    if trace:  # no more whole at once than the plan says, on every rank
        whole = max(max(e[3] for e in g["trace"]) - g["planned"] for g in rows["delayed"])
        ok &= whole <= 0
        predicted = max(g["predicted"] for g in rows["delayed"])
        extra = (f"; whole at once {'within' if whole <= 0 else 'OVER'} the plan; worst peak - F "
                 f"{(worst - floor) / _MB:.0f} MB vs predicted {predicted / _MB:.0f} MB (partitioner.sdp.shards)")
    else:
        ok &= worst <= most
    return ok, (f"{layout.name}: delayed worst peak {worst / _MB:.0f} MB vs goal {most / _MB:.0f} MB = 1.2 x "
                f"({single / _MB:.0f} - {floor / _MB:.0f}) / {layout.ranks} + {floor / _MB:.0f} + 100 "
                f"({'met' if worst <= most else 'MISSED'}); normal worst peak after partitioning {after / _MB:.0f} MB "
                f"vs single-process peak {single / _MB:.0f} MB ({'met' if after <= single else 'MISSED'}){extra}")


def print_trace(layout: Layout, got: dict) -> None:
    """Rank 0's gathers in the last step, a line per layer: the most bytes whole at once while gathering its
    parameters in the forward and again in the backward, against the plan's gathered bytes for the rank."""
    by_layer: dict[str, list[int]] = {}
    for name, backward, _, live in got["trace"]:
        parts = name.split(".")
        layer = ".".join(parts[:3]) if "layers" in parts else ".".join(parts[:-1])
        row = by_layer.setdefault(layer, [0, 0])
        row[int(backward)] = max(row[int(backward)], live)
    print(f"{layout.name} rank 0, gathered parameters whole at once (MB), planned at most "
          f"{got['planned'] / _MB:.1f} MB:")
    for layer, (fwd, bwd) in by_layer.items():
        print(f"  {layer:<28} forward {fwd / _MB:7.1f}   backward {bwd / _MB:7.1f}")


def main(argv: list[str] | None = None) -> int:
    """Run every layout in both modes and print the table and the verdicts; exit 1 if a goal is missed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=2, help="at least 2")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="pipeline layouts: ranks of each")
    ap.add_argument("--sharded", nargs="*", default=["sdp2", "sdp4", "pp2xsdp2"],
                    help="sharded-data-parallel layouts: sdpD or ppPxsdpD")
    ap.add_argument("--optimize", choices=("speed", "memory"), default="memory", help="smp's 'optimize' key")
    args = ap.parse_args(argv)
    print(f"load average before: {load_average()}")
    layouts = [pipeline(r) for r in args.ranks] + [sharded(n) for n in args.sharded]
    rows = {layout.name: run_layout(layout, args) for layout in layouts}
    reference = rows[layouts[0].name]["normal"][0]  # the single process when the first layout has one rank
    single, floor = float(reference["peak"]), float(reference["floor"])
    print(f"model: Llama-style, {args.layers} layers, hidden {args.hidden}, {reference['params'] / 1e6:.0f}M "
          f"parameters; Adam; optimize={args.optimize}; F = {floor / _MB:.0f} MB (RSS with torch, transformers "
          f"and smp imported)\n")
    print(f"{'layout':>6} {'mode':>8} {'rank':>4} {'built MB':>9} {'peak MB':>8} {'after MB':>9} {'params MB':>10}")
    for layout in layouts:
        for mode, ranks in rows[layout.name].items():
            for r, got in enumerate(ranks):
                print(f"{layout.name:>6} {mode:>8} {r:>4} {got['built'] / _MB:>9.0f} {got['peak'] / _MB:>8.0f} "
                      f"{got['after'] / _MB:>9.0f} {got['held'] / _MB:>10.0f}")
    print()
    for layout in layouts:
        if rows[layout.name]["delayed"][0].get("trace"):
            print_trace(layout, rows[layout.name]["delayed"][0])
    print()
    ok = True
    for layout in layouts:
        met, line = verdict(layout, rows[layout.name], single, floor)
        ok &= met
        print(line)
    print(f"load average after: {load_average()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
