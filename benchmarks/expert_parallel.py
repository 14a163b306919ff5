"""Expert parallelism through ``@smp.step`` against a hand-written all-to-all mixture-of-experts layer and plain data
parallelism: step time, and the memory a rank holds, measured and as ``smp inspect --ep`` predicts it.

Model: a Mixtral causal LM from ``transformers.MixtralConfig`` (``--layers`` 4, hidden 128, 8 experts of intermediate
``--expert-width`` 512, top-2, 4 heads, vocabulary 2,000; the experts about 85 % of its weights), random weights from
seed 0, its loss in the model (``labels=``, the router's auxiliary loss included), fp32, AdamW; a global batch of
``--batch`` sequences of ``--seq`` tokens, half on each of 2 ranks (gloo on this host, one thread per rank).

Configurations, each in its own pair of processes, alternating over ``--rounds`` rounds:

* ``smp dp2``: ``"ddp": True``, 1 microbatch, ``expert_parallel_degree`` 1: every rank holds every expert;
* ``smp ep2``: the same with ``expert_parallel_degree`` 2: each rank holds 4 of each layer's 8 experts, rows routed
  by all-to-all (:mod:`partitioner.ep.dispatch`);
* ``hand ep2``: the model in eager torch, each experts module's forward replaced by the same algorithm written by hand
  (torchtitan's design: one all-to-all of counts, one of rows, the grouped matmul the traced model runs,
  ``transformers``' ``grouped_mm_fallback``, over this rank's experts, one all-to-all back; torch's autograd-aware
  functional all-to-all), the other gradients averaged in one flat all-reduce after the backward, the experts'
  divided by 2.

A step is forward, backward, averaging and ``AdamW.step()``, timed from a barrier to a barrier after ``--warmup``
untimed steps; ``ms/step`` is the median over rounds of each round's median. ``held`` is what rank 0 holds after a
step: parameters, gradients and AdamW state (bytes of its tensors); ``predicted`` is the same three from ``smp inspect
--ep E --json`` (the plan's weights, gradients and optimizer bytes of the one stage), and ``pred/held`` their ratio.
Losses of the first step are compared with one process (``loss err``). The load average is printed before and after.

Run: ``python benchmarks/expert_parallel.py [--rounds 3] [--steps 6] [--warmup 2] [--batch 8] [--seq 128]``: about two
minutes on two cores.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load_average, pin  # noqa: E402
from smp.testing import run_ranks  # noqa: E402

__all__ = ["mixtral", "main"]

CONFIGS = ("smp dp2", "smp ep2", "hand ep2")
DIMS = {"layers": 4, "expert_width": 512, "batch": 8, "seq": 128}


def _model(layers: int, expert_width: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=2000, hidden_size=128, intermediate_size=expert_width, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512, output_router_logits=True, router_aux_loss_coef=0.02))


def _batch(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, 2000, (batch, seq), generator=torch.Generator().manual_seed(1))


def mixtral() -> tuple:
    """``smp inspect`` factory: the benchmark's model and one rank's half of the batch (``SMP_BENCH_DIMS``: JSON)."""
    dims = {**DIMS, **json.loads(os.environ.get("SMP_BENCH_DIMS", "{}"))}
    ids = _batch(dims["batch"], dims["seq"])[: dims["batch"] // 2]
    return _model(dims["layers"], dims["expert_width"]), (ids,), {"labels": ids}


def _held(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> int:
    """Bytes of ``params``, their gradients and ``opt``'s state tensors."""
    total = sum(p.numel() * p.element_size() for p in params)
    total += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    return total + sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor) and v.dim())


