"""The step model against real steps: predicted vs measured step of the zoo models trained through ``@smp.step``.

For each zoo model (``smp.zoo``, small size, random weights), on 2 gloo ranks of this host (one thread per rank, as
``smp launch`` runs them; rank r pinned to core r, ``--no-pin`` to not), fp32: ``smp.init`` with
``pipeline_parallel_degree`` 2, ``--microbatches`` microbatches of the zoo's example batch (``--batch``) and SMP's
``"interleaved"`` pipeline and an ``@smp.step`` function that calls the model, the zoo's loss and ``model.backward``,
as a user writes it. Each model runs twice: ``smp.DistributedModel`` with ``trace_execution_times=True`` (the cut made
from the ops timed on this machine) and with SMP's default ``False`` (the cost model's cut; on a CPU its stages are
priced by timing their ops all the same: ``PartitionOptions.time_prices``). Every run times its ops afresh
(``SMP_RECALIBRATE=1`` unless set): a shared machine's speed drifts by tens of per cent in minutes, so the op times
are taken beside the steps they predict, not read from an earlier run's cache.

* ``predicted``: the plan the run made, priced by :func:`pipeline.step_model.predict_step` (its stages' op seconds,
  the per-pass and per-step costs of this machine's ``cpu`` profile, the transfers), what ``smp inspect`` and the
  profile's report print for it;
* ``measured``: the median ``@smp.step`` call, timed from a barrier to a barrier (``--steps`` steps after two
  warm-up steps; the optimizer is not in it, as it is not in the report's step).

The per-pass and per-step costs are this machine's, measured first beside the steps they predict
(:mod:`smp.cli.runtime_costs`, what ``smp calibrate`` shows). Goal (issue 24, item 5): every row within 25 %,
both cuts. ``--fit`` also prints the per-pass and per-step costs that would fit these rows best (least squares on the
relative error): a check of the measured ones.

``--plan``: ``smp plan``'s choice re-measured against the layouts it passed over. For ``--plan-model`` (a zoo name, or
``llama`` for :func:`llama_7m`: a user's ``transformers`` Llama of 7.2M parameters with its loss, the issue's model)
and a global batch of ``--plan-batch``, ``smp plan --devices 2`` prices its ``--plan-top`` best layouts; each is
priced again with its degrees fixed (``smp plan --config``: its smp config, and its cut for a pipeline) and trained
through ``smp.init(config)``, ``@smp.step`` and ``smp.DistributedOptimizer(torch.optim.Adam(...))`` on 2 ranks (each
rank its share of the global batch); its median step (barrier to barrier, the optimizer step in it, as ``smp plan``'s
step has it) is printed beside the plan's ``step_s``. Goal (issue 38, item 5): within 25 %, and the layout ``smp
plan`` chose measured the fastest or within the run-to-run spread of it.

``--repeats N`` runs every model and cut (and plans and runs every ``--plan`` layout) N times, interleaved (the
machine drifts alike for all), and prints the median predicted and measured steps, the median error and every run's
error.

Run: ``python benchmarks/step_model.py [--models gpt2 bert ...] [--steps 9] [--microbatches 4] [--repeats 3] [--fit]
[--plan [--plan-model llama] [--plan-top 4]]``: a few seconds per model, layout and run on two idle cores.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load_average, pin  # noqa: E402
from partitioner.cost import calibration  # noqa: E402
from smp.cli.runtime_costs import ensure_runtime_costs  # noqa: E402
from smp.testing import run_ranks  # noqa: E402
from smp.zoo import NAMES  # noqa: E402

GOAL = 0.25
PLAN_GOAL = 0.25
LLAMA = f"{Path(__file__).resolve()}:llama_7m"  # smp plan's TARGET of the user's Llama


def _step_function(z: Any) -> Any:
    """The ``@smp.step`` function a user writes for zoo model ``z``: the model, its loss, ``model.backward``."""
    import smp

    @smp.step
    def train_step(model: Any, args: tuple, kwargs: dict, target: torch.Tensor) -> torch.Tensor:
        loss = z.loss_fn(model(*args, **kwargs), target)
        model.backward(loss)
        return loss

    return train_step


def worker(rank: int, world: int, cfg: dict) -> dict[str, Any] | None:

    import smp
    from smp import zoo

    torch.set_num_threads(1)
    pin(rank, cfg)
    m = cfg["microbatches"]
    smp.init({"pipeline_parallel_degree": world, "microbatches": m, "pipeline": "interleaved"})
    z = zoo.build(cfg["model"], batch=cfg["batch"] * m)
    model = smp.DistributedModel(z.model, trace_execution_times=cfg["timed_cut"])
    train_step = _step_function(z)

    measured = _timed_steps(rank, cfg, lambda: train_step(model, z.args, z.kwargs, z.target),
                            before=lambda: z.model.zero_grad(set_to_none=True))
    return {"measured_s": measured, **_plan_rows(model)} if rank == 0 else None


def llama_7m() -> tuple[torch.nn.Module, tuple]:
    """``smp plan``'s TARGET for a user's model: a ``transformers`` Llama of 7.2M parameters (4 layers, hidden 256,
    intermediate 688, 4 heads, vocabulary 8,000) whose forward returns the loss of next-token prediction, and one
    microbatch of 4 sequences of 64 tokens (65 ids)."""
    return _Llama(), (torch.randint(0, 8000, (4, 65), generator=torch.Generator().manual_seed(0)),)


class _Llama(torch.nn.Module):
    def __init__(self) -> None:
        import transformers

        super().__init__()
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=688,
                                       num_attention_heads=4, num_key_value_heads=4, vocab_size=8000,
                                       max_position_embeddings=64, use_cache=False)
        self.model = transformers.LlamaForCausalLM(cfg)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=ids[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _plan_target(name: str, batch: int) -> tuple[torch.nn.Module, tuple, dict, Any, Callable[[Any, Any], Any]]:
    """The model ``--plan`` trains (a zoo name, or "llama"), its inputs and target for ``batch`` samples (a step's
    arguments, split into microbatches) and its loss of the model's output and the target."""
    if name == "llama":
        model, (ids,) = llama_7m()
        ids = torch.randint(0, 8000, (batch, ids.shape[1]), generator=torch.Generator().manual_seed(1))
        return model, (ids,), {}, None, lambda loss, _: loss
    from smp import zoo

    z = zoo.build(name, batch=batch)
    return z.model, z.args, z.kwargs, z.target, z.loss_fn


