"""Sharded data parallelism through the smp API against PyTorch's FSDP2 on the same Llama, 2 ranks.

Model: a transformers ``LlamaForCausalLM`` (``--layers`` decoder layers, hidden ``--hidden``, intermediate
``--intermediate``, ``--heads`` heads, vocabulary ``--vocab``: 7.2M parameters at the defaults), fp32, cross-entropy
on its logits, SGD with momentum; the same seed, weights and global batch of ``--batch`` sequences of ``--seq``
tokens, half per rank, one thread per rank, rank r pinned to core ``r % cores`` (``--no-pin`` to not).

* ``smp sdp``: ``smp.DistributedModel`` + ``@smp.step`` with ``sharded_data_parallel_degree=2``,
  ``sdp_param_persistence_threshold=0`` (every parameter sharded), one pipeline stage, one microbatch
  (:mod:`pipeline.param_gather`: a unit per decoder layer, prefetched, one reduce-scatter per unit);
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on each decoder layer and on the root (torchtitan's wrapping),
  ``loss.backward()`` and the optimizer step.

Each runs in its own pair of processes, alternating over ``--rounds`` rounds. A step is forward + backward + the
gradient reduction + the optimizer step, timed from a barrier to a barrier; the table has the median step and its
ratio to FSDP2's. Each run is checked against one process training the whole model on the whole batch (rank 0):
the largest loss difference and the largest relative parameter difference after its steps. Rank 0 counts the
collectives of one step (every ``c10d`` op the process dispatches: all-gathers, reduce-scatters, all-reduces and
the rest, with the bytes of their larger side) and what it holds after that step's backward: parameters, gradients
and optimizer state (its shards).

Each smp round also prices its own layout with ``smp plan`` (fixed degrees: pp 1, dp 2, sdp 2, threshold 1, one
microbatch of half the batch; :func:`target`, the model with its loss), the ops timed afresh by rank 0 after the
warm-up steps while its peer waits (``SMP_RECALIBRATE=1`` unless set, and this machine's per-pass and per-step
costs measured first, as ``step_model.py`` does: a shared machine's speed drifts by tens of per cent), and prints
that step beside the round's measured median (goal: within 25 %; the measured step also has the SGD step, which
``smp plan``'s step leaves out), and the step of the compute alone with both ranks busy and no collective
(:func:`compute_worker`): what the op times, taken in one process while its peer waits, do not see.

Run: ``python benchmarks/sdp_vs_fsdp.py [--rounds 3] [--steps 8]``: about a minute on two cores.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load_average, pin  # noqa: E402
from partitioner.cost import calibration  # noqa: E402
from smp.cli.runtime_costs import ensure_runtime_costs  # noqa: E402
from smp.testing import run_ranks  # noqa: E402

CONFIGS = ("smp sdp", "fsdp2")
GOAL = 0.25  # smp plan's predicted step against the measured one
SDP_CFG = "SDP_CFG"  # the environment variable target() reads the configuration from
LR, MOMENTUM = 0.05, 0.9


class CollectiveCount(TorchDispatchMode):
    """Counts the collectives this thread dispatches by kind, with the bytes of each call's larger side."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.__name__
        if func.namespace in ("c10d", "_c10d_functional") and not name.startswith(("wait", "barrier", "monitored")):
            kind = ("all-gather" if "gather" in name else "reduce-scatter" if "reduce_scatter" in name
                    else "all-reduce" if "allreduce" in name or "all_reduce" in name else "other")

            def size(x: Any) -> int:
                return sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))
            self.calls[kind] += 1
            self.bytes[kind] += max(size(args[0]), size(args[1]) if len(args) > 1 else 0)
        return func(*args, **(kwargs or {}))


class LM(torch.nn.Module):
    """The causal LM's logits (the loss is computed outside, as a training script does)."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        import transformers

        c = transformers.LlamaConfig(num_hidden_layers=cfg["layers"], hidden_size=cfg["hidden"],
                                     intermediate_size=cfg["intermediate"], num_attention_heads=cfg["heads"],
                                     num_key_value_heads=cfg["heads"], vocab_size=cfg["vocab"],
                                     max_position_embeddings=cfg["seq"], use_cache=False, attn_implementation="eager")
        self.model = transformers.LlamaForCausalLM(c)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class LMLoss(LM):
    """The LM with the step's loss, as ``smp plan`` prices a step: ids of ``seq + 1`` tokens in, the loss out."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _loss(super().forward(ids[:, :-1]), ids[:, 1:])


