"""Context parallelism: the activations a rank holds for one long sequence, and the step time, with the sequence split
over 2 ranks (``context_parallel_degree`` 2) and in one process, measured beside what ``smp inspect --cp 2``
predicts; and the engine's cp2 against a hand-written all-gather context parallelism of the same model.

Models: a Llama-shaped and a GPT-2-shaped causal LM from ``transformers`` configs (random weights from seed 0, nothing
downloaded; ``--layers`` 2, ``--hidden`` 256 with 64-wide heads, Llama's MLP 2.75x and GPT-2's 4x wide, vocabulary
2,000, ``attn_implementation="sdpa"``, no dropout), their loss in the model (``labels=``, only the loss returned:
:class:`benchmarks.common.LossOnly`), fp32, Adam; one sequence of ``--seq`` 2,048 tokens per step. Configurations, each
in its own processes (gloo, one thread per rank), alternating over ``--rounds`` rounds:

* ``smp 1``: ``smp.init`` + ``smp.DistributedModel`` + ``@smp.step`` on one rank, the whole sequence;
* ``smp cp2``: the same on 2 ranks with ``context_parallel_degree`` 2 and ``prescaled_batch`` True, both ranks passing
  the sequence: each runs every token-wise op on its load-balanced half (chunks r and 3 - r of 4), attention reads the
  group's all-gathered keys and values, the loss is the group's (:mod:`partitioner.cp`);
* ``eager 1``: the model in eager torch in one process, the whole sequence;
* ``hand cp2``: what a user would write for the same model (torch's own ``context_parallel`` does not run on CPU, see
  below): each rank feeds its load-balanced half of the ids with their ``position_ids``;
  ``torch.nn.functional.scaled_dot_product_attention`` is wrapped during the forward to all-gather the keys and
  values (``torch.distributed._functional_collectives.all_gather_single``, autograd-aware: its backward a
  reduce-scatter) and attend with the causal mask of the rank's global positions; the loss is the group's sum over
  the group's targets (an autograd-aware all-reduce), the gradients averaged in one flat all-reduce. It is checked
  against one process (loss and every gradient) before it is timed.

Measured per rank, in the first round (after a first step, ``Adam.step()`` included):

* ``saved``: the activations the step holds for backward: every distinct storage autograd saves in the step's
  forward, parameters and buffers left out (:func:`partitioner.capture.saved_activations.measure_saved_activations`
  around the step), the quantity ``smp inspect`` predicts;
* ``peak``: the most tracked tensor bytes allocated and not yet freed during one forward and backward, above the
  parameters, gradients (kept allocated) and Adam state (torch's profiler,
  :func:`benchmarks.tensor_parallel.peak_allocated`);
* ``loss err`` / ``grad err``: the first step's loss and gradients against the eager model on the whole sequence in
  the same process.

Predicted: ``activation_bytes`` of the one stage from ``smp inspect FILE:llama -p 1 [--cp 2] --estimate --json`` (its
Python entry, :func:`smp.cli.entry.main`, on this file's factories ``llama`` and ``gpt2``, whose dims
``SMP_BENCH_DIMS`` overrides as JSON). ``ms/step`` is forward, backward, averaging and ``Adam.step()``, timed from a
barrier to a barrier after ``--warmup`` untimed steps, the median over rounds of each round's median.

torch's ``torch.distributed.tensor.experimental.context_parallel`` fails on CPU in torch 2.13 (:func:`torch_cp_on_cpu`
runs it on two ranks and returns the message): ``NotImplementedError: Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered.``

Run: ``python benchmarks/context_parallel.py [--models llama,gpt2] [--layers 2] [--hidden 256] [--seq 2048]
[--rounds 3] [--steps 4] [--warmup 1] [--configs ...] [--no-time]``: about six minutes on two cores. The load average
is printed before and after.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import sequence_parallel  # noqa: E402
from benchmarks.common import LossOnly, inspect_memory, load_average, pin  # noqa: E402
from benchmarks.tensor_parallel import peak_allocated, quiet_stderr, state_tensors, storage_bytes  # noqa: E402
from smp.testing import run_ranks  # noqa: E402

__all__ = ["MODELS", "CONFIGS", "DIMS", "build", "llama", "gpt2", "hand_attention", "measure", "predict",
           "torch_cp_on_cpu", "main"]

MODELS = ("llama", "gpt2")
CONFIGS = ("smp 1", "smp cp2", "eager 1", "hand cp2")
DIMS = {"layers": 2, "hidden": 256, "seq": 2048}
VOCAB = sequence_parallel.VOCAB
MiB = 2 ** 20


def build(name: str, dims: dict[str, int]) -> tuple[torch.nn.Module, torch.Tensor]:
    """The ``name`` model (``llama`` or ``gpt2``, a ``transformers`` causal LM, not wrapped; the shapes of
    :func:`benchmarks.sequence_parallel.build`) and its one sequence of token ids (1 x ``seq``)."""
    wrapped, ids = sequence_parallel.build(name, {**dims, "batch": 1})
    return wrapped.model, ids


def _factory(name: str) -> tuple:
    model, ids = build(name, {**DIMS, **json.loads(os.environ.get("SMP_BENCH_DIMS", "{}"))})
    return LossOnly(model), (ids, ids), {}


def llama() -> tuple:
    """``smp inspect`` factory: the Llama-shaped model (loss only) and its one sequence (``SMP_BENCH_DIMS``: JSON of
    dims)."""
    return _factory("llama")


def gpt2() -> tuple:
    """``smp inspect`` factory: the GPT-2-shaped model (loss only) and its one sequence (``SMP_BENCH_DIMS``: JSON of
    dims)."""
    return _factory("gpt2")


def _positions(seq: int, rank: int, cp: int) -> torch.Tensor:
    """The load-balanced positions of cp rank ``rank``: chunks ``rank`` and ``2 cp - 1 - rank`` of ``2 cp``."""
    chunk = seq // (2 * cp)
    late = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk), torch.arange(late * chunk, (late + 1) * chunk)])


@contextlib.contextmanager
def hand_attention(positions: torch.Tensor, seq: int, group: Any = None) -> Any:
    """Within the block, ``F.scaled_dot_product_attention`` runs this rank's queries (the tokens at ``positions``)
    against the keys and values of the whole group, all-gathered along the sequence (autograd-aware), under the
    causal mask of the global positions; the mask and ``is_causal`` the model passes (of its local tokens) are
    ignored."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F

    group = group or dist.group.WORLD
    cp = dist.get_world_size(group)
    held = torch.cat([_positions(seq, r, cp) for r in range(cp)])
    order = torch.argsort(held)
    mask = positions[:, None] >= torch.arange(seq)[None, :]
    plain = F.scaled_dot_product_attention

    def gather(x: torch.Tensor) -> torch.Tensor:  # (batch, heads, local, dim) -> (batch, heads, seq, dim)
        whole = funcol.all_gather_single(x.movedim(2, 0).contiguous(), 0, group)
        return whole.index_select(0, order).movedim(0, 2)

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
        return plain(query, gather(key), gather(value), attn_mask=mask, dropout_p=dropout_p, scale=scale,
                     enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = plain


def _hand_loss(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The group's mean next-token loss from this rank's tokens (``positions`` of the sequence ``ids``)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F

    seq = ids.shape[1]
    with hand_attention(positions, seq):
        logits = model(input_ids=ids[:, positions], position_ids=positions[None], use_cache=False).logits
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)[:, positions]
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    count = (targets != -100).sum().to(total.dtype)
    dist.all_reduce(count)
    return funcol.all_reduce(total, "sum", dist.group.WORLD) / count


class _Step(torch.nn.Module):
    """One training step as a module holding the model (its parameters and buffers), for
    :func:`partitioner.capture.saved_activations.measure_saved_activations`."""

    def __init__(self, model: torch.nn.Module, step: Any):
        super().__init__()
        self.model, self.step = model, step

    def forward(self, ids: torch.Tensor) -> Any:
        return self.step(ids)


def _run(rank: int, world: int, config: str, name: str, dims: dict[str, int], steps: int, warmup: int,
         check: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from partitioner.capture.saved_activations import measure_saved_activations

    torch.set_num_threads(1)
    pin(rank, {"pin": world > 1})
    warnings.simplefilter("ignore")  # torch's deprecation notices while tracing
    net, ids = build(name, dims)
    reference = LossOnly(build(name, dims)[0]) if check else None
    if config.startswith("smp"):
        import smp

        smp.init({"pipeline_parallel_degree": 1, "ddp": True, "microbatches": 1, "prescaled_batch": True,
                  "context_parallel_degree": world})
        model = smp.DistributedModel(LossOnly(net))
        params = [p for p in model.local_parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=1e-4)
        named = dict(model.local_named_parameters())

        @smp.step
        def train_step(model: Any, ids: torch.Tensor) -> Any:
            loss = model(ids, ids)
            model.backward(loss)
            return loss

        def forward_backward(ids: torch.Tensor) -> torch.Tensor:
            return train_step(model, ids).reduce_mean()
        module: torch.nn.Module = model
    else:
        module = LossOnly(net)
        params = [p for p in module.parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=1e-4)
        named = dict(module.named_parameters())
        positions = _positions(dims["seq"], rank, world)

        def forward_backward(ids: torch.Tensor) -> torch.Tensor:
            if config == "eager 1":
                loss = module(ids, ids)
                loss.backward()
                return loss.detach()
            loss = _hand_loss(net, ids, positions)
            loss.backward()
            flat = torch._utils._flatten_dense_tensors([p.grad for p in params])
            dist.all_reduce(flat)  # each rank's gradients are its tokens' share, times the group: their mean
            for p, g in zip(params, torch._utils._unflatten_dense_tensors(flat, [p.grad for p in params])):
                p.grad.copy_(g / world)
            return loss.detach()

    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    loss = forward_backward(ids)
    out["first_s"] = time.perf_counter() - t0
    if reference is not None:
        ref = reference(ids, ids)
        ref.backward()
        out["loss"], out["loss_err"] = float(loss), abs(float(loss) - float(ref))
        grads = {n: p.grad for n, p in reference.named_parameters()}
        out["grad_err"] = max(float((p.grad - grads[n]).abs().max()) for n, p in named.items() if p.grad is not None)
        out["grads"] = sum(p.grad is not None for p in named.values())
    opt.step()
    opt.zero_grad(set_to_none=False)  # the gradients stay allocated: the peak is above them
    if check:
        step = _Step(module, forward_backward)
        out["saved"] = measure_saved_activations(step, (ids,)).total_bytes
        opt.zero_grad(set_to_none=False)
        out["state"] = storage_bytes(state_tensors(params, opt))
        with quiet_stderr():  # the profiler's start and stop notices
            out["peak"] = peak_allocated(lambda: forward_backward(ids))
        opt.zero_grad(set_to_none=False)
    for _ in range(warmup):
        forward_backward(ids)
        opt.step()
        opt.zero_grad(set_to_none=False)
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        forward_backward(ids)
        opt.step()
        opt.zero_grad(set_to_none=False)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    out["ms"] = 1e3 * statistics.median(times) if times else float("nan")
    return out


def measure(name: str, dims: dict[str, int], config: str, steps: int = 0, warmup: int = 0,
            check: bool = True) -> list[dict[str, Any]]:
    """One run of ``config`` (of :data:`CONFIGS`) on its ranks, per rank: ``ms`` (median of ``steps`` timed steps
    after ``warmup``) and the first step's seconds ``first_s``; with ``check`` also ``saved``, ``peak`` and
    ``state`` bytes and the first step's ``loss``, ``loss_err`` and ``grad_err`` against one eager process."""
    world = 2 if config.endswith("cp2") else 1
    return run_ranks(_run, world, config, name, dims, steps, warmup, check, timeout=900, pg_timeout=300)


def predict(name: str, dims: dict[str, int], cp: int) -> int:
    """Activation bytes per rank that ``smp inspect -p 1 --cp cp --estimate`` predicts for the model."""
    options = ["--cp", str(cp)] if cp > 1 else []
    return int(inspect_memory(f"{Path(__file__).resolve()}:{name}", options, dims)["activation_bytes"])


def _torch_cp(rank: int, world: int) -> str:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(0))
    w = torch.nn.Parameter(torch.randn(16, 16))
    try:
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[2]):
            q = x @ w
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    except Exception as exc:  # what a user meets
        return f"{type(exc).__name__}: {exc}"
    return "ran"


