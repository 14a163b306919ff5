"""Sequence parallelism's activation memory per rank: tensor parallelism of degree 2 with it and without it,
measured in a training step, beside what ``smp inspect --tp 2`` (``--sequence-parallel``) predicts.

Models: a Llama-shaped and a GPT-2-shaped causal LM from ``transformers`` configs (random weights from seed 0,
nothing downloaded; ``--layers`` 2, ``--hidden`` 512 with 64-wide heads, Llama's MLP 2.75x and GPT-2's 4x wide,
vocabulary 2,000, ``attn_implementation="sdpa"``, no dropout), their loss in the model (``labels=``, only the loss
returned), fp32, Adam; one microbatch of ``--batch`` 2 sequences of ``--seq`` 1,024 tokens, long enough that the
activations are most of what a rank holds. Each model runs as tp2: one pipeline stage whose layers are split over 2
gloo ranks of this host (Megatron's pattern, :func:`smp.engine.planning.pipeline_runner` with ``tp_groups``), once
with ``sequence_parallel=False`` and once with ``True`` (Megatron's sequence parallelism,
:mod:`partitioner.tp.sequence`: the norms and residual adds between the tp regions run on half of the sequence on
each rank), in the same pair of processes, one thread each.

Measured per rank, after a first step (``Adam.step()`` included):

* ``saved``: the activations the step holds for backward: every distinct storage autograd saves in the step's
  forward, parameters and buffers left out (:func:`partitioner.capture.saved_activations.measure_saved_activations`
  around the runner's step; with one microbatch all of them are alive at once, at the end of the forward), the
  quantity ``smp inspect`` predicts;
* ``peak``: what a user sees: the most tracked tensor bytes allocated and not yet freed during one forward and
  backward above the parameters, gradients (kept allocated) and Adam state (torch's profiler,
  :func:`benchmarks.tensor_parallel.peak_allocated`): the saved activations plus the step's temporaries;
* ``whole`` / ``half``: how many of the saved storages are one microbatch's hidden states over the whole sequence
  (batch x sequence x hidden fp32) and over half of it: what sequence parallelism slices and what it keeps whole.

Predicted: ``activation_bytes`` of the one stage from ``smp inspect FILE:llama -p 1 --tp 2 [--sequence-parallel]
--estimate --json`` (its Python entry, :func:`smp.cli.entry.main`, on this file's factories), 1 microbatch in
flight: the bytes autograd keeps alive for backward per traced op (:mod:`partitioner.capture.autograd_saves`) on tp
rank 0's graph. ``pred/saved`` is their ratio (goal within 25 %), and per model the sp-on / sp-off ratio of each.

Run: ``python benchmarks/sequence_parallel.py [--models llama,gpt2] [--layers 2] [--hidden 512] [--seq 1024]
[--batch 2]``: about a minute and a half on two cores. The load average is printed before and after (memory does not
depend on it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import LossOnly, inspect_memory, load_average  # noqa: E402
from benchmarks.tensor_parallel import peak_allocated, quiet_stderr, state_tensors, storage_bytes  # noqa: E402
from smp.testing import run_ranks  # noqa: E402

__all__ = ["MODELS", "DIMS", "build", "llama", "gpt2", "measure", "predict", "main"]

MODELS = ("llama", "gpt2")
DIMS = {"layers": 2, "hidden": 512, "seq": 1024, "batch": 2}
VOCAB = 2000
MiB = 2 ** 20


def build(name: str, dims: dict[str, int]) -> tuple[torch.nn.Module, torch.Tensor]:
    """The ``name`` model (``llama`` or ``gpt2``) returning only its loss, and its batch of token ids."""
    import transformers

    hidden, layers, seq = dims["hidden"], dims["layers"], dims["seq"]
    torch.manual_seed(0)
    if name == "llama":
        model: torch.nn.Module = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
            num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, max_position_embeddings=seq,
            use_cache=False, attn_implementation="sdpa"))
    elif name == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=hidden // 64, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, use_cache=False,
            attn_implementation="sdpa"))
    else:
        raise ValueError(f"model {name!r}: choose from {', '.join(MODELS)}")
    ids = torch.randint(VOCAB, (dims["batch"], seq), generator=torch.Generator().manual_seed(0))
    return LossOnly(model), ids


def _factory(name: str) -> tuple:
    model, ids = build(name, {**DIMS, **json.loads(os.environ.get("SMP_BENCH_DIMS", "{}"))})
    return model, (ids, ids)


def llama() -> tuple:
    """``smp inspect`` factory: the Llama-shaped model and its microbatch (``SMP_BENCH_DIMS``: JSON of dims)."""
    return _factory("llama")


def gpt2() -> tuple:
    """``smp inspect`` factory: the GPT-2-shaped model and its microbatch (``SMP_BENCH_DIMS``: JSON of dims)."""
    return _factory("gpt2")


def _loss(out: torch.Tensor, _target: Any) -> torch.Tensor:
    return out


class _Step(torch.nn.Module):
    """One training step of ``runner`` as a module holding its stages (their parameters and buffers), for
    :func:`partitioner.capture.saved_activations.measure_saved_activations`."""

    def __init__(self, runner: Any):
        super().__init__()
        self.runner = runner
        self.stages = torch.nn.ModuleList([st.module for st in runner.local_stages])

    def forward(self, ids: torch.Tensor) -> Any:
        return self.runner.step((ids, ids), loss_fn=_loss, return_outputs=False)


def _rank(rank: int, world: int, name: str, dims: dict[str, int]) -> dict[bool, dict[str, Any]]:
    from partitioner.capture.saved_activations import measure_saved_activations
    from smp.engine.planning import pipeline_runner

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # torch's deprecation notices while tracing
    out: dict[bool, dict[str, Any]] = {}
    for sp in (False, True):
        model, ids = build(name, dims)
        runner = pipeline_runner(model, (ids, ids), pipelines=[[0], [1]], tp_groups=[[0, 1]], microbatches=1,
                                 schedule="1f1b", timeout_s=300, sequence_parallel=sp)
        params: list[torch.Tensor] = [p for p in runner.local_parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=1e-4)
        step = _Step(runner)
        t0 = time.perf_counter()
        loss = step(ids).loss
        opt.step()
        took = time.perf_counter() - t0
        opt.zero_grad(set_to_none=False)  # the gradients stay allocated: the peak is above them
        saved = measure_saved_activations(step, (ids,))
        opt.zero_grad(set_to_none=False)
        state = storage_bytes(state_tensors(params, opt))
        with quiet_stderr():  # the profiler's start and stop notices
            peak = peak_allocated(lambda step=step, ids=ids: step(ids))
        runner.close()
        hidden = dims["batch"] * dims["seq"] * dims["hidden"] * 4
        sizes = [nbytes for nbytes, _ in saved.storages]
        out[sp] = {"saved": saved.total_bytes, "peak": peak, "state": state, "loss": loss, "s": took,
                   "whole": sizes.count(hidden), "half": sizes.count(hidden // world)}
    return out


def measure(name: str, dims: dict[str, int]) -> list[dict[bool, dict[str, Any]]]:
    """Per rank of tp2, per ``sequence_parallel`` (False, True): ``saved``, ``peak`` and ``state`` bytes, the
    first step's ``loss`` and seconds ``s``, the ``whole``- and ``half``-sequence hidden states saved."""
    return run_ranks(_rank, 2, name, dims, timeout=900, pg_timeout=300)


