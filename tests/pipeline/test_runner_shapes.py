"""Variable input shapes with one plan (pipeline.shape_classes): a pipelined training run whose batches change
sequence length from step to step and end with a short batch equals a single-process run of the same model —
losses, gradients and final weights — for tiny GPT-2 and Llama models from ``transformers`` on 2 ranks; an evicted
shape class is traced again and stays exact; a runner that cannot trace new shapes says so."""
from __future__ import annotations

import warnings

import pytest
import torch

from smp.testing import run_ranks

VOCAB = 101
# (batch, sequence length) of each step: three sequence lengths, a class seen again, and a short last batch whose
# microbatches hold one sample (a trace with a few other ops: torch elides an expand and a contiguous there).
BATCHES = [(4, 8), (4, 6), (4, 12), (4, 8), (2, 12)]


def build(kind: str) -> torch.nn.Module:
    """A tiny ``kind`` ("gpt2" or "llama") language model with fixed random weights and no dropout."""
    import transformers as T
    torch.manual_seed(0)
    if kind == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                              eos_token_id=0))
    return T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                            bos_token_id=0, eos_token_id=0))


def batches(shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Token ids of each step, from a fixed generator."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, shape, generator=g) for shape in shapes]


def reference(kind: str, data: list[torch.Tensor], m: int, lr: float) -> tuple[list[float], list[dict], dict]:
    """Single process: per step the mean microbatch loss, the gradients, then an SGD step; the final weights."""
    model = build(kind)
    losses, grads = [], []
    for ids in data:
        model.zero_grad(set_to_none=True)
        step = 0.0
        for part in ids.chunk(m):
            loss = model(part, labels=part).loss
            (loss / m).backward()
            step += float(loss.detach()) / m
        losses.append(step)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _loss(out, _target):
    return out.loss


def _train(rank: int, world: int, kind: str, shapes: list[tuple[int, int]], cache: int) -> dict:
    from smp.engine.planning import pipeline_runner
    m, lr = 2, 0.1
    data = batches(shapes)
    model = build(kind)
    first = data[0][: data[0].shape[0] // m]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner = pipeline_runner(model, (first,), {"labels": first}, microbatches=m, timeout_s=60,
                                 shape_cache_size=cache)
    names = {id(p): n for n, p in model.named_parameters()}
    losses, grads = [], []
    for ids in data:
        for p in runner.local_parameters():
            p.grad = None
        losses.append(runner.step((ids,), {"labels": ids}, loss_fn=_loss).loss)
        grads.append({names[id(p)]: p.grad.clone() for p in runner.local_parameters()})
        with torch.no_grad():
            for p in runner.local_parameters():
                p -= lr * p.grad
    weights = {names[id(p)]: p.detach().clone() for p in runner.local_parameters()}
    cached = runner.shapes
    return {"losses": losses, "grads": grads, "weights": weights,
            "cache": (len(cached.sets), cached.hits, cached.misses, cached.evictions)}


def _check(kind: str, shapes: list[tuple[int, int]], cache: int) -> list[dict]:
    got = run_ranks(_train, 2, kind, shapes, cache, timeout=240)
    want_losses, want_grads, want_weights = reference(kind, batches(shapes), 2, 0.1)
    for out in got:
        assert torch.allclose(torch.tensor(out["losses"]), torch.tensor(want_losses), rtol=1e-5), \
            (out["losses"], want_losses)
        for step, (g, w) in enumerate(zip(out["grads"], want_grads)):
            for n, t in g.items():
                assert torch.allclose(t, w[n], rtol=1e-4, atol=1e-6), f"{kind} step {step}: grad of {n}"
        for n, t in out["weights"].items():
            assert torch.allclose(t, want_weights[n], rtol=1e-4, atol=1e-6), f"{kind}: final {n}"
    held = set().union(*(out["weights"] for out in got))
    assert held == set(want_weights), "every parameter is trained on some rank"
    return got


def test_gpt2_three_lengths_and_a_short_batch_with_evictions_is_exact():
    """A cache of two classes: the traced class is evicted and traced again when it comes back."""
    got = _check("gpt2", BATCHES, cache=2)
    # 8 (traced) hit | 6 miss | 12 miss, evicts 8 | 8 miss, evicts 6 | (2, 12) miss, evicts 12
    assert all(out["cache"] == (2, 1, 4, 3) for out in got), [out["cache"] for out in got]


@pytest.mark.slow  # the GPT-2 run is the default run's
def test_llama_three_lengths_and_a_short_batch_is_exact():
    got = _check("llama", BATCHES, cache=8)
    assert all(out["cache"] == (4, 2, 3, 0) for out in got), [out["cache"] for out in got]
