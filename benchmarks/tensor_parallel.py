"""Tensor parallelism against the pipeline and data parallelism on two CPU ranks: step time, memory per rank, and
the cost model's prediction beside each.

Model: the repository's GPT-like benchmark model (``benchmarks/end_to_end.py``'s GPT-2: ``--layers`` 6 blocks,
hidden 256, 4 heads, sequence 128, the real 50,257-token vocabulary, tied embedding and head, random weights, no
dropout), whose loss is part of the traced graph (Hugging Face's ``labels=``, the model returning only the loss, as
a training loop that reads only the loss would), fp32, ``torch.optim.Adam``, a global batch of ``--batch``
sequences in microbatches of ``--batch / --microbatches``, 2 gloo ranks on this host, one thread per rank, rank r
pinned to core r (``--no-pin`` to not). Three layouts of the same two ranks, each built once with
:func:`smp.engine.planning.pipeline_runner` (every rank builds the same model from the same seed):

* ``pp2``: a pipeline of two stages (the planner's cut), 1F1B, ``--microbatches`` microbatches;
* ``tp2``: one stage whose layers are split over both ranks (``tp_groups``: Megatron's pattern found on the traced
  graph, vocabulary-parallel embedding, head and cross-entropy), the same microbatches;
* ``dp2``: two replicas of the whole model, each on half the batch (``--microbatches / 2`` microbatches), then the
  gradients averaged over both as ``@smp.step`` does with ``"ddp": True`` (one all-reduce of the flattened
  gradients, divided by the replicas).

A step is the runner's forward and backward of the global batch (and dp2's all-reduce), then ``Adam.step()``,
timed from a barrier to a barrier (``adam``: the optimizer step alone; ``cpu``: the busier rank's main-thread CPU
time in the step). The layouts alternate inside every one of ``--rounds`` rounds (the order rotating each round)
after ``--warmup`` untimed steps each; medians, and the median of the rounds' ratios to pp2. Then one more step per
layout measures memory: the **tracked tensor bytes** of the rank, i.e. the distinct storages (``untyped_storage()``)
of parameters and Adam's state alive before the step plus the peak of the bytes allocated and not yet freed during
the step and the optimizer step, as torch's profiler records every CPU allocation (``profile_memory=True``):
gradients, activations, the logits and every temporary. ``state`` is the parameters, gradients and Adam state after
the step (distinct storages). Then the collectives alone, each after a barrier: tp2's all-reduce of one
microbatch's hidden states (the engine's ``reduce_from``) and dp2's gradient all-reduce. The processes' peak RSS
(all three layouts together, plus the Python process with torch and transformers) is printed once.

Predictions, from the cost model ``smp inspect`` and ``smp simulate`` use (the runner's own plan, priced on this
machine's calibrated CPU profile and the loopback link, simulated with :func:`pipeline.simulate.simulate`; tp2's
plan is tp rank 0's sharded graph with its collectives, as ``--tp 2`` prices it): ``pred ms`` the step without the
optimizer and ``comm pred`` what communication adds to it, ``pred MiB`` each rank's parameters, gradients, Adam
state and activations held for backward at the simulated schedule's peak (:func:`partitioner.stage_memory`). The
simulator has no data-parallel term: dp2's prediction adds one ring all-reduce of the gradient bytes on the same
link (:func:`partitioner.cost.collectives.all_reduce_s`, the formula tp's all-reduces are priced with).

Run: ``python benchmarks/tensor_parallel.py [--rounds 8] [--warmup 2] [--batch 8] [--microbatches 4] [--layers 6]
[--hidden 256] [--vocab 50257] [--seq 128] [--layouts pp2,tp2,dp2] [--no-pin]``: about 45 s on two idle cores (the
load average is printed before and after; other work on the cores slows most the layout that synchronises most).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import LossOnly, load_average, pin  # noqa: E402
from smp.testing import run_ranks  # noqa: E402

LAYOUTS = ("pp2", "tp2", "dp2")
MiB = 2 ** 20



def build(cfg: dict) -> tuple[torch.nn.Module, torch.Tensor]:
    """The GPT-like model and one global batch, the same on every rank."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    vocab, seq = cfg["vocab"], cfg["seq"]
    config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=cfg["hidden"], n_layer=cfg["layers"], n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=vocab - 1,
                        eos_token_id=vocab - 1, tie_word_embeddings=True, attn_implementation="eager")
    ids = torch.randint(vocab, (cfg["batch"], seq), generator=torch.Generator().manual_seed(0))
    return LossOnly(GPT2LMHeadModel(config)), ids


