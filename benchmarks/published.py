"""Published GPU training throughput beside the engine's prediction of it: the calibration of the GPU profiles.

Every row is one published measurement, with its citation: the model's shape, the GPUs, the parallel degrees, the
global batch, the sequence length and the published throughput (tokens/s per GPU, or model TFLOP/s per GPU where
that is what the source gives). Nothing is downloaded: each model is a ``transformers`` config built on the meta
device (:mod:`benchmarks.plan_scale` for the Llama 3 shapes), and each row is priced with the scorer ``smp plan``
uses for fixed degrees (:class:`partitioner.layout.score.LayoutScorer`, ``--tp T --pp P --dp D
--microbatch-size M``), beside the planner's own best layout for the same devices and batch (``--top 1``).

Rows have a role:

* ``calibrate`` -- ``--fit`` prints the efficiency factors of :func:`partitioner.cost.devices.profile`
  (``compute_efficiency``, ``memory_efficiency``) that minimise the sum of squared log ratios predicted / published
  over these rows (:func:`fit`, on :data:`GRID`), then over each GPU's rows apart. The two A100 rows give the
  profiles' 0.75; torchtitan's three H100 rows (500 W HBM2e parts whose peak is unpublished) give 0.5, which is
  theirs (:data:`TITAN_H100_COMPUTE`, in their ``gpu_changes``), not the SXM profile's: the profiles' 0.75 / 0.85 are
  kept (docs/benchmarks.md has the table);
* ``held-out`` -- Narayanan et al. (SC'21) Table 1, GPT 1.7B .. 1T on A100s: never used for the fit, printed apart
  as an independent check (issue 24);
* ``excluded`` -- kept for the record but not priced: they use what our runtime lacks (context parallelism,
  Float8, torch.compile, asynchronous TP).

FSDP (ZeRO-3) rows are priced as what they are: sharded data parallelism over the row's ``sdp`` replicas (our
runtime's ``sharded_data_parallel_degree``, :mod:`partitioner.sdp.shards`), every parameter sharded as FSDP does
(threshold 1) and, as FSDP prefetches all-gathers and reduce-scatters during compute (``Row.overlap``), only what
compute cannot hide exposed (:mod:`partitioner.sdp.overlap`, ``Pricing(overlap=True)``). Our runtime prefetches
the same units (:mod:`pipeline.param_gather`), so ``smp plan`` and the planner's best layout here price sdp so too.
Selective activation checkpointing, which our runtime lacks (it checkpoints whole stages), is
priced as torchtitan's "op" policy runs it (:class:`SelectiveCosts`: in each transformer block the backward
recomputes every other matmul and every op but attention). Each row's ``priced`` note says how. Memory is not
limited (``--device-memory unlimited``): memory is not what is calibrated here.

Collectives (:mod:`partitioner.tp.pricing`) are not fitted: the rows cannot separate link bandwidth from compute
efficiency (FSDP hides its collectives; tp runs within a node). :data:`COLLECTIVES` keeps the published NCCL
bus bandwidths they are checked against instead.

Run: ``python benchmarks/published.py [--rows KEY,...] [--roles calibrate,held-out] [--fit] [--no-search]``
(the Llama 405B, 70B and the largest GPT rows trace for a minute or more each on meta).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import load_average  # noqa: E402
from benchmarks.plan_scale import llama3  # noqa: E402
from partitioner.capture.graph import OpGraph  # noqa: E402
from partitioner.cost.devices import DeviceRates, profile  # noqa: E402
from partitioner.cost.roofline import NodeCosts  # noqa: E402
from partitioner.layout.costs import LayoutCosts  # noqa: E402

__all__ = ["Source", "Row", "ROWS", "COLLECTIVES", "GRID", "TITAN_H100_COMPUTE", "fit", "gpt_tokens_per_s", "rates_of",
           "selective_share", "SelectiveCosts", "Predictor", "main"]


@dataclass(frozen=True)
class Source:
    """Where a number was published: ``title`` and ``url``."""

    title: str
    url: str


@dataclass(frozen=True)
class Row:
    """One published measurement. ``model``: ``("llama3", "8b")`` or ``("gpt", layers, hidden, heads)`` (vocabulary
    51,200, SC'21); ``gpu``: a :data:`partitioner.cost.devices.PROFILES` name and ``gpu_changes`` what differs on the
    measured system; degrees ``tp``, ``pp``, ``dp`` (FSDP counted as dp); ``microbatch``: samples per microbatch
    (None: not published, the engine's best for the degrees); ``published``: the number, in ``unit``
    (``"tokens/s/GPU"`` or ``"TFLOP/s/GPU"``); ``checkpointing``: as published (none, selective, full);
    ``priced``: how our runtime's nearest equivalent was priced; ``role``: calibrate, held-out or excluded;
    ``sdp``: the replicas FSDP shards over (1: plain data parallelism); ``overlap``: the published system overlaps
    its sharded collectives with compute (FSDP's prefetch), priced so (:mod:`partitioner.sdp.overlap`)."""

    key: str
    source: Source
    where: str
    model: tuple[Any, ...]
    gpu: str
    devices: int
    tp: int
    pp: int
    dp: int
    global_batch: int
    seq: int
    published: float
    unit: str
    checkpointing: str
    role: str
    microbatch: int | None = None
    dtype: str = "bf16"
    gpu_changes: tuple[tuple[str, float], ...] = ()
    priced: str = ""
    mfu: float | None = None  # the source's own MFU, where it gives one
    sdp: int = 1
    overlap: bool = False


TITAN = Source("torchtitan, docs/performance.md (the runs of Liang et al., 'TorchTitan: One-stop PyTorch native "
               "solution for production ready LLM pre-training', ICLR 2025, arXiv:2410.06511)",
               "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md")
TITAN_2024 = Source("torchtitan, docs/performance.md as of 2024 (sections 'Llama 3.1 performance numbers' and "
                    "'Llama 3 performance numbers')",
                    "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md")
SC21 = Source("Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM', "
              "SC'21, arXiv:2104.04473", "https://arxiv.org/abs/2104.04473")
# torchtitan's Grand Teton H100s: HBM2e, 96 GB, 2.4 TB/s, 500 W (its docs); its peak FLOP/s is between the SXM's
# and the NVL's and not published, so the SXM peak stays (torchtitan computes its MFU the same way), and the share
# of it these power-capped parts reach is their own: fitted (--fit, per device) on the three calibration rows run on
# them, 0.5 of the SXM peak where the profile's SXM part has 0.75; no held-out row runs on them.
TITAN_H100_COMPUTE = 0.5
_TITAN_H100 = (("bytes_per_s", 2.4e12), ("grad_bytes_per_s", 2.4e12), ("memory_bytes", 96e9),
               ("compute_efficiency", TITAN_H100_COMPUTE))
_FSDP = "FSDP priced as sdp = dp, every parameter sharded, collectives overlapped with compute"
_SEL = "selective AC priced as torchtitan's op policy (every other matmul and the non-attention ops recomputed)"

ROWS: tuple[Row, ...] = (
    Row("titan-8b-8", TITAN, "Table 1, row FSDP (8 GPUs, local batch 2, selective AC)", ("llama3", "8b"),
        "h100-80gb", 8, 1, 1, 8, 16, 8192, 5762, "tokens/s/GPU", "selective", "calibrate", microbatch=2,
        gpu_changes=_TITAN_H100, priced=f"{_FSDP}; {_SEL}", sdp=8, overlap=True),
    Row("titan-8b-128", TITAN, "Table 3, row FSDP (128 GPUs, local batch 2, selective AC)", ("llama3", "8b"),
        "h100-80gb", 128, 1, 1, 128, 256, 8192, 5605, "tokens/s/GPU", "selective", "calibrate", microbatch=2,
        gpu_changes=_TITAN_H100, priced=f"{_FSDP}; {_SEL}", sdp=128, overlap=True),
    Row("titan-405b-128", TITAN_2024, "'Llama 3.1 performance numbers', row Optimizations None (128 H100 94GB, "
        "FSDP 16 x TP 8, local batch 2, full AC; MFU 29.0%)", ("llama3", "405b"), "h100-80gb", 128, 8, 1, 16, 32,
        8192, 109, "tokens/s/GPU", "full", "calibrate", microbatch=2,
        gpu_changes=(("memory_bytes", 94e9), ("compute_efficiency", TITAN_H100_COMPUTE)), priced=_FSDP, mfu=0.290,
        sdp=16, overlap=True),
    Row("titan-a100-8b-64", TITAN_2024, "'Llama 3 performance numbers', 8B selective op (64 A100 80GB, FSDP, "
        "local batch 1; MFU 58.2%)", ("llama3", "8b"), "a100-80gb", 64, 1, 1, 64, 64, 8192, 2973,
        "tokens/s/GPU", "selective", "calibrate", microbatch=1, priced=f"{_FSDP}; {_SEL}", mfu=0.582, sdp=64,
        overlap=True),
    Row("titan-a100-70b-64", TITAN_2024, "'Llama 3 performance numbers', 70B full AC (64 A100 80GB, FSDP, "
        "local batch 1; MFU 51.7%)", ("llama3", "70b"), "a100-80gb", 64, 1, 1, 64, 64, 8192, 331, "tokens/s/GPU",
        "full", "calibrate", microbatch=1, priced=_FSDP, mfu=0.517, sdp=64, overlap=True),
    # Excluded: Float8 and torch.compile (titan Tables 1, 3, 4, 5), context parallelism (Tables 2, 6).
    Row("titan-70b-256-fp8", TITAN, "Table 4, row 2D (FSDP 32 x TP 8, torch.compile + Float8)", ("llama3", "70b"),
        "h100-80gb", 256, 8, 1, 32, 512, 8192, 829, "tokens/s/GPU", "full", "excluded", microbatch=16,
        gpu_changes=_TITAN_H100, priced="not priced: Float8 and torch.compile"),
    Row("titan-405b-512-fp8", TITAN, "Table 5, row 1F1B (FSDP 8 x TP 8 x PP 8, torch.compile + Float8 + AsyncTP)",
        ("llama3", "405b"), "h100-80gb", 512, 8, 8, 8, 256, 8192, 100, "tokens/s/GPU", "full", "excluded",
        gpu_changes=_TITAN_H100, priced="not priced: Float8, torch.compile, asynchronous TP"),
    # SC'21 Table 1 (weak scaling, A100 80GB on Selene, vocabulary 51,200, sequence 2,048, mixed precision, with
    # activation recomputation): the published TFLOP/s count Eq. 3's FLOPs, recomputation included.
    *(Row(f"sc21-{name}", SC21, f"Table 1, {name} row", ("gpt", layers, hidden, heads), "a100-80gb", t * p * d, t,
          p, d, batch, 2048, tflops, "TFLOP/s/GPU", "full", "held-out",
          priced="1F1B, full recomputation, attention from score matrices (eager); microbatch not in Table 1: the "
                 "engine's best for the degrees")
      for name, heads, hidden, layers, t, p, d, batch, tflops in (
          ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137), ("3.6B", 32, 3072, 30, 2, 1, 32, 512, 138),
          ("7.5B", 32, 4096, 36, 4, 1, 32, 512, 142), ("18.4B", 48, 6144, 40, 8, 1, 32, 1024, 135),
          ("39.1B", 64, 8192, 48, 8, 2, 32, 1536, 138), ("76.1B", 80, 10240, 60, 8, 4, 32, 1792, 140),
          ("145.6B", 96, 12288, 80, 8, 8, 24, 2304, 148), ("310.1B", 128, 16384, 96, 8, 16, 15, 2160, 155),
          ("529.6B", 128, 20480, 105, 8, 35, 9, 2520, 163), ("1008B", 160, 25600, 128, 8, 64, 6, 3072, 163))),
)

# Published NCCL all-reduce bus bandwidth at large messages, one node of 8 GPUs, against the link profiles'
# datasheet figures (partitioner.cost.devices.LINKS): a ring moves 2 (n-1)/n of the bytes per rank, so bus bandwidth
# is what the ring's per-link rate reaches. Source: Alaya New, 'NCCL-tests in practice' (2026), reference table.
COLLECTIVES = (
    ("nvlink3", "8 x A100 SXM4, all_reduce_perf busbw", 230e9, 250e9),
    ("nvlink4", "8 x H100 SXM5, all_reduce_perf busbw (NVLS)", 460e9, 480e9),
)
COLLECTIVES_SOURCE = Source("Alaya New, 'NCCL-tests in practice -- the mandatory pre-launch health check'",
                            "https://docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests")

# The fit's grid: compute efficiency of the tensor-core peak, memory efficiency of the bandwidth.
GRID = {"compute": tuple(round(0.30 + 0.05 * i, 2) for i in range(11)), "memory": (0.7, 0.85)}


def gpt_tokens_per_s(row: Row) -> float:
    """Tokens/s per GPU of a SC'21 row: its TFLOP/s over Eq. 3's FLOPs per token,
    ``96 l h^2 (1 + s / 6h + V / 16 l h)`` (recomputation included, as the paper counts it)."""
    _, layers, hidden, _ = row.model
    per_token = 96 * layers * hidden ** 2 * (1 + row.seq / (6 * hidden) + 51200 / (16 * layers * hidden))
    return row.published * 1e12 / per_token


def published_tokens(row: Row) -> float:
    """The row's published throughput in tokens/s per GPU."""
    return row.published if row.unit == "tokens/s/GPU" else gpt_tokens_per_s(row)


def rates_of(row: Row, compute: float | None = None, memory: float | None = None) -> DeviceRates:
    """The row's device: its profile, what the measured system changes, and the efficiencies (None: the profile's)."""
    changes: dict[str, Any] = dict(row.gpu_changes)
    if compute is not None:
        changes["compute_efficiency"] = compute
    if memory is not None:
        changes["memory_efficiency"] = memory
    return dataclasses.replace(profile(row.gpu), **changes)


def build(row: Row) -> tuple[torch.nn.Module, tuple]:
    """The row's model on the meta device and one sequence of token ids."""
    if row.model[0] == "llama3":
        return llama3(row.model[1], row.seq)
    import transformers

    _, layers, hidden, heads = row.model
    # OPT is GPT-3's block (pre-LayerNorm, learned positions, a 4h MLP) written with nn.Linear, which the
    # tensor-parallel sharding splits; GPT-2's fused Conv1D projections it does not.
    # SC'21's Megatron-LM computed attention from explicit score matrices (batched matmuls around its fused
    # scale-mask-softmax; FlashAttention came a year later): traced eager, the b x heads x s x s scores and their
    # memory-bound passes are priced, which weigh most at the smallest hidden sizes.
    cfg = transformers.OPTConfig(vocab_size=51200, max_position_embeddings=row.seq, hidden_size=hidden,
                                 num_hidden_layers=layers, num_attention_heads=heads, ffn_dim=4 * hidden,
                                 word_embed_proj_dim=hidden, use_cache=False, attn_implementation="eager")
    with torch.device("meta"):
        return transformers.OPTForCausalLM(cfg), (torch.zeros(1, row.seq, dtype=torch.long),)


def selective_share(graph: OpGraph) -> np.ndarray:
    """Per op, the share of its forward that torchtitan's op-level selective activation checkpointing recomputes in
    the backward (``torchtitan/distributed/activation_checkpoint.py``: each block under ``layers`` is wrapped; its
    policy saves the outputs of ``aten.mm`` but every second one, of attention and of reduce-scatters): half of a
    block's matmuls, none of its attention, all its other ops; none outside the blocks (embedding, norm, head)."""
    share = {"aten.linear": 0.5, "aten.mm": 0.5, "aten.matmul": 0.5, "aten.scaled_dot_product_attention": 0.0}
    return np.array([share.get(kind, 1.0) if ".layers." in f".{module}." else 0.0
                     for kind, module in zip(graph.kinds, graph.modules)])


class SelectiveCosts(LayoutCosts):
    """:class:`partitioner.layout.costs.LayoutCosts` whose backward seconds include the recomputation of
    torchtitan's op-level selective activation checkpointing (:func:`selective_share` of each op's forward)."""

    def costs(self, tp: int, size: int, ep: int = 1, across: DeviceRates | None = None, cp: int = 1) -> NodeCosts:
        """The per-op seconds, each op's backward with its recomputed share of its forward added (cached)."""
        done: dict[tuple, NodeCosts] = self.__dict__.setdefault("_selective", {})
        key = (tp, size, ep, across, cp)
        if key not in done:
            base = super().costs(tp, size, ep, across, cp)
            extra = base.forward_s * selective_share(self.graph(tp, size, ep, cp))
            done[key] = dataclasses.replace(base, backward_s=base.backward_s + extra)
        return done[key]


def fit(ratios: Callable[[float, float], Sequence[float]], compute: Sequence[float] = GRID["compute"],
        memory: Sequence[float] = GRID["memory"]) -> tuple[float, float, float]:
    """The grid point ``(compute, memory)`` whose predicted / published ``ratios`` have the least sum of squared
    logs, and that sum (least squares on the log ratio: over- and under-prediction by the same factor weigh alike)."""
    best = (math.inf, 0.0, 0.0)
    for c in compute:
        for m in memory:
            loss = sum(math.log(r) ** 2 for r in ratios(c, m))
            best = min(best, (loss, c, m))
    if not math.isfinite(best[0]):
        raise ValueError("no grid point gives finite ratios: check that every row was priced")
    return best[1], best[2], best[0]


class Predictor:
    """One row, traced once on meta; :meth:`score` prices its published layout under any efficiencies and
    :meth:`best` runs the planner's search for the same devices and batch."""

    def __init__(self, row: Row) -> None:
        from partitioner.layout.costs import layout_costs
        from partitioner.layout.search import tp_choices

        self.row = row
        self.model, self.args = build(row)
        self._sizes = self._microbatches()
        tps = tp_choices(row.devices, 8, _heads(self.model))
        self.costs = layout_costs(self.model, self.args, {}, sizes=self._sizes, tp_degrees=sorted({*tps, row.tp}),
                                  rates=rates_of(row), dtype=row.dtype)

    def _microbatches(self) -> list[int]:
        replica = self.row.global_batch // self.row.dp
        return [self.row.microbatch] if self.row.microbatch else [b for b in range(1, replica + 1) if replica % b == 0]

    def scorer(self, rates: DeviceRates) -> Any:
        """A :class:`partitioner.layout.score.LayoutScorer` of this row's traces under ``rates``."""
        from partitioner.cut.options import UNLIMITED, PartitionOptions
        from partitioner.layout.score import LayoutScorer, Pricing
        from partitioner.sdp.shards import PERSISTENCE_THRESHOLD
        from pipeline.stage_simulation import pipeline_simulator

        c = self.costs
        kind = SelectiveCosts if self.row.checkpointing == "selective" else LayoutCosts
        costs = kind(c.lines, c.whole, rates, self.row.dtype, c.skipped, c.tokens_per_sample)
        options = PartitionOptions(rates=rates, dtype=self.row.dtype, device_memory=UNLIMITED)
        # FSDP shards every parameter (no persistence threshold); overlap as the published system ran
        threshold = 1 if self.row.sdp > 1 else PERSISTENCE_THRESHOLD
        return LayoutScorer(costs, Pricing(options, 8, threshold, overlap=self.row.overlap), pipeline_simulator)

    def _space(self, fixed: bool) -> Any:
        from partitioner.layout.search import SearchSpace

        r = self.row
        whole = next(iter(self.costs.whole.traced.values()))
        most = sum(k != "output" for k in whole.kinds)
        if not fixed:
            return SearchSpace(devices=r.devices, global_batch=r.global_batch, ranks_per_node=8, max_stages=most)
        ckpt = "full" if r.checkpointing == "full" else "none"
        return SearchSpace(devices=r.devices, global_batch=r.global_batch, ranks_per_node=8, tp=(r.tp,), pp=(r.pp,),
                           dp=(r.dp,), microbatch_size=tuple(self._sizes), schedules=("1f1b",),
                           checkpointing=(ckpt,), zero1=(False,), sdp=(r.sdp,), placements=("DPT",), max_stages=most)

    def score(self, rates: DeviceRates) -> Any:
        """The published layout's :class:`partitioner.layout.layout.Proposal` under ``rates`` (the best microbatch size
        when the row has none)."""
        from partitioner.layout.search import candidates, search

        return search(candidates(self._space(True), self.costs.tp_degrees), self.scorer(rates), 1).proposals[0]

    def best(self, rates: DeviceRates) -> Any:
        """The planner's best layout for the row's devices and global batch (within one node's memory budget)."""
        from partitioner.cut.options import PartitionOptions
        from partitioner.layout.costs import layout_costs
        from partitioner.layout.score import LayoutScorer, Pricing
        from partitioner.layout.search import candidates, search, tp_choices
        from pipeline.stage_simulation import pipeline_simulator

        space = self._space(False)
        tps = tp_choices(self.row.devices, 8, _heads(self.model))
        sizes = {lay.microbatch_size for lay in candidates(space, tps)}
        costs = layout_costs(self.model, self.args, {}, sizes=sizes, tp_degrees=tps, rates=rates, dtype=self.row.dtype)
        scorer = LayoutScorer(costs, Pricing(PartitionOptions(rates=rates, dtype=self.row.dtype), 8),
                              pipeline_simulator)
        return search(candidates(space, costs.tp_degrees), scorer, 1).proposals[0]


def _heads(model: torch.nn.Module) -> tuple[int, ...]:
    from partitioner.layout.costs import head_counts

    return head_counts(model)


def _tokens(proposal: Any, row: Row) -> float:
    return float(proposal.score.tokens_per_s) / row.devices


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [header, ["-" * w for w in widths],
                                                                               *rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", help="comma-separated row keys (default: every priced row of --roles)")
    ap.add_argument("--roles", default="calibrate,held-out", help="calibrate, held-out (default both)")
    ap.add_argument("--fit", action="store_true", help="refit the efficiencies on the calibration rows run")
    ap.add_argument("--no-search", action="store_true", help="skip the planner's own best layout per row")
    opts = ap.parse_args(argv)
    torch.set_num_threads(1)
    keys = set(opts.rows.split(",")) if opts.rows else None
    roles = set(opts.roles.split(","))
    chosen = [r for r in ROWS if r.role != "excluded" and (r.key in keys if keys else r.role in roles)]
    print(f"# published GPU throughput vs the engine (bf16); before: {load_average()}", flush=True)
    predictors: dict[str, Predictor] = {}
    for row in chosen:
        t0 = time.perf_counter()
        predictors[row.key] = Predictor(row)
        print(f"  traced {row.key} in {time.perf_counter() - t0:.0f} s", flush=True)
    if opts.fit:
        calib = [predictors[r.key] for r in chosen if r.role == "calibrate"]
        for gpu in ("", *sorted({p.row.gpu for p in calib})):  # every row, then each GPU's rows apart
            some = [p for p in calib if gpu in ("", p.row.gpu)]
            c, m, loss = fit(lambda c, m: [_tokens(p.score(rates_of(p.row, c, m)), p.row) / published_tokens(p.row)
                                           for p in some])  # noqa: B023 (called at once, in this iteration)
            print(f"# fit over {len(some)} calibration rows{gpu and ' on ' + gpu}: compute_efficiency {c}, "
                  f"memory_efficiency {m} (sum of squared log ratios {loss:.3f})")
    for role in ("calibrate", "held-out"):
        lines = []
        for row in (r for r in chosen if r.role == role):
            p = predictors[row.key]
            got = p.score(rates_of(row))
            ratio = _tokens(got, row) / published_tokens(row)
            best = "-" if opts.no_search else _describe(p.best(rates_of(row)), row)
            lines.append([row.key, f"{row.devices}", f"tp{row.tp} pp{row.pp} dp{row.dp}",
                          f"{got.layout.microbatches}x{got.layout.microbatch_size}", f"{published_tokens(row):,.0f}",
                          f"{_tokens(got, row):,.0f}", f"{ratio:.2f}", "yes" if abs(ratio - 1) <= 0.2 else "MISS",
                          best])
        if lines:
            print(f"\n## {role} rows (tokens/s per GPU; within 20 %: the goal)")
            header = ["row", "GPUs", "degrees", "m x mb", "published", "predicted", "ratio", "20%", "planner's best"]
            print(_table(header, lines))
    print("\n## sources and how each row was priced")
    for row in chosen:
        print(f"  {row.key}: {row.source.title}, {row.where}; {row.published:g} {row.unit}; priced: {row.priced}")
    print(f"\n## collectives: published NCCL bus bandwidth ({COLLECTIVES_SOURCE.title})")
    from partitioner.cost.devices import LINKS
    for link, what, lo, hi in COLLECTIVES:
        print(f"  {link}: {what} {lo / 1e9:.0f}-{hi / 1e9:.0f} GB/s; profile {LINKS[link].bytes_per_s / 1e9:.0f} GB/s")
    print(f"# after: {load_average()}")
    return 0


def _describe(proposal: Any, row: Row) -> str:
    lay = proposal.layout
    return (f"pp{lay.pp} tp{lay.tp} dp{lay.dp} {lay.microbatches}x{lay.microbatch_size} {lay.schedule}"
            f"{' ckpt' if lay.checkpointing != 'none' else ''}{' zero1' if lay.zero1 else ''}"
            f"{f' sdp{lay.sdp}' if lay.sdp > 1 else ''}: "
            f"{_tokens(proposal, row):,.0f} tok/s/GPU")


if __name__ == "__main__":
    raise SystemExit(main())