def torch_cp_on_cpu() -> str:
    """torch's ``context_parallel`` (causal SDPA on 2 gloo ranks, CPU): ``"ran"``, or the error it raises."""
    return run_ranks(_torch_cp, 2, timeout=300)[0]


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "-"


def main(argv: list[str] | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """Measure, time and predict every model and configuration; print the tables; return the numbers per model and
    configuration."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated, of llama,gpt2 (default both)")
    for key, value in DIMS.items():
        ap.add_argument(f"--{key}", type=int, default=value, help=f"default {value}")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds, configurations alternating (default 3)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run (default 4)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them (default 1)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {','.join(CONFIGS)}")
    ap.add_argument("--no-time", action="store_true", help="memory, exactness and prediction only: no timed rounds")
    ns = ap.parse_args(argv)
    models = [m for m in ns.models.split(",") if m]
    configs = [c for c in CONFIGS if c in ns.configs.split(",")]
    if set(models) - set(MODELS) or not models:
        ap.error(f"--models {ns.models!r}: choose from {','.join(MODELS)}")
    if ns.hidden % 64 or ns.seq % 4:
        ap.error("--hidden must be a multiple of 64 (64-wide heads) and --seq of 4 (4 chunks over 2 ranks)")
    dims = {key: getattr(ns, key) for key in DIMS}
    steps, rounds = (0, 1) if ns.no_time else (ns.steps, ns.rounds)
    print(f"context parallelism of degree 2 against one process (gloo, 1 thread per rank): {dims['layers']} layers, "
          f"hidden {dims['hidden']}, vocabulary {VOCAB:,}, 1 sequence of {dims['seq']} tokens, fp32, Adam", flush=True)
    print(f"before: {load_average()}", flush=True)
    began = time.perf_counter()
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for name in models:
        got: dict[str, dict[str, Any]] = {}
        for r in range(rounds):
            for config in configs[r % len(configs):] + configs[:r % len(configs)]:
                ranks = measure(name, dims, config, steps, ns.warmup if steps else 0, check=r == 0)
                row = got.setdefault(config, {"ms": []})
                row["ms"].append(max(x["ms"] for x in ranks))
                if r == 0:
                    row.update({k: max(x[k] for x in ranks) for k in ("saved", "peak", "state", "loss_err",
                                                                         "grad_err", "first_s")},
                               loss=ranks[0]["loss"])
        pred = {1: predict(name, dims, 1), 2: predict(name, dims, 2)}
        for config, row in got.items():
            row["pred"] = pred[2] if config.endswith("cp2") else pred[1]
            rounds_ms = row["ms"]
            row["ms"] = statistics.median(rounds_ms) if steps else float("nan")
            row["spread"] = max(rounds_ms) / min(rounds_ms) if steps else float("nan")
        table[name] = got
    head = (f"{'model':<6} {'config':<8} {'saved MiB':>9} {'peak MiB':>8} {'pred MiB':>8} {'pred/saved':>10} "
            f"{'ms/step':>8} {'spread':>6} {'loss err':>8} {'grad err':>8}")
    print(head)
    print("-" * len(head))
    for name, got in table.items():
        for config, g in got.items():
            print(f"{name:<6} {config:<8} {g['saved'] / MiB:>9.2f} {g['peak'] / MiB:>8.2f} {g['pred'] / MiB:>8.2f} "
                  f"{g['pred'] / g['saved']:>10.3f} {g['ms']:>8.1f} {g['spread']:>6.2f} {g['loss_err']:>8.1e} "
                  f"{g['grad_err']:>8.1e}")
        for impl, one, two in (("smp", "smp 1", "smp cp2"), ("hand", "eager 1", "hand cp2")):
            if one in got and two in got:
                a, b = got[two], got[one]
                print(f"{name:<6} {impl} cp2/one: saved {_ratio(a['saved'], b['saved'])}, peak "
                      f"{_ratio(a['peak'], b['peak'])}, predicted {_ratio(a['pred'], b['pred'])}, ms/step "
                      f"{_ratio(a['ms'], b['ms'])}")
        if "smp cp2" in got and "hand cp2" in got:
            print(f"{name:<6} smp cp2 / hand cp2 ms/step {_ratio(got['smp cp2']['ms'], got['hand cp2']['ms'])}")
    print("saved: activations held for backward per rank (the larger rank's); peak: the most allocated above "
          "parameters, gradients and Adam in a forward and backward; pred: smp inspect -p 1 [--cp 2] (hand cp2 and "
          "eager 1 beside the same numbers); ms/step: median of rounds' medians, spread: their slowest / fastest; "
          "loss / grad err: the first step against the eager model on the whole sequence")
    print(f"torch.distributed.tensor.experimental.context_parallel on CPU: {torch_cp_on_cpu()}")
    print(f"after: {load_average()}; {time.perf_counter() - began:.0f} s")
    return table


if __name__ == "__main__":
    main()