def predict(name: str, dims: dict[str, int], sp: bool) -> int:
    """Activation bytes per rank that ``smp inspect --tp 2`` (``--sequence-parallel``) predicts for the model."""
    options = ["--tp", "2", *(["--sequence-parallel"] if sp else [])]
    return int(inspect_memory(f"{Path(__file__).resolve()}:{name}", options, dims)["activation_bytes"])


def main(argv: list[str] | None = None) -> dict[str, dict[bool, dict[str, float]]]:
    """Measure and predict every model, sp off and on; print the table; return its numbers per model and sp."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated, of llama,gpt2 (default both)")
    for key, value in DIMS.items():
        ap.add_argument(f"--{key}", type=int, default=value, help=f"default {value}")
    ns = ap.parse_args(argv)
    models = [m for m in ns.models.split(",") if m]
    if set(models) - set(MODELS) or not models:
        ap.error(f"--models {ns.models!r}: choose from {','.join(MODELS)}")
    if ns.hidden % 128 or ns.seq % 2:
        ap.error("--hidden must be a multiple of 128 (64-wide heads, an even number of them) and --seq even")
    dims = {key: getattr(ns, key) for key in DIMS}
    print(f"tp2 with and without sequence parallelism (2 gloo ranks, 1 thread each): {dims['layers']} layers, hidden "
          f"{dims['hidden']}, vocabulary {VOCAB:,}, 1 microbatch of {dims['batch']} x {dims['seq']} tokens, fp32, "
          f"Adam", flush=True)
    print(f"before: {load_average()}", flush=True)
    began = time.perf_counter()
    head = (f"{'model':<6} {'sp':<3} {'saved MiB':>9} {'peak MiB':>8} {'pred MiB':>8} {'pred/saved':>10} "
            f"{'whole':>5} {'half':>4} {'step s':>6}  loss")
    rows, table = [], {}
    for name in models:
        ranks = measure(name, dims)
        got: dict[bool, dict[str, float]] = {}
        for sp in (False, True):
            worst = max((r[sp] for r in ranks), key=lambda r: r["saved"])
            got[sp] = {"saved": worst["saved"], "peak": max(r[sp]["peak"] for r in ranks),
                       "pred": predict(name, dims, sp), "whole": worst["whole"], "half": worst["half"],
                       "s": max(r[sp]["s"] for r in ranks), "loss": worst["loss"]}
            g = got[sp]
            rows.append(f"{name:<6} {'on' if sp else 'off':<3} {g['saved'] / MiB:>9.2f} {g['peak'] / MiB:>8.2f} "
                        f"{g['pred'] / MiB:>8.2f} {g['pred'] / g['saved']:>10.3f} {g['whole']:>5} {g['half']:>4} "
                        f"{g['s']:>6.2f}  {g['loss']:.6f}")
        on, off = got[True], got[False]
        rows.append(f"{name:<6} on/off: saved {on['saved'] / off['saved']:.3f}, peak {on['peak'] / off['peak']:.3f}, "
                    f"predicted {on['pred'] / off['pred']:.3f}")
        table[name] = got
    print(head)
    print("-" * len(head))
    print("\n".join(rows))
    print("saved: activations held for backward per rank (the larger rank's); peak: the most allocated above "
          "parameters, gradients and Adam in a forward and backward; pred: smp inspect --tp 2 [--sequence-parallel]; "
          "whole / half: saved storages that are one microbatch's hidden states over the whole / half the sequence; "
          "step s: the first step, tracing excluded")
    print(f"after: {load_average()}; {time.perf_counter() - began:.0f} s")
    return table


if __name__ == "__main__":
    main()
