"""Pipeline throughput: our runner vs torch.distributed.pipelining vs one process, same stages, same run.

Model: ``--layers`` x (Linear(width, width) + GELU) as one ``nn.Sequential``, MSE loss against a random
target, fp32, batch ``--batch`` cut into ``--microbatches`` microbatches, ``--ranks`` gloo ranks on this host,
one thread per rank (``torch.set_num_threads(1)``), rank r pinned to core r (``--no-pin`` to not).

What runs, alternating inside every round (``--rounds`` rounds of ``--steps`` timed steps each; the order
flips every round; medians):

* ``single``: one process (rank 0; the other ranks wait in a barrier), the unpartitioned model, the same
  microbatches, forward + backward per microbatch with gradients accumulating (loss / m);
* ``ours``: :class:`pipeline.PipelineRunner`, ``schedule="1f1b"``, ``"gpipe"`` and ``"zb-h1"`` (zero bubble,
  backward split into B and W), plan from ``partitioner.partition(trace(model, microbatch), p,
  rates=DeviceRates())``; and, for information, ``"interleaved-virtual"`` with ``--virtual`` stages per rank
  (a plan of p x v stages; 0 to skip);
* ``torch``: ``torch.distributed.pipelining`` ``PipelineStage`` + ``Schedule1F1B`` / ``ScheduleGPipe`` /
  ``ScheduleInterleavedZeroBubble`` (ZB1P, one stage per rank), the Sequential cut at the SAME layers as our
  p-stage plan (read from the plan, checked and printed).

A step is timed from a barrier to a barrier (gradients are reset outside the timed span). Efficiency is
``single / (p * pipelined)``, shown against the bubble bound ``m / (m + p - 1)`` of GPipe/1F1B. Next to the
wall clock, the CPU seconds per step summed over the ranks: on a machine shared with other jobs the wall
clock measures the scheduler as much as the pipeline, the CPU time does not.

Then:

* simulator: per-stage forward / backward times from our runner's own timeline (``record=True``), each
  span counted from when its cross-rank input had arrived (the producing action's end on the other rank),
  plus the P2P latency of one boundary tensor (ping-pong), fed to :func:`pipeline.simulate.simulate`;
  predicted vs measured step time, and the efficiency split into stage work / imbalance / runtime factors;
* the same from CPU time: each action's thread CPU time, simulated, plus the CPU spent outside the actions:
  the step time an idle machine with one core per rank would show;
* overhead: a world of ONE rank; ``PipelineRunner`` on a 1-stage plan with 1 microbatch vs the plain
  ``loss_fn(model(x), y).backward()`` on the whole batch, alternating; % slower.

Run: ``python benchmarks/pipeline_throughput.py [--rounds 30] [--steps 1] [--batch 256] [--width 1024]
[--layers 8] [--microbatches 8] [--ranks 2] [--virtual 2]``: about a minute with the defaults on two
idle cores, longer on a busy machine (the load average is printed before and after).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load_average, pin  # noqa: E402
from smp.testing import run_ranks  # noqa: E402

GOAL_BUBBLE_FRACTION = 0.97   # ours: efficiency >= 97% of the bubble bound m / (m + p - 1)
GOAL_VS_PEER = 1.10           # ours 1F1B throughput >= 1.10x torch's Schedule1F1B
GOAL_OVERHEAD = 0.03          # 1 stage, 1 microbatch: <= 3% slower than plain PyTorch
GOAL_SIM_ERROR = 0.10         # simulator's predicted step time within 10% of the measured one


def build(cfg: dict) -> tuple[torch.nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)  # every rank builds the same model and batch
    layers: list[torch.nn.Module] = []
    for _ in range(cfg["layers"]):
        layers += [torch.nn.Linear(cfg["width"], cfg["width"]), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(cfg["batch"], cfg["width"])
    y = torch.randn(cfg["batch"], cfg["width"])
    return model, x, y


def make_plan(model: torch.nn.Module, x: torch.Tensor, stages: int, m: int):
    import partitioner
    from partitioner import DeviceRates

    graph = partitioner.trace(model, (x[: x.shape[0] // m],))
    # Fixed rates (not a per-process calibration) so that every rank makes the same plan.
    return partitioner.partition(graph, stages, rates=DeviceRates(), microbatches=m)


def plan_cuts(plan, n_modules: int) -> list[int]:
    """Index of the first Sequential child of each stage > 0; checks that every child lies on one stage
    and the stages are contiguous layer ranges in order."""
    where = plan.stage_of_module()
    stage_of = []
    for i in range(n_modules):
        stages = where.get(str(i))
        if stages is None or len(stages) != 1:
            raise RuntimeError(f"module {i} spans stages {stages}: the plan does not cut between layers")
        stage_of.append(stages[0])
    if stage_of != sorted(stage_of) or set(stage_of) != set(range(plan.num_stages)):
        raise RuntimeError(f"the plan's stages are not contiguous layer ranges: {stage_of}")
    return [stage_of.index(s) for s in range(1, plan.num_stages)]


def describe_cuts(cuts: list[int], model: torch.nn.Sequential) -> str:
    bounds = [0, *cuts, len(model)]
    parts = []
    for s in range(len(bounds) - 1):
        kinds = [type(model[i]).__name__ for i in range(bounds[s], bounds[s + 1])]
        counts = ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))
        parts.append(f"stage {s} = [{bounds[s]}:{bounds[s + 1]}] ({counts})")
    return "; ".join(parts)


def ours_schedules(v: int) -> dict[str, tuple[str, int]]:
    """Row name -> (schedule name, virtual stages) of our runs."""
    out = {"1f1b": ("1f1b", 1), "gpipe": ("gpipe", 1), "zb-h1": ("zb-h1", 1)}
    if v > 1:
        out[f"intl v={v}"] = ("interleaved-virtual", v)
    return out


def record_cpu(runner) -> list[float]:
    """Also record each action's thread CPU seconds, aligned with ``runner.events``: the runner's recorder
    keeps wall spans; a blocked wait uses no CPU, so this is the action's own work whatever the load."""
    recorder, cpu = runner.recorder, []
    wall_span = recorder.span

    @contextmanager
    def span(action):
        c0 = time.thread_time()
        try:
            with wall_span(action):
                yield
        finally:
            cpu.append(time.thread_time() - c0)

    recorder.span = span  # the executor calls recorder.span(...) once per action
    return cpu


