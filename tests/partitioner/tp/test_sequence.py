"""Megatron's sequence parallelism found on traced graphs, process-free: where the tokens are, which collectives the
whole regions get, what a rank then holds and pays, and where it refuses."""
from __future__ import annotations

import warnings

import pytest
import torch

from partitioner import trace
from partitioner.cost.roofline import needs_grad
from partitioner.tp.collectives import copy_to, reduce_from, seq_gather, seq_gather_whole, seq_reduce_scatter
from partitioner.tp.pricing import collectives
from partitioner.tp.sequence import SequenceParallelWarning, token_layout, view_tokens
from partitioner.tp.shard_program import tensor_parallel_graph
from tests.smp.test_tp_training import VOCAB, build


def _graphs(kind: str, seq: int = 8) -> tuple:
    graph = trace_of(kind, seq)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tensor_parallel_graph(graph, 2, 0), tensor_parallel_graph(graph, 2, 0, sequence=True)


def trace_of(kind: str, seq: int = 8):
    """The traced model ``kind`` on 2 sequences of ``seq`` tokens (seed 0), its loss included."""
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace(build(kind), (ids,), {"labels": ids})


def _targets(graph) -> list:
    return [n.target for n in graph.fx.module.graph.nodes if n.op == "call_function"]


def test_tokens_are_found_batch_major_and_followed_through_views():
    assert token_layout((2, 8, 64), 2, 8) == (1, 1, 1)
    assert token_layout((16, 64), 2, 8) == (0, 2, 1)       # GPT-2's rows: batch x sequence
    assert token_layout((1, 8, 64), 2, 8) is None          # a position table broadcast over the batch
    assert view_tokens([2, 8, 64], (1, 1, 1), [16, 64]) == (0, 2, 1)
    assert view_tokens([16, 64], (0, 2, 1), [2, 8, 64]) == (1, 1, 1)
    assert view_tokens([2, 8, 64], (1, 1, 1), [2, 8, 4, 16]) == (1, 1, 1)
    assert view_tokens([2, 8, 64], (1, 1, 1), [2, 4, 128]) is None  # the view splits the sequence


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_whole_regions_run_on_half_the_sequence(kind):
    tp, sp = _graphs(kind)
    assert sp.fx.sharding.sequence and not tp.fx.sharding.sequence
    assert reduce_from not in _targets(sp) and _targets(sp).count(seq_reduce_scatter) == 4  # g of 2 blocks
    assert _targets(sp).count(seq_gather) == 5  # f before 4 column-parallel regions and the vocabulary head
    assert seq_gather_whole not in _targets(sp)  # nothing reads the sequence whole
    norms = [n for n in sp.fx.module.graph.nodes if n.name.startswith(("layer_norm", "rsqrt"))]
    assert norms and all(n.meta["val"].shape[1] == 4 for n in norms)  # 8 positions, 4 on each rank
    # Every weight a sliced region reads whole (norms, biases after g) leaves its gradient a partial sum on each rank,
    # summed once per step by the runtime; without that runtime (defer_weights=False) it sums through f every time.
    deferred = set(sp.fx.sharding.deferred)
    assert deferred and all("norm" in t or "ln" in t or "proj.bias" in t for t in deferred)
    assert not [n for n in sp.fx.module.graph.nodes if n.target is copy_to and n.args[0].op == "get_attr"]
    every = tensor_parallel_graph(trace_of(kind), 2, 0, sequence=True, defer_weights=False)
    copied = {n.args[0].target for n in every.fx.module.graph.nodes if n.target is copy_to
              and n.args[0].op == "get_attr"}
    assert copied == deferred and not every.fx.sharding.deferred
    assert sp.act_bytes.sum() < tp.act_bytes.sum()


def test_the_collectives_move_an_all_reduces_bytes():
    tp, sp = _graphs("llama")
    before = {c.node: c for c in collectives(tp, needs_grad=needs_grad(tp))}
    after = [c for c in collectives(sp, needs_grad=needs_grad(sp)) if c.kind == "reduce_scatter" and not c.backward]
    assert len(after) == 5  # g of 2 blocks, and the embedding's sum
    for c in after:
        assert c.nbytes == before[c.node].nbytes and before[c.node].kind == "all_reduce"
    backward = {(c.node, c.kind) for c in collectives(sp, needs_grad=needs_grad(sp)) if c.backward}
    assert {(c.node, "all_gather") for c in after} <= backward  # g's backward gathers the gradient


def test_a_sequence_that_does_not_divide_leaves_the_program_as_tensor_parallelism_writes_it():
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(build("llama"), (ids,), {"labels": ids})
    with pytest.warns(SequenceParallelWarning, match="sequence length 7 does not divide by tensor_parallel_degree 2"):
        local = tensor_parallel_graph(graph, 2, 0, sequence=True)
    assert not local.fx.sharding.sequence and reduce_from in _targets(local)


class _Mixing(torch.nn.Module):
    """A block whose whole region takes a running sum over the positions: each rank cannot run it on a slice."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        self.up2, self.down2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.down(torch.relu(self.up(h)))
        h = h.cumsum(1)
        return h + self.down2(torch.relu(self.up2(h)))


def test_an_op_that_mixes_positions_reads_the_gathered_sequence_with_a_note():
    graph = trace(_Mixing(), (torch.zeros(2, 4, dtype=torch.long),))
    with pytest.warns(SequenceParallelWarning, match=r"cumsum.*reads the whole sequence"):
        local = tensor_parallel_graph(graph, 2, 0, sequence=True)
    cumsum = next(n for n in local.fx.module.graph.nodes if n.name.startswith("cumsum"))
    assert cumsum.args[0].target is seq_gather_whole and local.fx.sharding.sequence
