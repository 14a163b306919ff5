"""Megatron's pattern found on traced graphs, process-free: what splits, along which dimension, what stays whole
and why; and the graph each tp rank runs from it."""
from __future__ import annotations

import warnings

import pytest
import torch

from partitioner import trace
from partitioner.capture.chunk import split_columns
from partitioner.tp.shard_program import ReplicatedWarning, local_length, shard_graph, tensor_parallel_graph
from partitioner.tp.sharding import Shard, find_sharding
from tests.smp.test_tp_training import VOCAB, build


def _graph(kind: str):
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace(build(kind), (ids,), {"labels": ids})


def test_gpt2_fused_qkv_is_split_by_heads_block_by_block_and_the_tied_vocabulary_by_rows():
    sh = find_sharding(_graph("gpt2").fx.module, 2)
    assert sh.params["transformer.h.0.attn.c_attn.weight"] == Shard(1, 192, 3)  # q|k|v, each by heads
    assert sh.params["transformer.h.0.attn.c_proj.weight"] == Shard(0, 64)       # row-parallel (Conv1D is in x out)
    assert sh.params["lm_head.weight"] == Shard(0, VOCAB)                         # tied embedding and head
    assert "transformer.h.0.attn.c_proj.bias" not in sh.params                   # added once, after the all-reduce
    assert sorted(set(sh.roles.values())) == ["column", "embedding", "loss", "row"] and not sh.replicated


def test_llama_grouped_query_attention_splits_its_kv_heads_when_they_divide():
    sh = find_sharding(_graph("llama").fx.module, 2)
    assert sh.params["model.layers.0.self_attn.k_proj.weight"] == Shard(0, 32)  # 2 kv heads of 16
    assert sh.params["model.layers.0.mlp.down_proj.weight"] == Shard(1, 128)
    assert not sh.replicated


def test_kv_heads_fewer_than_tp_stay_whole_and_each_rank_reads_its_repeated_heads():
    sh = find_sharding(_graph("llama").fx.module, 4)  # 4 q heads, 2 kv heads
    assert sh.params["model.layers.0.self_attn.q_proj.weight"] == Shard(0, 64)
    assert "model.layers.0.self_attn.k_proj.weight" not in sh.params
    sliced = [name for inputs in sh.scatters.values() for name, dim, size in inputs if dim == 1 and size == 4]
    assert len(sliced) == 4  # k and v of both layers, after repeat_kv


@pytest.mark.parametrize("kind", ["gptj", "gptneo", "bert"])
def test_other_families_match_the_pattern_with_no_model_code_changed(kind):
    sh = find_sharding(_graph(kind).fx.module, 2)
    assert {"column", "row", "embedding", "loss"} <= set(sh.roles.values())
    # BERT's prediction transform (dense, then a norm over its features) is the only layer left whole.
    assert all("layer_norm" in why for why in sh.replicated.values()) and len(sh.replicated) <= 1


def test_what_cannot_be_split_stays_whole_with_a_warning_that_names_it():
    graph = _graph("gpt2")
    with pytest.warns(ReplicatedWarning, match="addmm.*split") as seen:
        local = tensor_parallel_graph(graph, 3, 0)  # 4 heads, 256 MLP columns: nothing of a block divides by 3
    assert "c_attn" not in str(local.fx.sharding.params) and local.fx.sharding.params  # the vocabulary still splits
    assert "whole on every tp rank" in str(seen[0].message)


def test_every_rank_writes_the_same_nodes_and_holds_shards_of_its_own():
    graph = _graph("llama")
    sh = find_sharding(graph.fx.module, 2)
    ranks = [shard_graph(graph, sh, r) for r in range(2)]
    assert ranks[0].names == ranks[1].names
    full = graph.fx.module.get_parameter("model.layers.0.self_attn.q_proj.weight")
    for r, local in enumerate(ranks):
        w = local.fx.module.get_parameter("model.layers.0.self_attn.q_proj.weight")
        assert w.shape == (32, 64) and w.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
        assert torch.equal(w, full[32 * r:32 * (r + 1)])
    head = [local.fx.module.get_parameter("lm_head.weight").shape[0] for local in ranks]
    assert head == [local_length(Shard(0, VOCAB), 2, r) for r in range(2)] == [51, 50]
    assert sum(ranks[0].flops) < 0.7 * sum(graph.flops)  # each rank prices its share of the matmuls


def test_dropout_in_a_sharded_graph_draws_from_the_engines_streams():
    import transformers as T

    from partitioner.tp.collectives import tp_attention, tp_dropout
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32,
                                           bos_token_id=0, eos_token_id=0)).train()  # dropout 0.1 everywhere
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        local = tensor_parallel_graph(trace(model, (ids,), {"labels": ids}), 2, 0)
    calls = [n for n in local.fx.module.graph.nodes if n.op == "call_function"]
    assert not [n for n in calls if "dropout" in str(n.target) and n.target is not tp_dropout]
    drops = [n.args[3] for n in calls if n.target is tp_dropout]
    attention = [n.kwargs["sharded"] for n in calls if n.target is tp_attention]
    assert drops and not any(drops)  # residual-stream dropouts act on whole activations: one mask for all ranks
    assert attention == [True]        # attention dropout acts on this rank's heads: masks of its own


def test_no_stage_cut_falls_between_a_row_parallel_matmul_and_its_all_reduce():
    from partitioner.tp.collectives import reduce_from
    local = tensor_parallel_graph(_graph("llama"), 2, 0)
    prog = local.fx
    for node in prog.module.graph.nodes:
        if node.target is reduce_from and node.args[0].op == "call_function":
            assert prog.op_of[node.name] == prog.op_of[node.args[0].name], node.name  # one op: placed together


def test_writing_a_ranks_graph_warns_nothing_the_user_cannot_act_on():
    """A tp run printed torch's ``LeafSpec`` FutureWarning: copying an exported graph rebuilds torch's own pytree
    specs. Writing a rank's graph, and cutting a linear into column chunks, must be silent."""
    graph = _graph("llama")
    sh = find_sharding(graph.fx.module, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        local = shard_graph(graph, sh, 0)
        linear = next(n.name for n in local.fx.module.graph.nodes if n.target == torch.ops.aten.linear.default)
        assert split_columns(local, {linear: 2}).num_nodes > local.num_nodes