def _timed(fn, barrier) -> tuple[float, float]:
    """(wall seconds from barrier to barrier, this process's CPU seconds in between)."""
    barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    barrier()
    return time.perf_counter() - t0, time.process_time() - c0


def pipelined_worker(rank: int, world: int, cfg: dict) -> dict[str, Any] | None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleavedZeroBubble

    from pipeline import PipelineRunner, microbatch

    torch.set_num_threads(1)
    pin(rank, cfg)
    m, p = cfg["microbatches"], world
    model, x, y = build(cfg)
    plans = {v: make_plan(model, x, p * v, m) for v in sorted({1, max(cfg["virtual"], 1)})}
    cuts = {v: plan_cuts(plan, len(model)) for v, plan in plans.items()}
    bounds = [0, *cuts[1], len(model)]

    ours = {key: PipelineRunner(plans[v], schedule=sched, microbatches=m, virtual_stages=v, timeout_s=120,
                                record=True)
            for key, (sched, v) in ours_schedules(cfg["virtual"]).items()}
    action_cpu = {key: record_cpu(r) for key, r in ours.items()}

    def peer(cls, multi: bool = False):
        group = dist.new_group(list(range(world)))
        part = torch.nn.Sequential(*model[bounds[rank]:bounds[rank + 1]])  # shares the model's parameters
        stage = PipelineStage(part, rank, p, torch.device("cpu"), group=group)
        return cls([stage] if multi else stage, n_microbatches=m, loss_fn=F.mse_loss)

    peers = {"1f1b": peer(Schedule1F1B), "gpipe": peer(ScheduleGPipe),
             "zb-h1": peer(ScheduleInterleavedZeroBubble, multi=True)}
    losses: dict[str, float] = {}

    def run_single():
        if rank == 0:
            mbs = microbatch.split((x,), {}, m)
            targets = [t[0][0] for t in microbatch.split((y,), {}, m)]
            total = 0.0
            for (a, _), t in zip(mbs, targets):
                loss = F.mse_loss(model(*a), t)
                (loss / m).backward()
                total += float(loss.detach())
            losses["single"] = total / m

    def run_ours(key):
        losses[f"ours {key}"] = ours[key].step((x,), target=y, loss_fn=F.mse_loss).loss

    def run_peer(key):
        sched = peers[key]
        if rank == 0:
            sched.step(x)
        elif rank == p - 1:
            out: list = []
            sched.step(target=y, losses=out)
            losses[f"torch {key}"] = sum(float(v.detach()) for v in out) / len(out)
        else:
            sched.step()

    runs: dict[str, Any] = {"single": run_single}
    runs.update({f"ours {k}": (lambda k=k: run_ours(k)) for k in ours})
    runs.update({f"torch {k}": (lambda k=k: run_peer(k)) for k in peers})
    barrier = dist.barrier
    wall: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    steps: dict[str, list[list]] = {k: [] for k in ours}  # per step: [(events, action cpu, step cpu) per rank]
    for fn in runs.values():  # warm-up: torch's shape inference, the allocator, first touch of pages
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            _timed(fn, barrier)
    for rnd in range(cfg["rounds"]):
        order = list(runs) if rnd % 2 == 0 else list(runs)[::-1]  # slow drifts favour no one
        for name in order:
            for _ in range(cfg["steps"]):
                model.zero_grad(set_to_none=True)
                key = name.split(" ", 1)[-1]
                start = len(action_cpu[key]) if name.startswith("ours") else 0
                w, c = _timed(runs[name], barrier)
                wall[name].append(w)
                cpu[name].append(c)
                if name.startswith("ours"):
                    mine = (ours[key].events[start:], action_cpu[key][start:], c)
                    gathered: list = [None] * world
                    dist.all_gather_object(gathered, mine)
                    steps[key].append(gathered)

    # P2P latency of one boundary tensor between ranks 0 and 1 (ping-pong, half the round trip).
    value = ours["1f1b"].split_model.stages[1].inputs[0]
    meta = ours["1f1b"].split_model.value_meta[value]
    buf = torch.zeros(tuple(meta.shape), dtype=meta.dtype)
    comm = []
    for _ in range(40):
        barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        comm.append((time.perf_counter() - t0) / 2)
    gathered = [None] * world
    dist.all_gather_object(gathered, (losses, cpu))
    if rank != 0:
        return None
    all_losses = {k: v for got, _ in gathered for k, v in got.items()}
    cpu_total = {k: [sum(c[k][i] for _, c in gathered) for i in range(len(cpu[k]))] for k in cpu}
    return {"wall": wall, "cpu": cpu_total, "steps": steps, "comm_s": statistics.median(comm[5:]),
            "comm_min_s": min(comm[5:]), "losses": all_losses, "cuts": cuts, "balance": plans[1].balance}