def _hand_experts(module: torch.nn.Module, rank: int, ep: int) -> None:
    """Give ``module`` (a ``transformers`` experts module) this rank's experts and an all-to-all forward."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    grouped = torch.ops.transformers.grouped_mm_fallback  # the kernel the traced model runs (one mm per expert)

    experts = module.num_experts
    per = experts // ep
    for name in ("gate_up_proj", "down_proj"):
        whole = getattr(module, name)
        setattr(module, name, torch.nn.Parameter(whole.detach()[rank * per:(rank + 1) * per].clone()))
    module.hand_expert = True

    def a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        return wait_tensor(all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, dist.group.WORLD))

    def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[-1]
        ids, order = top_k_index.reshape(-1).sort()
        rows = hidden[order // k]
        send = torch.bincount(ids, minlength=experts).reshape(ep, per)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        ins, outs = send.sum(1).tolist(), recv.sum(1).tolist()
        arrived = a2a(rows, outs, ins)
        expert_of = torch.repeat_interleave(torch.arange(per).repeat(ep), recv.reshape(-1))
        source_of = torch.repeat_interleave(torch.arange(ep), recv.sum(1))
        local = torch.argsort(expert_of * ep + source_of, stable=True)
        offs = torch.cumsum(recv.sum(0), 0).to(torch.int32)
        gate, up = grouped(arrived[local], module.gate_up_proj.transpose(-2, -1), offs).chunk(2, dim=-1)
        done = grouped(module.act_fn(gate) * up, module.down_proj.transpose(-2, -1), offs)
        home = a2a(done[torch.argsort(local)], ins, outs)
        back = torch.zeros_like(home).index_copy(0, order, home)
        return (back.view(-1, k, hidden.shape[-1]) * top_k_weights.unsqueeze(-1)).sum(1)

    module.forward = forward


def _run(rank: int, world: int, config: str, dims: dict, steps: int, warmup: int) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    pin(rank, {"pin": True})
    ids = _batch(dims["batch"], dims["seq"]).chunk(world)[rank]
    net = _model(dims["layers"], dims["expert_width"])
    if config == "hand ep2":
        for m in net.modules():
            if type(m).__name__ == "MixtralExperts":
                _hand_experts(m, rank, world)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
        params = list(net.parameters())

        def step() -> float:
            loss = net(ids, labels=ids).loss
            loss.backward()
            shared = [p.grad for p in params if p.grad is not None and p.dim() != 3]
            flat = torch._utils._flatten_dense_tensors(shared)
            dist.all_reduce(flat)  # one all-reduce of every gradient but the experts'
            for g, avg in zip(shared, torch._utils._unflatten_dense_tensors(flat, shared)):
                g.copy_(avg / world)
            for p in params:
                if p.grad is not None and p.dim() == 3:  # an expert's gradient sums both ranks' rows already
                    p.grad /= world
            opt.step()
            opt.zero_grad(set_to_none=False)
            return float(loss.detach())
    else:
        import smp

        smp.init({"pipeline_parallel_degree": 1, "ddp": True, "microbatches": 1,
                  "expert_parallel_degree": 2 if config == "smp ep2" else 1})
        model = smp.DistributedModel(net)
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

        @smp.step
        def train_step(model: Any, ids: torch.Tensor) -> Any:
            out = model(ids, labels=ids)
            model.backward(out.loss)
            return out.loss

        def step() -> float:
            loss = float(train_step(model, ids).reduce_mean())
            opt.step()
            opt.zero_grad(set_to_none=False)
            return loss
        params = list(model.local_parameters())
    first = step()
    held = _held(params, opt.optimizer if hasattr(opt, "optimizer") else opt)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return {"ms": 1e3 * statistics.median(times), "held": held, "loss": first}


def _reference_loss(dims: dict) -> float:
    """Rank 0's first loss computed by one process (the model whole, its half of the batch)."""
    ids = _batch(dims["batch"], dims["seq"]).chunk(2)[0]
    with torch.no_grad():
        return float(_model(dims["layers"], dims["expert_width"])(ids, labels=ids).loss)


def _predicted(ep: int, dims: dict) -> int:
    """Weights, gradients and optimizer state of the one stage as ``smp inspect --ep`` predicts them."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        env = {**os.environ, "SMP_BENCH_DIMS": json.dumps(dims), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        subprocess.run([sys.executable, "-m", "smp.cli", "inspect", f"{Path(__file__).resolve()}:mixtral",
                        "--partitions", "1", "--ep", str(ep), "--estimate", "--optimizer", "adamw", "--json", str(out),
                        "-q"], check=True, env=env, capture_output=True)
        m = json.loads(out.read_text())["memory"][0]
    return int(m["weights_bytes"] + m["gradient_bytes"] + m["optimizer_bytes"])


def main() -> None:
    """Run the configurations side by side and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=DIMS["batch"])
    ap.add_argument("--seq", type=int, default=DIMS["seq"])
    ap.add_argument("--layers", type=int, default=DIMS["layers"])
    ap.add_argument("--expert-width", type=int, default=DIMS["expert_width"])
    ns = ap.parse_args()
    dims = {"batch": ns.batch, "seq": ns.seq, "layers": ns.layers, "expert_width": ns.expert_width}
    print(f"before: {load_average()}", flush=True)
    ms: dict[str, list[float]] = {c: [] for c in CONFIGS}
    first: dict[str, dict] = {}
    for r in range(ns.rounds):
        for config in CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]:
            got = run_ranks(_run, 2, config, dims, ns.steps, ns.warmup, timeout=900)[0]
            ms[config].append(got["ms"])
            first.setdefault(config, got)
    predicted = {"smp dp2": _predicted(1, dims), "smp ep2": _predicted(2, dims), "hand ep2": _predicted(2, dims)}
    reference = _reference_loss(dims)
    base = statistics.median(ms["smp dp2"])
    print(f"{'config':10} {'ms/step':>9} {'vs dp2':>7} {'held (rank 0)':>14} {'predicted':>10} {'pred/held':>9} "
          f"{'loss err':>9}")
    for c in CONFIGS:
        t, held = statistics.median(ms[c]), first[c]["held"]
        print(f"{c:10} {t:9.1f} {base / t:6.2f}x {held / 2**20:11.2f} MiB {predicted[c] / 2**20:6.2f} MiB "
              f"{predicted[c] / held:9.3f} {abs(first[c]['loss'] - reference):9.1e}")
    print(f"after: {load_average()}")


if __name__ == "__main__":
    main()