def _loss(out: torch.Tensor, _target: Any) -> torch.Tensor:
    return out


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages under ``tensors`` (a view of a larger tensor counts the whole storage)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def state_tensors(params: list[torch.Tensor], opt: torch.optim.Optimizer, grads: bool = True) -> list[torch.Tensor]:
    """Parameters, (their gradients) and the optimizer's state tensors."""
    out = list(params)
    if grads:
        out += [p.grad for p in params if p.grad is not None]
    for p in params:
        out += [v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return out


def peak_allocated(fn: Any) -> int:
    """The most bytes allocated and not yet freed at any moment while ``fn()`` runs: torch's profiler records every
    CPU allocation and free (``profile_memory=True``) of the threads that run torch's ops; walked in time order."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes: list[tuple[int, int]] = []
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        event = todo.pop()
        if event.tag == _EventType.Allocation and str(event.extra_fields.device) == "cpu":
            sizes.append((event.start_time_ns, event.extra_fields.alloc_size))
        todo += event.children
    live = peak = 0
    for _, size in sorted(sizes):
        live += size
        peak = max(peak, live)
    return peak


def predict(runner: Any, rank: int, microbatches: int, replicas: int = 1) -> dict[str, float]:
    """What the cost model of ``smp inspect`` and ``smp simulate`` predicts for the plan ``runner`` runs, 1F1B:
    ``step`` (seconds, the optimizer left out), ``comm`` (what communication adds to it: the simulated step less
    the same step with free links between stages, plus the tp collectives inside the stages' costs), this rank's
    ``memory`` at its peak and its ``state`` (parameters, gradients, Adam). ``replicas`` > 1 adds data
    parallelism's gradient all-reduce, which the simulator does not model, priced as tp's all-reduces are."""
    from partitioner import DeviceRates, stage_memory
    from partitioner.cost.collectives import all_reduce_s
    from partitioner.cost.roofline import needs_grad
    from partitioner.cut.objective import stage_crossings
    from partitioner.tp.pricing import collectives, stage_comm_s
    from pipeline.schedule import make_schedule, peak_in_flight
    from pipeline.simulate import simulate

    plan, graph = runner.plan, runner.plan.traced_graph()
    rates = DeviceRates.from_dict(plan.rates)
    crossing = stage_crossings(graph, plan.stage_of_ops(graph), plan.num_stages, "fp32")
    schedule = make_schedule("1f1b", plan.num_stages, microbatches)
    fwd, bwd = [s.forward_s for s in plan.stages], [s.backward_s for s in plan.stages]
    sim = simulate(schedule, fwd, bwd, comm_s={e: rates.comm_s(b, messages=c) for e, (b, c) in crossing.items()},
                   stage_deps=sorted(crossing))
    free = simulate(schedule, fwd, bwd, stage_deps=sorted(crossing)).step_s
    comm = sim.step_s - free + microbatches * max(stage_comm_s(plan.tensor_parallel, plan.num_stages))
    mine = [s for s in range(plan.num_stages) if s % len(runner.ranks) == runner.ranks.index(rank)]
    memory = [stage_memory(plan, graph, peak_in_flight(sim.schedule))[s] for s in mine]
    state = float(sum(m.weights_bytes + m.gradient_bytes + m.optimizer_bytes + m.master_bytes for m in memory))
    grad_bytes = float(sum(m.gradient_bytes for m in memory))
    reduce = all_reduce_s(grad_bytes, replicas, rates)
    return {"step": sim.step_s + reduce, "comm": comm + reduce, "memory": float(sum(m.total_bytes for m in memory)),
            "state": state, "grad_bytes": grad_bytes,
            "collectives": microbatches * sum(c.count for c in collectives(graph, "fp32", needs_grad(graph)))}


def probe_links(layouts: dict[str, dict[str, Any]], cfg: dict) -> dict[str, tuple[float, float, float]]:
    """The collectives alone, the engine's way, each after a barrier: tp2's all-reduce of one microbatch's hidden
    states (``reduce_from``, Megatron's ``g``: 50 times) and dp2's all-reduce of the flattened gradients (5 times);
    per kind (bytes, measured median seconds, the cost model's seconds)."""
    import torch.distributed as dist

    from partitioner import DeviceRates
    from partitioner.cost.collectives import all_reduce_s
    from partitioner.tp.collectives import reduce_from

    def median_s(fn: Any, times: int) -> float:
        fn()
        spans = []
        for _ in range(times):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            spans.append(time.perf_counter() - t0)
        return statistics.median(spans)

    out: dict[str, tuple[float, float, float]] = {}
    for name, lay in layouts.items():
        rates = DeviceRates(**lay["runner"].plan.rates) if lay["runner"].plan.rates else DeviceRates()
        if name == "tp2":
            x = torch.randn(cfg["batch"] // cfg["microbatches"], cfg["seq"], cfg["hidden"])
            g = functools.partial(reduce_from, x, lay["runner"].split_model.program.tp_comm)
            out[name] = (x.nbytes, median_s(g, 50), all_reduce_s(x.nbytes, 2, rates))
        if name == "dp2":
            flat = torch._utils._flatten_dense_tensors([p.detach() for p in lay["params"]])
            out[name] = (flat.nbytes, median_s(functools.partial(dist.all_reduce, flat), 5),
                         all_reduce_s(flat.nbytes, 2, rates))
    return out


def worker(rank: int, world: int, cfg: dict) -> dict[str, Any]:
    import torch.distributed as dist

    from smp.engine.planning import pipeline_runner

    torch.set_num_threads(1)
    pin(rank, cfg)
    warnings.simplefilter("ignore")  # torch's deprecation notices while tracing
    m, half = cfg["microbatches"], cfg["batch"] // 2
    setup = {"pp2": dict(pipelines=[[0, 1]], microbatches=m),
             "tp2": dict(pipelines=[[0], [1]], tp_groups=[[0, 1]], microbatches=m),
             "dp2": dict(pipelines=[[0], [1]], microbatches=m // 2)}
    layouts: dict[str, dict[str, Any]] = {}
    for name in cfg["layouts"]:
        model, ids = build(cfg)
        if name == "dp2":
            ids = ids[rank * half:(rank + 1) * half]
        mb = ids[:len(ids) // setup[name]["microbatches"]]  # example inputs: one microbatch
        runner = pipeline_runner(model, (mb, mb), schedule="1f1b", timeout_s=600, **setup[name])
        params = [p for p in runner.local_parameters() if p.requires_grad]
        layouts[name] = {"runner": runner, "ids": ids, "params": params, "opt": torch.optim.Adam(params, lr=1e-4),
                         "pred": predict(runner, rank, setup[name]["microbatches"], 2 if name == "dp2" else 1),
                         "stages": [f"{s.modules[0]} .. {s.modules[-1]}" for s in runner.plan.stages]}

    def fwd_bwd(name: str) -> float:
        lay = layouts[name]
        loss = lay["runner"].step((lay["ids"], lay["ids"]), loss_fn=_loss, return_outputs=False).loss
        if name == "dp2":  # as smp's data parallelism: one all-reduce of the flattened gradients, averaged
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in lay["params"]]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat)
            flat /= world
            for p, g in zip(lay["params"], torch._utils._unflatten_dense_tensors(flat, grads)):
                p.grad = g
        return float(loss)

    def train(name: str) -> float:
        layouts[name]["opt"].zero_grad(set_to_none=True)
        loss = fwd_bwd(name)
        layouts[name]["opt"].step()
        return loss

    first = {name: train(name) for name in cfg["layouts"]}  # every layout starts from the same weights
    for name in cfg["layouts"]:
        for _ in range(cfg["warmup"] - 1):
            train(name)
    pin(rank, cfg)  # gloo's threads started since
    times: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": [], "adam": []} for n in cfg["layouts"]}
    order = list(cfg["layouts"])
    for rnd in range(cfg["rounds"]):
        for name in order[rnd % len(order):] + order[:rnd % len(order)]:
            lay = layouts[name]
            lay["opt"].zero_grad(set_to_none=True)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            fwd_bwd(name)
            t1 = time.perf_counter()
            lay["opt"].step()
            c1 = time.thread_time()
            dist.barrier()
            times[name]["wall"].append(time.perf_counter() - t0)
            times[name]["cpu"].append(c1 - c0)
            times[name]["adam"].append(time.perf_counter() - t1)
    memory: dict[str, dict[str, float]] = {}
    for name in cfg["layouts"]:
        lay = layouts[name]
        lay["opt"].zero_grad(set_to_none=True)
        before = storage_bytes(state_tensors(lay["params"], lay["opt"], grads=False))
        dist.barrier()
        with quiet_stderr():  # the profiler's start and stop notices
            peak = peak_allocated(lambda name=name, opt=lay["opt"]: (fwd_bwd(name), opt.step()))
        memory[name] = {"peak": before + peak, "state": storage_bytes(state_tensors(lay["params"], lay["opt"]))}
    links = probe_links(layouts, cfg)
    for lay in layouts.values():
        lay["runner"].close()
    return {"links": links, "times": times, "memory": memory, "first": first,
            "pred": {n: layouts[n]["pred"] for n in layouts}, "stages": {n: layouts[n]["stages"] for n in layouts},
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null for a while (the profiler's C++ side prints there)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def report(res: list[dict[str, Any]], layouts: list[str], rounds: int) -> None:
    """Print the two tables: time, then memory per rank."""
    base = layouts[0]
    head = (f"{'layout':<7} {'step ms':>8} {'fastest':>8} {'vs ' + base:>7} {'cpu ms':>7} {'adam ms':>8} "
            f"{'pred ms':>8} {'comm pred':>9} {'meas/pred':>9}  loss (first step)")
    print(head)
    print("-" * len(head))
    losses = {n: statistics.mean(r["first"][n] for r in res) for n in layouts}  # dp2: the replicas' mean

    def walls(name: str) -> list[float]:  # per round; the ranks leave the closing barrier together
        return [max(a, b) for a, b in zip(res[0]["times"][name]["wall"], res[1]["times"][name]["wall"])]

    for name in layouts:
        t = [r["times"][name] for r in res]
        wall = walls(name)
        ratio = statistics.median(w / b for w, b in zip(wall, walls(base)))
        cpu = max(statistics.median(x["cpu"]) for x in t)
        adam = max(statistics.median(x["adam"]) for x in t)
        pred = max(r["pred"][name]["step"] for r in res)
        comm = max(r["pred"][name]["comm"] for r in res)
        step = statistics.median(wall)
        print(f"{name:<7} {step * 1e3:>8.0f} {min(wall) * 1e3:>8.0f} {ratio:>7.3f} {cpu * 1e3:>7.0f} "
              f"{adam * 1e3:>8.0f} {pred * 1e3:>8.0f} {comm * 1e3:>9.1f} {(step - adam) / pred:>9.2f}  "
              f"{losses[name]:.6f}")
    ref = losses[layouts[0]]
    agree = all(abs(v - ref) <= 1e-5 * abs(ref) for v in losses.values())
    print(f"first-step losses {'agree' if agree else 'DIFFER'} (relative 1e-5): the layouts compute the same step")
    for name, (nbytes, took, priced) in res[0]["links"].items():
        what = ("one all-reduce of a microbatch's hidden states" if name == "tp2" else
                "the all-reduce of the gradients")
        many = (f" ({res[0]['pred'][name]['collectives']} tp collectives per step)" if name == "tp2" else "")
        print(f"{name}: {what} ({nbytes / MiB:.2f} MiB) took {took * 1e3:.2f} ms here, priced {priced * 1e3:.2f} ms"
              f"{many}")
    print(f"step: forward, backward (dp2: and the gradient all-reduce) and Adam, barrier to barrier, median of "
          f"{rounds} rounds (fastest: the best round; vs {base}: the median of the rounds' ratios); cpu: the busier "
          "rank's main-thread CPU seconds in it (step - cpu: its main thread waiting, on the other rank, the link, "
          "gloo's threads or other processes); adam: Adam's step alone; pred: the cost model's step without Adam, "
          "and what communication adds to it; meas/pred = (step - adam) / pred")
    print()
    head = (f"{'layout':<7} {'rank':>4} {'peak MiB':>8} {'pred MiB':>8} {'state MiB':>9} {'pred MiB':>8}  holds")
    print(head)
    print("-" * len(head))
    for name in layouts:
        for rank, r in enumerate(res):
            mem, pred = r["memory"][name], r["pred"][name]
            stages = r["stages"][name]
            holds = ("the whole model" if name == "dp2" else "half of every layer" if name == "tp2" else
                     f"stage {rank}: {stages[rank]}")
            print(f"{name:<7} {rank:>4} {mem['peak'] / MiB:>8.0f} {pred['memory'] / MiB:>8.0f} "
                  f"{mem['state'] / MiB:>9.1f} {pred['state'] / MiB:>8.1f}  {holds}")
    if "tp2" in layouts and "dp2" in layouts:
        ratio = max(r["memory"]["tp2"]["state"] / r["memory"]["dp2"]["state"] for r in res)
        print(f"tp2 / dp2 parameters + gradients + Adam state per rank: {ratio:.3f}")
    print("peak: the most tracked tensor bytes the rank held during one step (parameters and Adam state before it, "
          "plus the peak of what the step and Adam allocated and had not freed: gradients, activations, logits, "
          "temporaries; torch's profiler); pred: the cost model's parameters, gradients, Adam state and activations "
          "held for backward at the schedule's peak; state: parameters + gradients + Adam state after the step "
          "(distinct storages) and its prediction")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds, every layout once per round (default 8)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per layout first (default 2)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step, all replicas together (default 8)")
    ap.add_argument("--microbatches", type=int, default=4, help="microbatches per step of pp2 and tp2; dp2's "
                    "replicas take half each (default 4: 2 sequences per microbatch)")
    ap.add_argument("--layers", type=int, default=6, help="transformer blocks (default 6)")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (default 256; 4 heads)")
    ap.add_argument("--vocab", type=int, default=50257, help="vocabulary (default 50257, GPT-2's)")
    ap.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of pp2,tp2,dp2 (default all)")
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin rank r to core r")
    args = ap.parse_args(argv)
    layouts = [n for n in args.layouts.split(",") if n]
    if set(layouts) - set(LAYOUTS) or not layouts:
        ap.error(f"--layouts {args.layouts!r}: choose from {','.join(LAYOUTS)}")
    if args.microbatches % 2 or args.batch % args.microbatches or args.warmup < 1:
        ap.error("--microbatches must be even (dp2's replicas take half each) and divide --batch; --warmup >= 1")
    cfg = {k: getattr(args, k) for k in ("rounds", "warmup", "batch", "microbatches", "layers", "hidden", "vocab",
                                         "seq", "pin")}
    cfg["layouts"] = layouts
    print(f"pp2 vs tp2 vs dp2 on 2 ranks (gloo, 1 thread each{', rank r on core r' if args.pin else ''}): GPT-2, "
          f"{args.layers} layers, hidden {args.hidden}, vocabulary {args.vocab:,}, sequence {args.seq}, loss in the "
          f"graph; batch {args.batch} in microbatches of {args.batch // args.microbatches}, 1F1B; fp32, Adam")
    print(f"{args.rounds} rounds, layouts alternating, medians. Before: {load_average()}", flush=True)
    began = time.perf_counter()
    res = run_ranks(worker, 2, cfg, timeout=3600, pg_timeout=600)
    report(res, layouts, args.rounds)
    rss = " / ".join(f"{r['rss'] / MiB:.0f}" for r in res)
    print(f"peak RSS of the ranks' processes (all layouts together, with torch and transformers): {rss} MiB")
    print(f"After: {load_average()}; {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