def overhead_worker(rank: int, world: int, cfg: dict) -> dict[str, dict[str, list[float]]]:
    """World of one rank: PipelineRunner on a 1-stage plan with 1 microbatch vs plain PyTorch."""
    from pipeline import PipelineRunner

    torch.set_num_threads(1)
    pin(rank, cfg)
    model, x, y = build(cfg)
    runner = PipelineRunner(make_plan(model, x, 1, 1), schedule="1f1b", microbatches=1, timeout_s=120)

    def plain():
        F.mse_loss(model(x), y).backward()

    def ours():
        runner.step((x,), target=y, loss_fn=F.mse_loss)

    runs = {"plain": plain, "ours": ours}
    wall: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            fn()
    for rnd in range(cfg["rounds"]):
        for name in (list(runs) if rnd % 2 == 0 else list(runs)[::-1]):
            for _ in range(cfg["steps"]):
                model.zero_grad(set_to_none=True)
                t0, c0 = time.perf_counter(), time.process_time()
                runs[name]()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    return {"wall": wall, "cpu": cpu}


# -- analysis (in the parent process) -------------------------------------------------------------------
Times = dict[str, list[float]]  # "F"/"B" (and "W" for a split backward) -> median seconds per stage


def _medians(samples: dict[str, list[list[float]]]) -> Times:
    return {k: [statistics.median(v) for v in per_stage] for k, per_stage in samples.items() if per_stage[0]}


