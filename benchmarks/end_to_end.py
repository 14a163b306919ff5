"""End to end: a training step with our plan and runtime vs what users run today, on real models.

For each model, on 2 gloo ranks of this host (one thread per rank, rank r pinned to core r), the same
microbatches, fp32:

* (a) ``ours``: ``partitioner.partition`` (the automatic plan) on our runtime, 1F1B; the model is traced with
  its loss (``trace(loss_fn=...)``) so the plan counts the loss the last stage computes, and every op is
  timed on this machine (``measure=True``, what a user planning on a CPU does); rank 0 plans and shares it;
* (b) ``torch``: ``torch.distributed.pipelining`` ``Schedule1F1B``, the model split by its tracer
  (``pipeline(..., split_spec=...)``) at equal layer counts (its tutorial's and torchtitan's default);
  where its tracer cannot split the model, the table says so with its error. Both runtimes keep no model
  outputs (``step(..., return_outputs=False)``), as a training loop that reads the loss would; torch's
  default would concatenate every microbatch's logits each step;
* (c) ``ours/layers``: that same equal-layer split on our runtime (is our runtime the reason we win?);
* (d) ``ours/params``: the equal-parameter split (DeepSpeed's default) on our runtime;
* (e) ``single``: one process running the whole model over the same microbatches;
* (f) ``smp``: the same model (built again from the same seed) through ``smp.DistributedModel`` and an
  ``@smp.step`` function that computes the loss and calls ``model.backward``, as an SMP v1 script does
  (``pipeline_parallel_degree`` 2, SMP's ``"interleaved"`` 1F1B): smp plans it itself, the step's loss priced
  (:mod:`smp.engine.step_loss`) and the ops timed (``trace_execution_times=True``), so (f)/(b) should match (a)/(b);
* ``ideal``: the bubble-bound step of plan (a) from its stages' forward and backward times (the loss
  included) measured in one process (:func:`partitioner.measure_stages`), simulated for 1F1B with free
  communication.

Every variant's loss is checked against the single-process loss (they compute the same thing). Steps are
timed from a barrier to a barrier; variants alternate inside every round, the order flipping each round;
the table shows medians, speed-ups are ratios of medians from the same run, and the load average is
printed before and after.

Run: ``python benchmarks/end_to_end.py [--models gpt2,t5,vit,unet] [--rounds 8] [--microbatches 8] [--batch 16]
[--no-split-heavy-linears]``;
``--quick`` runs GPT-2 at toy sizes for 2 rounds (every variant runs and agrees; the timings mean nothing).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load_average, pin  # noqa: E402
from smp.testing import run_ranks  # noqa: E402

GOAL_VS_TORCH = 1.10        # (a) over (b) on GPT-2 and T5
GOAL_SMP_VS_TORCH = 1.20    # (f), an SMP v1 script, over (b) on GPT-2 and T5
GOAL_NEVER_SLOWER = 0.98    # (a) over (b) on every model
GOAL_RUNTIME = 1.0          # (c) over (b): our runtime alone is no slower
GOAL_IDEAL = 0.90           # (a) reaches 90% of the bubble-bound ideal


class Logits(torch.nn.Module):
    """The model's ``.logits`` (or its plain output) for positional tensor inputs: one tensor out, tensors in.
    ``names`` passes the inputs by keyword (T5's decoder ids follow an optional mask), ``fixed`` adds
    constant keyword arguments; torch's pipeline tracer and our runtime both see ``forward(*tensors)``."""

    def __init__(self, model: torch.nn.Module, names: tuple[str, ...] = (), **fixed: Any):
        super().__init__()
        self.model = model
        self.names = names
        self.fixed = fixed

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = self.model(**dict(zip(self.names, args)), **self.fixed) if self.names else self.model(*args, **self.fixed)
        return getattr(out, "logits", out)


@dataclass
class Case:
    """One benchmark model: the module, one step's batch (split into microbatches by the runtimes), the loss,
    and the module path where an equal-layer split of two stages begins."""

    name: str
    model: torch.nn.Module
    args: tuple
    target: torch.Tensor
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    split_at: str


def _class_last(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Classes last, flattened as HF's and torchtitan's losses do (a class dim moved to 1 is 3x slower on CPU).
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def build_case(name: str, batch: int, quick: bool = False) -> Case:
    """Realistic per-stage work (each stage's step well above per-op overheads) with random weights; with
    ``quick``, the same models at toy sizes (a smoke test, not a measurement)."""
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedModel, T5Config, T5ForConditionalGeneration

    from smp import zoo

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    seq, hidden, layers = (32, 64, 4) if quick else (128, 256, 6)
    if name == "gpt2":  # the real 50,257-token vocabulary: the LM head is most of the work
        vocab = 2048 if quick else 50257
        config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=4, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=vocab - 1, eos_token_id=vocab - 1,
                            tie_word_embeddings=True, attn_implementation="eager")
        ids = torch.randint(vocab, (batch, seq), generator=gen)
        model = Logits(GPT2LMHeadModel(config), ("input_ids",), use_cache=False)
        return Case(name, model, (ids,), torch.roll(ids, -1, 1), _class_last, f"model.transformer.h.{layers // 2}")
    if name == "t5":  # encoder-decoder: every decoder layer reads the encoder output
        vocab, layers = (2048, layers // 2) if quick else (32128, 4)
        config = T5Config(vocab_size=vocab, d_model=hidden, d_kv=hidden // 8, d_ff=4 * hidden, num_layers=layers,
                          num_decoder_layers=layers, num_heads=8, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                          decoder_start_token_id=0, attn_implementation="eager")
        ids = torch.randint(vocab, (batch, seq), generator=gen)
        dec = torch.randint(vocab, (batch, seq // 2), generator=gen)
        model = Logits(T5ForConditionalGeneration(config), ("input_ids", "decoder_input_ids"), use_cache=False)
        return Case(name, model, (ids, dec), torch.roll(dec, -1, 1), _class_last, "model.decoder.block.0")
    zm = zoo.build(name, batch=batch, size="small" if quick else "base")
    if zm.kwargs:
        raise ValueError(f"zoo model {name!r} takes keyword inputs; the benchmark passes positional ones only")
    blocks = zm.model.get_submodule(zm.blocks)
    # HF zoo models answer an output object whose .logits the zoo loss reads; Logits hands over the tensor.
    loss_fn = _class_last if isinstance(zm.model, PreTrainedModel) else zm.loss_fn
    return Case(name, Logits(zm.model), zm.args, zm.target, loss_fn, f"model.{zm.blocks}.{len(blocks) // 2}")


def worker(rank: int, world: int, cfg: dict) -> dict | None:
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    import partitioner
    from partitioner.cut.baselines import baseline
    from partitioner.cut.portfolio import fixed_plan, make_problem
    from pipeline import PipelineRunner, microbatch
    from smp.engine.planning import shared_plan

    torch.set_num_threads(1)
    pin(rank, cfg)
    m = cfg["microbatches"]
    case = build_case(cfg["model"], cfg["batch"], cfg["quick"])
    model = case.model
    loss_fn = case.loss_fn
    args = tuple(a for a in case.args)
    mb_args = microbatch.split(args, {}, m)[0][0]
    mb_target = microbatch.split((case.target,), {}, m)[0][0][0]
    # The plan prices the loss the last stage computes, and every op timed on this machine (measure=True, as
    # a CPU user plans); rank 0 plans and shares it (smp.engine.planning.shared_plan), since timings differ per rank.
    plans: dict[str, Any] = {"ours": shared_plan(model, mb_args, {}, world, partitioner.PartitionOptions(
        microbatches=m, measure=True, split_heavy_linears=cfg["split"]), loss=(loss_fn, mb_target))}
    graph = partitioner.trace(model, mb_args, loss_fn=loss_fn, target=mb_target)
    options = partitioner.PartitionOptions(microbatches=m, rates=partitioner.DeviceRates())
    first = next(i for i, mod in enumerate(graph.modules)
                 if mod == case.split_at or mod.startswith(case.split_at + "."))
    plans["ours/layers"] = fixed_plan(graph, world, [0 if i < first else 1 for i in range(graph.num_nodes)], options)
    plans["ours/params"] = baseline(make_problem(graph, world, options), "params")
    runners = {k: PipelineRunner(p, schedule="1f1b", microbatches=m, timeout_s=300) for k, p in plans.items()}
    losses: dict[str, float] = {}
    runs: dict[str, Callable[[], None]] = {}
    for key, runner in runners.items():
        runs[key] = (lambda key=key, runner=runner:
                     losses.__setitem__(key, runner.step(args, target=case.target, loss_fn=loss_fn,
                                                         return_outputs=False).loss))
    torch_error = None
    try:
        pipe = pipeline(model, mb_args, split_spec={case.split_at: SplitPoint.BEGINNING})
        sched = Schedule1F1B(pipe.build_stage(rank, torch.device("cpu")), n_microbatches=m, loss_fn=loss_fn)

        def run_torch() -> None:
            if rank == 0:
                sched.step(*args, return_outputs=False)
            else:
                out: list = []
                sched.step(target=case.target, losses=out, return_outputs=False)
                losses["torch"] = sum(float(v.detach()) for v in out) / len(out)

        runs["torch"] = run_torch
    except Exception as exc:  # torch's tracer fails on many models: report it, compare with ours/layers
        torch_error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:100]}"

    def run_single() -> None:
        if rank == 0:
            total = 0.0
            for (a, _), t in zip(microbatch.split(args, {}, m), microbatch.split((case.target,), {}, m)):
                loss = loss_fn(model(*a), t[0][0])
                (loss / m).backward()
                total += float(loss.detach())
            losses["single"] = total / m

    runs["single"] = run_single
    runs["smp"], smp_model = _smp_variant(case, cfg, world, losses)
    wall: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():  # warm-up
        for _ in range(cfg["warmup"]):
            model.zero_grad(set_to_none=True)
            dist.barrier()
            fn()
    for rnd in range(cfg["rounds"]):
        for name in (list(runs) if rnd % 2 == 0 else list(runs)[::-1]):
            model.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            runs[name]()
            dist.barrier()
            wall[name].append(time.perf_counter() - t0)
    got: list = [None] * world
    dist.all_gather_object(got, losses)
    if rank != 0:
        return None
    merged = {k: v for part in got for k, v in part.items()}
    times = partitioner.measure_stages(runners["ours"].split_model, mb_args, {}, repeats=3)
    return {"wall": {k: statistics.median(v) for k, v in wall.items()}, "losses": merged, "torch_error": torch_error,
            "stage_f": times.forward_s, "stage_b": times.backward_s,
            "cuts": {k: [s.modules[0] for s in p.stages][1:]
                     for k, p in {**plans, "smp": smp_model.runner.plan}.items()}}


def _smp_variant(case: Case, cfg: dict, world: int, losses: dict[str, float]) -> tuple[Callable[[], None], Any]:
    """(f): a fresh copy of the model under ``smp`` (a DistributedModel keeps only its rank's stage): the step, and
    the DistributedModel."""
    import smp

    smp.init({"pipeline_parallel_degree": world, "microbatches": cfg["microbatches"], "pipeline": "interleaved"})
    model = smp.DistributedModel(build_case(cfg["model"], cfg["batch"], cfg["quick"]).model,
                                 trace_execution_times=True)  # the ops timed, as plan (a) times them

    @smp.step
    def train_step(model: Any, args: tuple, target: torch.Tensor) -> torch.Tensor:
        loss = case.loss_fn(model(*args), target)
        model.backward(loss)
        return loss

    def run() -> None:
        model.zero_grad(set_to_none=True)
        losses["smp"] = float(train_step(model, case.args, case.target).reduce_mean())

    return run, model


def ideal_step(forward_s: list[float], backward_s: list[float], m: int) -> float:
    """1F1B's step with these stage times and free communication: the bubble-bound ideal."""
    from pipeline.schedule import make_schedule
    from pipeline.simulate import simulate

    return simulate(make_schedule("1f1b", len(forward_s), m), forward_s, backward_s).step_s


def _ms(seconds: float | None, digits: int) -> str:
    """A table cell: milliseconds, or ``failed`` for a variant that did not run."""
    return "failed" if seconds is None else f"{seconds * 1e3:.{digits}f} ms"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=None, help="comma-separated, of gpt2,t5,vit,unet (default: all; "
                    "with --quick: gpt2)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 8; with --quick: 2)")
    ap.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8: GPipe's "
                    "m >= 4 x stages, so the bubble is small)")
    ap.add_argument("--batch", type=int, default=16, help="samples per step (all microbatches; default 16: "
                    "2 per microbatch)")
    ap.add_argument("--no-split-heavy-linears", dest="split", action="store_false", help="plan (a) keeps an LM "
                    "head that outweighs a stage whole (default: PartitionOptions.split_heavy_linears, column chunks "
                    "spread over the stages where that plan is better, as smp plans (f))")
    ap.add_argument("--no-pin", action="store_true", help="let the OS place the ranks (default: rank r on core r)")
    ap.add_argument("--quick", action="store_true", help="toy model sizes, 2 rounds, 1 warm-up step: checks that "
                    "every variant runs and computes the single-process loss, in seconds; not a measurement")
    opts = ap.parse_args(argv)
    opts.models = opts.models or ("gpt2" if opts.quick else "gpt2,t5,vit,unet")
    opts.rounds = opts.rounds or (2 if opts.quick else 8)
    print(f"# end to end, 2 ranks (gloo, 1 thread each), fp32, batch {opts.batch} in {opts.microbatches} "
          f"microbatches, {opts.rounds} alternating rounds, medians; {load_average()}", flush=True)
    head = (f"{'model':<6} {'(a) ours':>9} {'(b) torch':>9} {'(c) layers':>10} {'(d) params':>10} {'(e) single':>10} "
            f"{'(f) smp':>9} {'ideal':>7} {'a/b':>6} {'f/b':>6} {'c/b':>6} {'a/ideal':>7}  "
            "cuts (ours | layers | params | smp)")
    print(head)
    print("-" * len(head))
    misses = []
    for name in [m for m in opts.models.split(",") if m]:
        cfg = {"model": name, "rounds": opts.rounds, "microbatches": opts.microbatches, "batch": opts.batch,
               "pin": not opts.no_pin, "quick": opts.quick, "split": opts.split,
               "warmup": 1 if opts.quick else 2}
        res = run_ranks(worker, 2, cfg, timeout=3600, pg_timeout=600)[0]
        w, losses = res["wall"], res["losses"]
        for k, v in losses.items():
            if abs(v - losses["single"]) > 1e-4 * max(1.0, abs(losses["single"])):
                misses.append(f"{name}: loss of {k} {v:.6f} differs from single {losses['single']:.6f}")
        ideal = ideal_step(res["stage_f"], res["stage_b"], opts.microbatches)
        ref = w.get("torch", w["ours/layers"])  # with no torch run, our runtime on torch's split stands in
        cell = {k: _ms(dict(w, ideal=ideal).get(k), 1 if opts.quick else 0)
                for k in ("ours", "torch", "ours/layers", "ours/params", "single", "smp", "ideal")}
        cuts = " | ".join(",".join(res["cuts"][k]) for k in ("ours", "ours/layers", "ours/params", "smp"))
        print(f"{name:<6} {cell['ours']:>9} {cell['torch']:>9} {cell['ours/layers']:>10} {cell['ours/params']:>10} "
              f"{cell['single']:>10} {cell['smp']:>9} {cell['ideal']:>7} {ref / w['ours']:>6.3f} "
              f"{ref / w['smp']:>6.3f} {ref / w['ours/layers']:>6.3f} {ideal / w['ours']:>7.3f}  {cuts}", flush=True)
        if res["torch_error"]:
            print(f"       torch.distributed.pipelining could not split {name}: {res['torch_error']}; "
                  "a/b and c/b use (c) for (b)")
        print("       losses: " + ", ".join(f"{k} {v:.8f}" for k, v in sorted(losses.items())), flush=True)
        if opts.quick:  # toy sizes: the timings say nothing about the goals
            continue
        goal = GOAL_VS_TORCH if name in ("gpt2", "t5") else GOAL_NEVER_SLOWER
        if ref / w["ours"] < goal:
            misses.append(f"{name}: (a)/(b) = {ref / w['ours']:.3f} < {goal}")
        if name in ("gpt2", "t5") and ref / w["smp"] < GOAL_SMP_VS_TORCH:
            misses.append(f"{name}: (f)/(b) = {ref / w['smp']:.3f} < {GOAL_SMP_VS_TORCH}")
        if "torch" in w and w["torch"] / w["ours/layers"] < GOAL_RUNTIME:
            misses.append(f"{name}: (c)/(b) = {w['torch'] / w['ours/layers']:.3f} < {GOAL_RUNTIME}")
        if ideal / w["ours"] < GOAL_IDEAL:
            misses.append(f"{name}: (a) reaches {ideal / w['ours']:.3f} of the ideal < {GOAL_IDEAL}")
    print(f"# {load_average()}")
    print(f"# goals: a/b >= {GOAL_VS_TORCH} and f/b >= {GOAL_SMP_VS_TORCH} on gpt2 and t5, a/b >= {GOAL_NEVER_SLOWER} "
          f"everywhere; c/b >= {GOAL_RUNTIME}; "
          f"a/ideal >= {GOAL_IDEAL}" + (" (not checked with --quick)" if opts.quick else ""))
    for miss in misses:
        print(f"# MISSED: {miss}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
