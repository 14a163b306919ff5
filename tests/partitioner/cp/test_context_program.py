"""One context-parallel rank's program (:mod:`partitioner.cp.context_program`) and its ops (:mod:`partitioner.cp.comm`):
the load-balanced tokens each rank holds, the rewrite of ``transformers``' Llama (ids cut, attention reading gathered
keys and values, a mask's rows, the group's cross-entropy; every activation at half the sequence), the errors, the
price of the gathers, and two spawned ranks of a plain module whose attention says ``is_causal=True`` computing what
one process computes."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from partitioner import trace
from partitioner.cost.devices import profile
from partitioner.cost.roofline import estimate
from partitioner.cp.comm import CPComm, cp_causal_mask, cp_cross_entropy, cp_gather
from partitioner.cp.context_program import context_parallel_graph, cp_degree
from smp.testing import run_ranks
from tests.smp.test_context_parallel import causal_lm


class PlainCausal(nn.Module):
    """A one-block causal LM as a user writes one: an embedding, one attention with ``is_causal=True``, a head."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.embed, self.qkv = nn.Embedding(vocab, dim), nn.Linear(dim, 3 * dim)
        self.out, self.head = nn.Linear(dim, dim), nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        return self.head(x + self.out(a))


def _ids(seed: int, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, 32, (2, seq), generator=torch.Generator().manual_seed(seed))


def test_each_rank_holds_an_early_and_a_late_chunk():
    two = [CPComm(2, r).positions(8).tolist() for r in range(2)]
    assert two == [[0, 1, 6, 7], [2, 3, 4, 5]]  # causal work balanced: 0+1+6+7 = 2+3+4+5 keys seen
    assert [CPComm(2, r).positions(6).tolist() for r in range(2)] == [[0, 1, 2], [3, 4, 5]]  # 6 is not 4 chunks
    with pytest.raises(ValueError, match="does not split over context_parallel_degree=4: pad"):
        CPComm(4, 0).positions(6)
    mask = cp_causal_mask(torch.zeros(1, 1, 4, 2), 8, CPComm(2, 0))
    assert torch.equal(mask, torch.ones(8, 8, dtype=torch.bool).tril()[[0, 1, 6, 7]])


def test_llama_runs_on_half_the_tokens_with_gathered_keys_and_values():
    model = causal_lm("llama")
    ids = _ids(0, 16)
    graph = trace(model, (ids,), {"labels": ids})
    half = context_parallel_graph(graph, 2, 1)
    assert cp_degree(half) == 2 and cp_degree(graph) == 1 and context_parallel_graph(graph, 1, 0) is graph
    ctx = half.fx.context
    assert (ctx.cp, ctx.sequence, ctx.attentions, ctx.notes) == (2, 16, 2, ())
    nodes = list(half.fx.module.graph.nodes)
    assert sum(n.target is cp_gather for n in nodes) == 2 * 2 + 1  # keys and values of each layer, the logits
    # gathered with their 2 key-value heads, repeated to the 4 query heads after (grouped-query attention)
    assert sorted(tuple(n.meta["val"].shape) for n in nodes if n.target is cp_gather)[:4] == [(2, 2, 16, 8)] * 4
    assert sum(n.target is cp_cross_entropy for n in nodes) == 1
    # every per-token activation is half the sequence; the ops and their FLOPs halve with it but attention's
    assert [tuple(n.meta["val"].shape) for n in nodes if n.name == "embedding"] == [(2, 8, 32)]
    # the mask is made of this rank's rows from the positions up: no value of the sequence squared is left whole
    squares = [n.name for n in nodes if tuple(getattr(n.meta.get("val"), "shape", ()))[-2:] == (16, 16)]
    assert squares == [] and any(n.name.endswith("_cp_rows") for n in nodes), squares
    assert half.flops.sum() < 0.6 * graph.flops.sum()
    assert half.act_bytes.sum() < 0.65 * graph.act_bytes.sum()
    rates = profile("h100-80gb")
    assert estimate(half, rates).tp_comm_s.sum() > 0 and estimate(graph, rates).tp_comm_s.sum() == 0


def test_what_cannot_be_split_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="does not split over context_parallel_degree=2: pad"):
        context_parallel_graph(trace(PlainCausal(), (_ids(0, 7),)), 2, 0)

    class NoEmbedding(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    with pytest.raises(ValueError, match="no embedding looks up the model's input ids"):
        context_parallel_graph(trace(NoEmbedding(), (torch.ones(2, 8),)), 2, 0)


def _run_plain(rank: int, world: int) -> dict:
    import torch.distributed as dist

    model, reference = PlainCausal(), PlainCausal()
    ids = _ids(3)
    graph = context_parallel_graph(trace(model, (ids,)), 2, rank)
    graph.fx.cp_comm.bind(dist.group.WORLD)
    out = graph.fx.module(ids)
    out.square().sum().backward()
    want = reference(ids)
    want.square().sum().backward()
    grads = {n: p.grad for n, p in graph.fx.module.named_parameters()}
    for g in grads.values():  # each rank's share of the gradients, as the data-parallel average sums them
        dist.all_reduce(g)
    return {"out": float((out - want).detach().abs().max()), "notes": graph.fx.context.notes,
            "grad": max(float((grads[n] / 2 - p.grad).abs().max()) for n, p in reference.named_parameters())}


def test_two_ranks_compute_what_one_process_computes_under_is_causal():
    for got in run_ranks(_run_plain, 2, timeout=120):
        assert got["out"] < 1e-5 and got["grad"] < 1e-5 and got["notes"] == (), got