def span_times(steps: list[list], num_stages: int) -> Times:
    """Per-stage median F, B (and W) seconds from the recorded timelines (chain pipelines): a span counts
    from when both its rank was free (span start) and its input had been produced (end of F of stage s - 1
    for F of stage s, of B of stage s + 1 for B of stage s; a W's input is its own B, on its rank), so
    waiting for a peer does not count."""
    from pipeline.schedule import Action

    samples: dict[str, list[list[float]]] = {k: [[] for _ in range(num_stages)] for k in "FBW"}
    for ranks in steps:
        span = {e.action: (e.start, e.end) for events, _, _ in ranks for e in events}
        for name, (start, end) in span.items():
            a = Action.parse(name)
            dep = {"F": f"F{a.microbatch}@s{a.stage - 1}", "B": f"B{a.microbatch}@s{a.stage + 1}"}.get(a.kind)
            ready = span[dep][1] if dep in span else start
            samples[a.kind][a.stage].append(end - max(start, ready))
    return _medians(samples)


def cpu_times(steps: list[list], num_stages: int) -> tuple[Times, float]:
    """Per-stage median thread-CPU seconds of F, B (and W), and the median over steps of the largest
    per-rank CPU spent outside the actions (batch split, loss broadcast, barriers, gloo's threads)."""
    from pipeline.schedule import Action

    samples: dict[str, list[list[float]]] = {k: [[] for _ in range(num_stages)] for k in "FBW"}
    outside = []
    for ranks in steps:
        for events, cpus, _ in ranks:
            for e, c in zip(events, cpus):
                a = Action.parse(e.action)
                samples[a.kind][a.stage].append(c)
        outside.append(max(used - sum(cpus) for _, cpus, used in ranks))
    return _medians(samples), statistics.median(outside)


def _simulate(sched, t: Times, **kw):
    """Simulated step of ``sched`` from measured times: a split backward's B and W as measured."""
    from pipeline.simulate import simulate

    return simulate(sched, t["F"], t["B"], weight_s=t.get("W"), **kw)


def _work(t: Times) -> float:
    """Seconds of all passes of one microbatch through every stage."""
    return sum(sum(v) for v in t.values())


