"""``partitioner.tp.pricing``: every tensor-parallel collective of a sharded graph is found in the op that carries it
and priced as a ring all-reduce or all-gather on the intra-node link; a plan records the degree, the seconds per
stage and the sharding, and binds only to a graph sharded for the same degree."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import partitioner
from partitioner import DeviceRates, estimate
from partitioner.capture.flops import TP_EQUIVALENT
from partitioner.cost.collectives import all_gather_s, all_reduce_s, gradient_all_reduce_s
from partitioner.cost.roofline import needs_grad
from partitioner.tp.collectives import vocab_cross_entropy, vocab_embedding
from partitioner.tp.pricing import collective_seconds, collectives, degree_mismatch, tensor_parallel_record, tp_degree
from partitioner.tp.shard_program import shard_graph
from partitioner.tp.sharding import find_sharding

TOKENS, HIDDEN, VOCAB = 2 * 16, 64, 256
LINK = DeviceRates(link_bytes_per_s=1e9, link_latency_s=1e-6)


def gpt2(labels: bool = True) -> partitioner.OpGraph:
    """A 2-layer GPT-2 traced with its loss (``labels=``): every kind of tp collective appears once sharded."""
    import transformers as T

    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=2, n_embd=HIDDEN, n_head=4, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    ids = torch.zeros(2, 16, dtype=torch.long)
    return partitioner.trace(T.GPT2LMHeadModel(cfg), (ids,), {"labels": ids} if labels else {})


@pytest.fixture(scope="module")
def graphs() -> tuple[partitioner.OpGraph, partitioner.OpGraph]:
    whole = gpt2()
    return whole, shard_graph(whole, find_sharding(whole.fx.module, 2), 0)


def test_ring_collectives_cost_their_share_of_the_bytes_plus_a_latency_per_step() -> None:
    assert all_reduce_s(8e6, 4, LINK) == pytest.approx(2 * 3 / 4 * 8e6 / 1e9 + 2 * 3 * 1e-6)
    assert all_gather_s(8e6, 4, LINK) == pytest.approx(3 / 4 * 8e6 / 1e9 + 3 * 1e-6)
    assert all_reduce_s(8e6, 1, LINK) == all_gather_s(8e6, 1, LINK) == all_reduce_s(0, 8, LINK) == 0.0
    # the bandwidth term approaches 2B (all-reduce) and B (all-gather) per rank as the group grows
    assert all_reduce_s(8e6, 64, LINK) < 2 * 8e6 / 1e9 + 2 * 63 * 1e-6


def test_a_collective_pays_the_runtimes_cost_once_and_the_gradient_average_its_copies() -> None:
    import dataclasses

    gloo = dataclasses.replace(LINK, collective_overhead_s=1.5e-3)  # a cpu profile's: gloo's wake-ups, skew
    assert all_reduce_s(8e6, 4, gloo) == pytest.approx(all_reduce_s(8e6, 4, LINK) + 1.5e-3)
    assert all_gather_s(8e6, 4, gloo) == pytest.approx(all_gather_s(8e6, 4, LINK) + 1.5e-3)
    assert all_reduce_s(8e6, 1, gloo) == all_gather_s(0, 4, gloo) == 0.0  # no collective, no cost
    # smp's data-parallel average: flatten into a new buffer, all-reduce, divide, copy back
    mem = DeviceRates(bytes_per_s=2e10, memory_efficiency=0.5, grad_bytes_per_s=4e9)
    assert gradient_all_reduce_s(8e6, 2, mem, gloo) == pytest.approx(all_reduce_s(8e6, 2, gloo) + 8e6 / 4e9
                                                                     + 5 * 8e6 / 1e10)
    assert gradient_all_reduce_s(8e6, 1, mem, gloo) == 0.0


def test_every_collective_is_found_in_the_op_that_carries_it(graphs) -> None:
    whole, local = graphs
    assert (tp_degree(whole), tp_degree(local)) == (1, 2) and collectives(whole) == []
    sh = local.fx.sharding
    found = collectives(local, "fp32", needs_grad(local))
    rows = [r for r in sh.roles.values() if r == "row"]
    forward_reduces = [c for c in found if c.kind == "all_reduce" and not c.backward and c.count == 1]
    assert len(forward_reduces) == len(rows) + 1  # g after each row-parallel matmul, and the vocabulary embedding
    assert all(c.nbytes == TOKENS * HIDDEN * 4 for c in forward_reduces)
    loss = [c for c in found if c.count == 3]
    assert len(loss) == 1 and loss[0].nbytes == TOKENS * 4  # one fp32 number per token, three times
    gathers = [c for c in found if c.kind == "all_gather"]
    assert [c.nbytes for c in gathers] == [TOKENS * VOCAB * 4]  # the logits, returned beside the loss, gathered
    backward = [c for c in found if c.backward]
    assert backward and all(c.nbytes == TOKENS * HIDDEN * 4 for c in backward)
    # f on a value without a gradient (an attention mask) all-reduces nothing
    assert not [c for c in collectives(local, "fp32", np.zeros(local.num_nodes, bool)) if c.backward]
    for c in found:
        assert local.fx.op_of[c.node] == c.op
    assert collectives(local, "bf16", needs_grad(local))[0].nbytes == found[0].nbytes / 2  # 16-bit activations


def test_estimate_adds_the_collectives_to_forward_and_backward(graphs) -> None:
    whole, local = graphs
    rates = DeviceRates().with_links("nvlink4")
    plain = estimate(whole, rates)
    assert plain.tp_forward_s is None and not plain.tp_comm_s.any()
    costs = estimate(local, rates)
    fwd, bwd = collective_seconds(local, rates, "fp32", needs_grad(local))
    np.testing.assert_array_equal(costs.tp_forward_s, fwd)
    np.testing.assert_array_equal(costs.tp_backward_s, bwd)
    sharding, local.fx.sharding = local.fx.sharding, None  # the same ops without the collectives
    try:
        compute = estimate(local, rates)
    finally:
        local.fx.sharding = sharding
    np.testing.assert_allclose(costs.forward_s, compute.forward_s + fwd)
    np.testing.assert_allclose(costs.backward_s, compute.backward_s + bwd)
    assert fwd.sum() > 0 and bwd.sum() > 0
    slow = estimate(local, DeviceRates().with_links("pcie4"))
    assert slow.tp_comm_s.sum() > costs.tp_comm_s.sum()  # the link matters


def test_tp_ops_cost_what_the_ops_they_replace_cost_on_a_shard(graphs) -> None:
    _, local = graphs
    assert set(TP_EQUIVALENT) >= {vocab_embedding.__name__, vocab_cross_entropy.__name__, "tp_dropout"}
    emb = local.names.index("embedding")
    assert local.flops[emb] == 0.0 and local.move_bytes[emb] == 2 * TOKENS * HIDDEN * 4  # rows read, rows written


def test_the_plan_records_the_degree_the_seconds_and_the_sharding(graphs) -> None:
    whole, local = graphs
    plan = partitioner.partition(local, 2, rates=DeviceRates().with_links("nvlink4"), microbatches=2)
    tp = plan.tensor_parallel
    assert tp["degree"] == 2 and set(tp["sharding"]) == {"params", "roles", "replicated", "sequence"}
    costs = estimate(local, DeviceRates().with_links("nvlink4"))
    assert sum(tp["comm_s"]) == pytest.approx(costs.tp_comm_s.sum())
    for s, comm in zip(plan.stages, tp["comm_s"]):
        assert s.forward_s + s.backward_s >= comm  # inside the stage's compute
    assert tensor_parallel_record(whole, np.zeros(whole.num_nodes, np.int64), 1, np.zeros(whole.num_nodes)) == {}
    assert "tensor_parallel" not in partitioner.partition(whole, 2).to_dict()
    assert degree_mismatch(tp, local) is None and degree_mismatch({}, whole) is None
    assert "degree 2 but the graph is not sharded" in degree_mismatch(tp, whole)
    assert "without tensor parallelism" in degree_mismatch({}, local)



def test_measuring_a_sharded_graph_in_one_process_is_refused(graphs) -> None:
    _, local = graphs
    with pytest.raises(ValueError, match=r"measure=True times every op in this process, but the graph is sharded for "
                                         r"tensor parallelism of degree 2"):
        partitioner.partition(local, 2, measure=True)