def plan_worker(rank: int, world: int, cfg: dict) -> tuple[float, float] | None:
    """Train ``cfg["model"]`` with the smp config ``smp plan`` wrote and Adam; rank 0 returns the median step (the
    optimizer step in it) and the step ``smp plan`` predicts for the same layout (fixed degrees) from ops it times
    right after the warm-up steps."""
    import smp

    torch.set_num_threads(1)
    pin(rank, cfg)
    smp.init(cfg["config"])  # the file smp plan wrote, and the plan beside it (partition_file) where it has a cut
    net, args, kwargs, target, loss_of = _plan_target(cfg["model"], cfg["global_batch"] // smp.dp_size())
    # Without a plan file, the ops priced as smp plan priced them (timed; a tp stage cannot be timed in one process)
    model = smp.DistributedModel(net, trace_execution_times=cfg["tp"] == 1)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(model: Any, args: tuple, kwargs: dict, target: Any) -> torch.Tensor:
        loss = loss_of(model(*args, **kwargs), target)
        model.backward(loss)
        return loss

    def step() -> None:
        train_step(model, args, kwargs, target)
        opt.step()
        opt.zero_grad()

    again: list[float] = []

    def price_again() -> None:  # rank 0, while its peer waits: the layout priced in the steps' own minute
        again.append(_priced(cfg["target"], cfg["fixed"]))

    measured = _timed_steps(rank, cfg, step, after_warm_up=price_again if rank == 0 else None)
    return (measured, again[0]) if rank == 0 else None


def _priced(target: str, options: list[str], config: Path | None = None) -> float:
    """The ``step_s`` of ``smp plan TARGET OPTIONS`` (its best layout), writing its smp config to ``config``."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "plan.json")
        _quiet_plan([target, "--json", str(out), *options, *(["--config", str(config)] if config else [])])
        return float(json.loads(out.read_text())["layouts"][0]["step_s"])


def _fixed(best: dict, global_batch: int) -> list[str]:
    """``smp plan`` options that price exactly the layout ``best`` (a row of its JSON)."""
    return ["--devices", str(best["pp"] * best["tp"] * best["dp"]), "--global-batch", str(global_batch),
            "--pp", str(best["pp"]), "--tp", str(best["tp"]), "--dp", str(best["dp"]), "--sdp", str(best["sdp"]),
            "--microbatch-size", str(best["microbatch_size"]), "--schedules", best["schedule"],
            "--checkpointing", best["checkpointing"], "--zero1", "on" if best["zero1"] else "off",
            "--placement", best["smp_config"]["placement_strategy"]]  # the config's name: the option takes it


def _describe(row: dict) -> str:
    return (f"pp{row['pp']} tp{row['tp']} dp{row['dp']} sdp{row['sdp']}{' zero1' if row['zero1'] else ''}, "
            f"{row['microbatches']} x {row['microbatch_size']}, {row['schedule']}"
            f"{', ckpt' if row['checkpointing'] != 'none' else ''}")


def plan_rows(args: argparse.Namespace) -> list[tuple[int, int, str, float, float, float]]:
    """(repeat, rank in that repeat's smp plan order, layout, predicted step, measured step, predicted again beside
    the steps) of smp plan's ``--plan-top`` best layouts, each priced with its degrees fixed and run, for each of
    ``--repeats`` plannings (the ops timed afresh each time, so the order may change)."""
    import tempfile

    target = LLAMA if args.plan_model == "llama" else f"zoo:{args.plan_model}"
    rows = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp, "plan.json")
            _quiet_plan([target, "--devices", "2", "--global-batch", str(args.plan_batch), "--top",
                         str(args.plan_top), "--json", str(out)])
            for k, row in enumerate(json.loads(out.read_text())["layouts"]):
                fixed = _fixed(row, args.plan_batch)
                config = Path(tmp, f"config{k}.json")
                predicted = _priced(target, fixed, config)  # the same layout alone, and its config and cut
                cfg = {"model": args.plan_model, "target": target, "steps": args.steps, "pin": args.pin,
                       "global_batch": args.plan_batch, "config": str(config), "tp": row["tp"], "fixed": fixed}
                measured, again = run_ranks(plan_worker, 2, cfg, timeout=900, pg_timeout=300)[0]
                rows.append((repeat, k, _describe(row), predicted, measured, again))
    return rows


def print_plan_rows(rows: list[tuple[int, int, str, float, float, float]]) -> None:
    """Per layout (in order of its median predicted step): the median predicted and measured steps, the median
    error and each run's; then, per planning, whether its choice measured the fastest of the layouts it ran."""
    print(f"{'layout':<44} {'runs':>4} {'predicted':>10} {'measured':>10} {'error':>7}  within {PLAN_GOAL:.0%}  "
          f"{'priced beside the steps':>23}  errors of the runs")
    layouts = sorted({r[2] for r in rows}, key=lambda lay: statistics.median(r[3] for r in rows if r[2] == lay))
    for lay in layouts:
        mine = [r for r in rows if r[2] == lay]
        errs = sorted(p / m - 1 for *_, p, m, _ in mine)
        err = statistics.median(errs)
        beside = statistics.median(a / m - 1 for *_, m, a in mine)
        print(f"{lay:<44} {len(mine):>4} {statistics.median(r[3] for r in mine) * 1e3:>7.1f} ms "
              f"{statistics.median(r[4] for r in mine) * 1e3:>7.1f} ms {err:>+7.1%}  "
              f"{'yes' if abs(err) <= PLAN_GOAL else 'NO ':<10} {beside:>+22.1%}   "
              + " ".join(f"{e:+.0%}" for e in errs))
    for repeat in sorted({r[0] for r in rows}):
        mine = sorted((r for r in rows if r[0] == repeat), key=lambda r: r[1])
        fastest = min(mine, key=lambda r: r[4])
        print(f"planning {repeat + 1}: smp plan's choice {mine[0][2]} measured {mine[0][4] * 1e3:.1f} ms; the fastest "
              f"of its {len(mine)}: {fastest[2]} ({fastest[4] * 1e3:.1f} ms, the choice "
              f"{mine[0][4] / fastest[4] - 1:+.1%})")


def _quiet_plan(argv: list[str]) -> None:
    """``smp plan ARGV -q``, its table not printed (its JSON and config are what is read)."""
    import contextlib
    import io

    from smp.cli import main as smp_main

    with contextlib.redirect_stdout(io.StringIO()):
        code = smp_main(["plan", *argv, "-q"])
    if code:
        raise SystemExit(f"smp plan {' '.join(argv)} failed ({code})")


def _timed_steps(rank: int, cfg: dict, step: Callable[[], Any], before: Callable[[], Any] | None = None,
                 after_warm_up: Callable[[], Any] | None = None) -> float:
    """The median of ``cfg["steps"]`` calls of ``step`` after two warm-up calls (then ``after_warm_up()``, if
    given), each from a barrier to a barrier (``before()`` ahead of the barrier, untimed)."""
    import torch.distributed as dist

    times = []
    for i in range(cfg["steps"] + 2):
        if before is not None:
            before()
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        if i >= 2:  # two warm-up steps: the first partitions
            times.append(time.perf_counter() - t0)
        if i == 0:
            pin(rank, cfg)  # gloo's threads, started since
        if i == 1 and after_warm_up is not None:
            after_warm_up()
    return statistics.median(times)


def _plan_rows(model: Any) -> dict:
    """What the step model needs of the run's plan: stage seconds, the bytes crossing, rates and schedule."""
    from partitioner.cut.objective import stage_crossings

    plan = model.runner.plan
    graph = plan.traced_graph()
    crossing = stage_crossings(graph, plan.stage_of_ops(graph), plan.num_stages)
    return {"forward_s": [s.forward_s for s in plan.stages],
            "backward_s": [s.backward_s for s in plan.stages], "crossing": sorted(crossing.items()),
            "rates": plan.rates, "pipeline": plan.options["pipeline"]}


def predicted(row: dict[str, Any], microbatches: int, rates: Any = None) -> float:
    """The step the step model predicts for the run's plan (under ``rates``, else the plan's own), as
    :func:`pipeline.profile_description.predict` prices a profiled plan."""
    from partitioner import DeviceRates
    from pipeline.schedule import make_schedule
    from pipeline.step_model import predict_step

    rates = rates or DeviceRates.from_dict(row["rates"])
    comm = {(s, t): rates.comm_s(b, messages=c) for (s, t), (b, c) in row["crossing"]}
    schedule = make_schedule(row["pipeline"], len(row["forward_s"]), microbatches)
    return predict_step(schedule, row["forward_s"], row["backward_s"], rates, comm_s=comm,
                        stage_deps=sorted(comm) or None).step_s


def fit(rows: list[dict[str, Any]], microbatches: int) -> tuple[float, float]:
    """The per-pass and per-step seconds that minimise the squared relative errors of the rows (a grid, then a
    finer one around its best)."""
    from partitioner import DeviceRates

    base = DeviceRates.from_dict(rows[0]["rates"])

    def loss(p: float, s: float) -> float:
        rates = dataclasses.replace(base, pass_overhead_s=p, step_overhead_s=s)
        return sum((predicted(r, microbatches, rates) / r["measured_s"] - 1) ** 2 for r in rows)

    best = min(((p * 1e-4, s * 1e-4) for p in range(0, 21) for s in range(0, 101, 5)), key=lambda ps: loss(*ps))
    fine = [(best[0] + dp * 2e-5, best[1] + ds * 1e-4) for dp in range(-5, 6) for ds in range(-5, 6)]
    return min((ps for ps in fine if ps[0] >= 0 and ps[1] >= 0), key=lambda ps: loss(*ps))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=list(NAMES), choices=NAMES,
                    help="zoo models to run (default all; none with --plan: only its layouts)")
    ap.add_argument("--steps", type=int, default=9, help="timed steps per model")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4, help="samples per microbatch (the zoo's example batch)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every model and cut; the median error is kept")
    ap.add_argument("--fit", action="store_true", help="also print the per-pass and per-step costs that fit best")
    ap.add_argument("--save", metavar="FILE", help="also write the measured rows as JSON")
    ap.add_argument("--plan", action="store_true", help="also run the layouts smp plan proposes for 2 CPU ranks")
    ap.add_argument("--plan-model", default="gpt2", choices=[*NAMES, "llama"],
                    help="the model --plan plans: a zoo name (default gpt2) or llama (llama_7m, a user's model)")
    ap.add_argument("--plan-top", type=int, default=4, help="how many of smp plan's best layouts --plan runs")
    ap.add_argument("--plan-batch", type=int, default=16, help="--plan's global batch (default 16)")
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin rank r to core r")
    args = ap.parse_args(argv)
    os.environ.setdefault(calibration.RECALIBRATE_ENV, "1")  # the ranks inherit it
    ensure_runtime_costs()  # this machine's per-pass and per-step costs, measured beside the steps they predict
    costs = calibration.recorded_runtime_costs() or {"pass_overhead_s": calibration.CPU_PASS_OVERHEAD_S,
                                                     "step_overhead_s": calibration.CPU_STEP_OVERHEAD_S}
    print(f"step model vs @smp.step: zoo models (small), 2 ranks (gloo), SMP 'interleaved' (1F1B), "
          f"{args.microbatches} microbatches of {args.batch}, 1 thread per rank, fp32, ops timed on this machine")
    print(f"runtime costs (smp calibrate): {costs['pass_overhead_s'] * 1e3:.2f} ms per pass, "
          f"{costs['step_overhead_s'] * 1e3:.2f} ms per step")
    print(f"before: {load_average()}")
    rows = []
    for _ in range(args.repeats):  # each repeat runs every model and cut once, so drift in time hits all alike
        for name in args.models:
            for timed_cut in (True, False):
                cfg = {"model": name, "steps": args.steps, "microbatches": args.microbatches, "batch": args.batch,
                       "pin": args.pin, "timed_cut": timed_cut}
                res = run_ranks(worker, 2, cfg, timeout=900, pg_timeout=300)[0]
                rows.append({"model": name, "cut": "timed" if timed_cut else "cost model", **res})
    if args.save:
        Path(args.save).write_text(json.dumps(rows))
    if rows:
        print(f"{'model':<10} {'cut':<10} {'predicted ms':>12} {'measured ms':>12} {'error':>8}  within {GOAL:.0%}"
              f"{'  errors of the runs' if args.repeats > 1 else ''}")
    for name in args.models:
        for cut in ("timed", "cost model"):
            runs = [r for r in rows if (r["model"], r["cut"]) == (name, cut)]
            p = statistics.median(predicted(r, args.microbatches) for r in runs)
            errs = sorted(predicted(r, args.microbatches) / r["measured_s"] - 1 for r in runs)
            err = statistics.median(errs)
            spread = "  " + " ".join(f"{e:+.0%}" for e in errs) if len(errs) > 1 else ""
            measured = statistics.median(r["measured_s"] for r in runs)
            print(f"{name:<10} {cut:<10} {p * 1e3:>12.2f} {measured * 1e3:>12.2f} {err:>+8.1%}  "
                  f"{'yes' if abs(err) <= GOAL else 'NO'}{spread}")
    if args.plan:
        print(f"\nsmp plan --devices 2 --global-batch {args.plan_batch} for {args.plan_model}: its {args.plan_top} "
              f"best layouts, each trained on 2 ranks with Adam, the optimizer step in the step (goal: within "
              f"{PLAN_GOAL:.0%})")
        print_plan_rows(plan_rows(args))
    if args.fit and rows:
        p, s = fit(rows, args.microbatches)
        print(f"best fit: pass_overhead_s = {p:.2e}, step_overhead_s = {s:.2e}")
    print(f"after: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