def _fb(t: Times) -> tuple[list[float], list[float]]:
    """F and the whole backward (B + W) per stage, for the table."""
    return t["F"], [b + w for b, w in zip(t["B"], t.get("W", [0.0] * len(t["B"])))]


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def _ms(values: list[float]) -> str:
    return " ".join(f"{v * 1e3:.2f}" for v in values)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=1, help="timed steps per configuration per round")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--virtual", type=int, default=2,
                    help="virtual stages per rank of the extra interleaved run (0 or 1: skip it)")
    ap.add_argument("--skip-overhead", action="store_true", help="skip the 1-stage/1-microbatch measurement")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="do not pin rank r to core r %% cores (pinning is the default)")
    args = ap.parse_args(argv)
    p, m, v = args.ranks, args.microbatches, args.virtual
    if p < 2:
        ap.error("--ranks must be >= 2 (the 1-rank case is the overhead measurement)")
    if v > 1 and m % p:
        ap.error(f"--virtual {v} needs --microbatches divisible by --ranks; use --virtual 0")
    cfg = {k: getattr(args, k) for k in ("rounds", "steps", "batch", "width", "layers", "microbatches", "pin",
                                         "virtual")}
    began = time.perf_counter()
    print(f"pipeline throughput: {args.layers} x (Linear {args.width} + GELU), batch {args.batch}, m = {m}, "
          f"p = {p} ranks (gloo), 1 thread per rank{', rank r on core r' if args.pin else ''}, fp32, MSE loss")
    print(f"{args.rounds} rounds x {args.steps} steps per configuration, alternating. Before: {load_average()}")
    timeout = 600 + 8.0 * args.rounds * args.steps * args.layers * args.batch * args.width ** 2 / 2 ** 31
    res = run_ranks(pipelined_worker, p, cfg, timeout=timeout, pg_timeout=timeout)[0]
    model = build({**cfg, "width": 1, "batch": 1})[0]  # only its layer list, for the names
    print(f"cut of the Sequential (our plan; torch uses the same): {describe_cuts(res['cuts'][1], model)}; "
          f"plan balance {res['balance']:.3f}")
    if v > 1:
        print(f"interleaved plan, stage s on rank s % {p}: {describe_cuts(res['cuts'][v], model)}")
    print("mean microbatch loss of the last step (must agree): " +
          ", ".join(f"{k} {x:.6f}" for k, x in res["losses"].items()))

    # 1. Wall clock, as measured.
    wall = {k: statistics.median(x) for k, x in res["wall"].items()}
    cpu = {k: statistics.median(x) for k, x in res["cpu"].items()}
    single = wall["single"]
    bound = m / (m + p - 1)
    print()
    head = (f"{'wall clock':<15} {'s/step':>7} {'min':>7} {'max':>7} {'speedup':>7} {'effic.':>6} {'of bound':>8} "
            f"{'vs torch 1F1B':>13} {'cpu s/step':>10} {'cpu/single':>10}")
    print(head)
    print("-" * len(head))
    for name in res["wall"]:
        t = res["wall"][name]
        eff = single / (p * wall[name])
        row = f"{name:<15} {wall[name]:>7.4f} {min(t):>7.4f} {max(t):>7.4f} {single / wall[name]:>6.3f}x"
        if name != "single":
            row += f" {eff:>6.3f} {eff / bound:>8.3f} {wall['torch 1f1b'] / wall[name]:>12.3f}x"
        else:
            row += f" {'':>6} {'':>8} {'':>13}"
        print(row + f" {cpu[name]:>10.4f} {cpu[name] / cpu['single']:>10.3f}")
    print(f"medians of {len(res['wall']['single'])} steps each; efficiency = single / (p x pipelined); 'of bound' = "
          f"efficiency / (m/(m+p-1) = {bound:.3f}), the 1F1B/GPipe bubble bound\n(interleaved's own bound is "
          f"m/(m+(p-1)/v)); cpu = CPU seconds per step summed over the ranks, gloo's threads included.")

    # 2. Simulator vs measurement, from our runner's timeline.
    from pipeline.schedule import make_schedule

    print()
    sim_err = {}
    head = (f"{'simulated':<15} {'fwd ms/stage':>23} {'bwd ms/stage':>23} {'comm ms':>7} {'predicted':>9} "
            f"{'measured':>8} {'error':>6} {'work':>5} {'ceiling':>7} {'runtime':>7}")
    print(head)
    print("-" * len(head))
    for key, (sched_name, vs) in ours_schedules(v).items():
        sched = make_schedule(sched_name, p, m, virtual_stages=vs)
        times = span_times(res["steps"][key], p * vs)
        fwd, bwd = _fb(times)
        pred = _simulate(sched, times, comm_s=res["comm_s"]).step_s
        meas = wall[f"ours {key}"]
        sim_err[key] = pred / meas - 1
        work = m * _work(times)
        ceiling = work / (p * _simulate(sched, times).step_s) / bound
        print(f"{'ours ' + key:<15} {_ms(fwd):>23} {_ms(bwd):>23} {res['comm_s'] * 1e3:>7.3f} {pred:>9.4f} "
              f"{meas:>8.4f} {sim_err[key]:>+6.1%} {single / work:>5.3f} {ceiling:>7.3f} {pred / meas:>7.3f}")
    print("F/B (B + W when split): medians of the timeline's spans, each from when its cross-rank input had "
          "arrived; comm: ping-pong\nmedian. 'of bound' ~= work x ceiling x runtime: work = single / the stages' "
          "summed F+B (< 1: a stage is\nslower than in one process); ceiling = 'of bound' of a zero-overhead runtime "
          "with these stage times (imbalance);\nruntime = predicted / measured.")

    # 3. The same from CPU time: what an idle machine with one core per rank would show.
    print()
    head = (f"{'cpu-based':<15} {'fwd ms/stage':>23} {'bwd ms/stage':>23} {'outside ms':>10} {'est. s/step':>11} "
            f"{'effic.':>6} {'of bound':>8} {'ceiling':>7}")
    print(head)
    print("-" * len(head))
    est_of_bound = {}
    for key, (sched_name, vs) in ours_schedules(v).items():
        sched = make_schedule(sched_name, p, m, virtual_stages=vs)
        times, outside = cpu_times(res["steps"][key], p * vs)
        fwd, bwd = _fb(times)
        est = _simulate(sched, times, comm_s=res["comm_min_s"]).step_s + outside
        eff = cpu["single"] / (p * est)
        est_of_bound[key] = eff / bound
        ceiling = m * _work(times) / (p * _simulate(sched, times).step_s) / bound
        print(f"{'ours ' + key:<15} {_ms(fwd):>23} {_ms(bwd):>23} {outside * 1e3:>10.2f} {est:>11.4f} {eff:>6.3f} "
              f"{eff / bound:>8.3f} {ceiling:>7.3f}")
    print(f"F/B (B + W when split): median thread-CPU per action; outside: the largest per-rank CPU outside the "
          f"actions per step\n(batch split, loss broadcast, barriers, gloo threads); est. = simulated with comm "
          f"{res['comm_min_s'] * 1e3:.3f} ms (ping-pong min) + outside;\nefficiency vs single's "
          f"{cpu['single']:.4f} CPU s/step.")

    overhead = overhead_cpu = None
    if not args.skip_overhead:
        print()
        o = run_ranks(overhead_worker, 1, cfg, timeout=timeout, pg_timeout=timeout)[0]
        head = f"{'1 stage, 1 microbatch, world 1':<30} {'s/step':>7} {'min':>7} {'max':>7} {'cpu s/step':>10}"
        print(head)
        print("-" * len(head))
        for name, label in (("plain", "plain PyTorch fwd+bwd"), ("ours", "PipelineRunner, 1-stage plan")):
            t = o["wall"][name]
            print(f"{label:<30} {statistics.median(t):>7.4f} {min(t):>7.4f} {max(t):>7.4f} "
                  f"{statistics.median(o['cpu'][name]):>10.4f}")
        w1 = {k: statistics.median(x) for k, x in o["wall"].items()}
        c1 = {k: statistics.median(x) for k, x in o["cpu"].items()}
        overhead, overhead_cpu = w1["ours"] / w1["plain"] - 1, c1["ours"] / c1["plain"] - 1
        print(f"runner overhead: wall {overhead:+.2%}, cpu {overhead_cpu:+.2%}")

    ours_of_bound = single / (p * wall["ours 1f1b"]) / bound
    peer_of_bound = single / (p * wall["torch 1f1b"]) / bound
    vs_peer = wall["torch 1f1b"] / wall["ours 1f1b"]
    print()
    print("goals (wall-clock medians; [cpu-based])")
    print(f"  ours 1F1B >= {GOAL_BUBBLE_FRACTION:.0%} of the bubble bound: {ours_of_bound:.3f} "
          f"[{est_of_bound['1f1b']:.3f}]; torch 1F1B {peer_of_bound:.3f}  "
          f"{_verdict(ours_of_bound >= GOAL_BUBBLE_FRACTION)}")
    print(f"  ours 1F1B >= {GOAL_VS_PEER:.2f}x torch 1F1B throughput: {vs_peer:.3f}x "
          f"[cpu {cpu['torch 1f1b'] / cpu['ours 1f1b']:.3f}x]  {_verdict(vs_peer >= GOAL_VS_PEER)}")
    if overhead is not None:
        print(f"  1 stage, 1 microbatch <= {GOAL_OVERHEAD:.0%} slower than plain PyTorch: {overhead:+.2%} "
              f"[{overhead_cpu:+.2%}]  {_verdict(overhead <= GOAL_OVERHEAD)}")
    worst = max(sim_err.values(), key=abs)
    print(f"  simulator within {GOAL_SIM_ERROR:.0%} of the measured step: " +
          ", ".join(f"{k} {e:+.1%}" for k, e in sim_err.items()) + f"  {_verdict(abs(worst) <= GOAL_SIM_ERROR)}")
    print(f"\nAfter: {load_average()}; total {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
