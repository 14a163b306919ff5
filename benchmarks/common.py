"""Helpers shared by the multi-process benchmarks."""
from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["load_average", "pin", "llama_on_meta", "LossOnly", "inspect_memory"]


class LossOnly(torch.nn.Module):
    """A Hugging Face causal LM that returns only its loss (its logits are not an output, so a tp rank never
    gathers them)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=labels, use_cache=False).loss


def llama_on_meta(dims: tuple[int, int, int, int, int, int], seq: int) -> tuple[Any, tuple]:
    """A Llama-shaped causal LM on the meta device (no weights) and one sequence of ``seq`` token ids; ``dims``:
    (layers, hidden, intermediate, attention heads, key/value heads, vocabulary)."""
    import torch
    import transformers

    layers, hidden, inter, heads, kv, vocab = dims
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter,
                                   num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                   max_position_embeddings=seq, use_cache=False)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg), (torch.zeros(1, seq, dtype=torch.long),)


def pin(rank: int, cfg: dict) -> None:
    """Every thread of this process (main, gloo's) onto core ``rank % cores`` when ``cfg["pin"]``: otherwise,
    on a busy host, Linux's affine wake-ups tend to stack two communicating ranks on one core."""
    if not cfg.get("pin") or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    core = {cores[rank % len(cores)]}
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), core)
        except OSError:
            pass


def load_average() -> str:
    """The host's load, printed before and after a run: a busy machine explains noisy timings."""
    try:
        return "load average " + " ".join(f"{v:.2f}" for v in os.getloadavg()) + f" on {os.cpu_count()} cores"
    except OSError:
        return "load average unavailable"


def inspect_memory(factory: str, options: list[str], dims: dict[str, int]) -> dict[str, Any]:
    """The one stage's ``memory`` record of ``smp inspect FACTORY --partitions 1 OPTIONS --estimate --json`` (its
    Python entry, :func:`smp.cli.entry.main`), with ``dims`` in ``SMP_BENCH_DIMS`` (JSON) for the factory."""
    from smp.cli.entry import main as smp

    saved = os.environ.get("SMP_BENCH_DIMS")
    os.environ["SMP_BENCH_DIMS"] = json.dumps(dims)
    try:
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
            out = Path(tmp) / "plan.json"
            argv = ["inspect", factory, "--partitions", "1", *options, "--estimate", "--json", str(out), "-q"]
            if smp(argv):
                raise RuntimeError(f"smp {' '.join(argv)} failed")
            return dict(json.loads(out.read_text())["memory"][0])
    finally:
        if saved is None:
            os.environ.pop("SMP_BENCH_DIMS")
        else:
            os.environ["SMP_BENCH_DIMS"] = saved