def target() -> tuple[torch.nn.Module, tuple]:
    """``smp plan``'s TARGET (``benchmarks/sdp_vs_fsdp.py:target``): the Llama of the configuration in ``$SDP_CFG``
    (JSON) with its loss, and one replica's half of the global batch."""
    cfg = json.loads(os.environ[SDP_CFG])
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"] // 2, cfg["seq"] + 1),
                        generator=torch.Generator().manual_seed(1))
    return LMLoss(cfg), (ids,)


def predicted_step(cfg: dict) -> float:
    """The step ``smp plan`` predicts for the smp run's layout (pp 1, dp 2 = sdp 2, every parameter sharded, one
    microbatch per replica), its ops timed now, beside the steps it predicts (as ``step_model.py --plan`` does)."""
    import tempfile

    from smp.cli import main as smp_main

    os.environ[SDP_CFG] = json.dumps(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        code = smp_main(["plan", f"{Path(__file__).resolve()}:target", "--devices", "2", "--global-batch",
                         str(cfg["batch"]), "--pp", "1", "--tp", "1", "--dp", "2", "--sdp", "2", "--sdp-threshold", "1",
                         "--microbatch-size", str(cfg["batch"] // 2), "--schedules", "1f1b", "--checkpointing", "none",
                         "--zero1", "off", "--top", "1", "-q", "--json", f"{tmp}/plan.json"])
        return float(json.loads(Path(tmp, "plan.json").read_text())["layouts"][0]["step_s"]) if not code else 0.0


def _local_bytes(tensors: Any) -> int:
    out = 0
    for t in tree_leaves(tensors):
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            out += local.numel() * local.element_size()
    return out


def worker(rank: int, world: int, name: str, cfg: dict) -> dict[str, Any] | None:
    import torch.distributed as dist

    state: list[int] = []

    def probe() -> None:  # after a step's backward, before the optimizer: what the rank holds then
        if not state and counting:
            state.append(_local_bytes(held()))

    counting = False
    torch.set_num_threads(1)
    pin(rank, cfg)
    torch.manual_seed(0)
    model = LM(cfg)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g) for _ in range(2)]
    reference = copy.deepcopy(model) if rank == 0 else None
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt: Any = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

        def one_step(i: int) -> float:
            ids = data[i % 2].chunk(world)[rank]
            loss = _loss(model(ids[:, :-1]), ids[:, 1:])
            loss.backward()
            probe()
            opt.step()
            opt.zero_grad()
            out = loss.detach().clone()
            dist.all_reduce(out)
            return float(out) / world
        params = lambda: {n: p.full_tensor() for n, p in model.named_parameters()}  # type: ignore[attr-defined]  # noqa: E731
        held = lambda: [[(p, p.grad) for p in model.parameters()], opt.state_dict()["state"]]  # noqa: E731
    else:
        import smp

        smp.init({"pipeline_parallel_degree": 1, "microbatches": 1, "ddp": True,
                  "sharded_data_parallel_degree": world, "sdp_param_persistence_threshold": 0,
                  "sdp_gradient_clipping": 0})
        dmodel = smp.DistributedModel(model)
        opt = smp.DistributedOptimizer(torch.optim.SGD(dmodel.parameters(), lr=LR, momentum=MOMENTUM))

        @smp.step
        def train_step(m: Any, ids: torch.Tensor) -> torch.Tensor:
            loss = _loss(m(ids[:, :-1]), ids[:, 1:])
            m.backward(loss)
            return loss

        def one_step(i: int) -> float:
            loss = train_step(dmodel, data[i % 2].chunk(world)[rank])
            probe()
            opt.step()
            opt.zero_grad()
            return float(loss.reduce_mean())  # this replica's loss: averaged over the replicas below
        params = lambda: dmodel.state_dict()  # noqa: E731
        held = lambda: [[(p, p.grad) for p in dmodel.local_parameters()], opt.local_state_dict()["state"]]  # noqa: E731
    losses = [one_step(i) for i in range(2)]  # partition + warm-up
    counter = CollectiveCount()
    counting = True
    with counter:
        losses.append(one_step(2))
    predicted = predicted_step(cfg) if name != "fsdp2" and rank == 0 else 0.0  # the peer waits at the barrier
    wall = []
    for i in range(cfg["steps"]):
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(one_step(3 + i))
        dist.barrier()
        wall.append(time.perf_counter() - t0)
    tot = torch.tensor(losses)
    dist.all_reduce(tot)
    losses = (tot / world).tolist() if name != "fsdp2" else losses
    whole = params()
    if reference is None:
        return None
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    ref_losses = []
    for i in range(len(losses)):
        ids = data[i % 2]
        loss = _loss(reference(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(loss))
    ref = dict(reference.named_parameters())
    rel = max(float((whole[n] - p).abs().max() / p.abs().max().clamp_min(1e-12)) for n, p in ref.items())
    return {"wall": wall, "predicted": predicted, "calls": dict(counter.calls), "bytes": dict(counter.bytes),
            "state": state[0],
            "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)), "param_rel": rel,
            "params": sum(p.numel() for p in ref.values())}


def compute_worker(rank: int, world: int, cfg: dict) -> float | None:
    """Each rank trains a whole copy of the model on its half of the batch with no collective (a barrier around each
    step): the median step of the compute alone on this host with every rank busy, which the plan's op times (taken
    in one process while its peer waits) do not see; rank 0 returns it."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    pin(rank, cfg)
    torch.manual_seed(0)
    model = LM(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1),
                        generator=torch.Generator().manual_seed(1)).chunk(world)[rank]
    wall = []
    for i in range(cfg["steps"] + 2):
        dist.barrier()
        t0 = time.perf_counter()
        _loss(model(ids[:, :-1]), ids[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if i >= 2:
            wall.append(time.perf_counter() - t0)
    return statistics.median(wall) if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds over the configurations")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per configuration per round")
    ap.add_argument("--batch", type=int, default=8, help="global batch in sequences (half per rank)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin rank r to core r %% cores")
    args = ap.parse_args(argv)
    os.environ.setdefault(calibration.RECALIBRATE_ENV, "1")  # ops timed beside the steps they predict (the ranks)
    ensure_runtime_costs()  # this machine's per-pass and per-step costs, measured now
    cfg = {k: getattr(args, k) for k in ("steps", "batch", "seq", "layers", "hidden", "intermediate", "heads",
                                         "vocab", "pin")}
    print(f"sdp vs fsdp2: Llama {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
          f"{args.heads} heads, vocabulary {args.vocab}; batch {args.batch} x {args.seq} tokens over 2 ranks, fp32, "
          f"SGD; every parameter sharded")
    print(f"{args.rounds} rounds x {args.steps} timed steps per configuration, alternating. Before: {load_average()}")
    began = time.perf_counter()
    wall: dict[str, list[float]] = {k: [] for k in CONFIGS}
    last: dict[str, dict] = {}
    predicted: list[tuple[float, float]] = []  # per smp round: smp plan's step, the round's median step
    for rnd in range(args.rounds):
        for name in (CONFIGS if rnd % 2 == 0 else CONFIGS[::-1]):
            res = run_ranks(worker, 2, name, cfg, timeout=900, pg_timeout=300)[0]
            wall[name] += res["wall"]
            last[name] = res
            if name == "smp sdp":
                predicted.append((res["predicted"], statistics.median(res["wall"])))
    print(f"{last['fsdp2']['params'] / 1e6:.1f}M parameters")
    print()
    kinds = ("all-gather", "reduce-scatter", "all-reduce", "other")
    head = (f"{'config':<8} {'ms/step':>8} {'vs fsdp2':>8} {'loss err':>9} {'param rel':>9} {'state MiB':>9}  "
            f"collectives per step on rank 0 (count / MiB)")
    print(head)
    print("-" * (len(head) + 40))
    base = statistics.median(wall["fsdp2"])
    for name in CONFIGS:
        r = last[name]
        t = statistics.median(wall[name])
        comm = ", ".join(f"{k} {r['calls'].get(k, 0)} / {r['bytes'].get(k, 0) / 2**20:.2f}" for k in kinds)
        print(f"{name:<8} {t * 1e3:>8.1f} {base / t:>7.2f}x {r['loss_err']:>9.1e} {r['param_rel']:>9.1e} "
              f"{r['state'] / 2**20:>9.2f}  {comm}")
    print(f"medians of {args.rounds * args.steps} steps each; 'vs fsdp2': FSDP2's median step / this one's (above 1: "
          "faster); loss err: largest |loss - one process's| over the steps; param rel: largest |difference| / "
          "max |parameter| after them; state: this rank's parameters, gradients and optimizer state after a "
          "step's backward")
    alone = run_ranks(compute_worker, 2, cfg, timeout=900, pg_timeout=300)[0]
    print(f"the compute alone (each rank its half of the batch, no collective, both at once): {alone * 1e3:.1f} ms")
    errs = sorted(p / m - 1 for p, m in predicted)
    print(f"smp plan's step for the smp run's layout (pp1 dp2 sdp2, ops timed beside each round's steps): "
          f"{statistics.median(p for p, _ in predicted) * 1e3:.1f} ms vs measured "
          f"{statistics.median(m for _, m in predicted) * 1e3:.1f} ms, median error {statistics.median(errs):+.1%} "
          f"({' '.join(f'{e:+.0%}' for e in errs)}; goal within {GOAL:.0%})")
    print(f"After: {load_average()}; {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
