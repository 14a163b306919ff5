"""Helpers shared by the multi-process benchmarks."""
from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["load_average", "pin", "llama_on_meta", "LossOnly"]


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
