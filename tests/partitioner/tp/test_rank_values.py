"""``partitioner.tp.rank_values``: tp rank 0's graph holds its values as its run will, so the memory model prices them
as autograd holds them: a view of a sharded value stays a view of it (one storage), and a new value keeps the traced
layout (the CPU attention kernel's token-major output under a head-major shape), so the reshape before the
out-projection is a view of the attention's output, not a second copy of it."""
from __future__ import annotations

import warnings

import torch

from partitioner import trace
from partitioner.capture.autograd_saves import saved_bytes
from partitioner.tp.rank_values import dense_stride, laid_out
from partitioner.tp.rank_zero import rank_zero_graph

VOCAB, HEADS, HEAD = 64, 4, 16


def _llama() -> torch.nn.Module:
    import transformers as T
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=1, hidden_size=HEADS * HEAD, intermediate_size=128,
                                            num_attention_heads=HEADS, num_key_value_heads=HEADS, vocab_size=VOCAB,
                                            attn_implementation="sdpa"))


def _node(gm: torch.fx.GraphModule, name: str) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def test_the_attention_output_keeps_its_layout_and_the_out_projection_reads_a_view_of_it() -> None:
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(_llama(), (ids,), {"labels": ids})
        local, _ = rank_zero_graph(graph, 2)
    traced, gm = graph.fx.module, local.fx.module
    attention = _node(gm, "scaled_dot_product_attention")
    out_proj = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default
                    and n.meta.get("nn_module_stack") and "o_proj" in str(list(n.meta["nn_module_stack"].values())[-1]))
    before, after = _node(traced, attention.name).meta["val"], attention.meta["val"]
    assert after.shape[1] == before.shape[1] // 2  # rank 0's heads
    order = sorted(range(4), key=lambda d: -before.stride()[d])
    assert order != [0, 1, 2, 3] and sorted(range(4), key=lambda d: -after.stride()[d]) == order, \
        (before.stride(), after.stride())
    read = out_proj.args[0].meta["val"]
    assert read.untyped_storage()._cdata == after.untyped_storage()._cdata  # a view, as at run time
    saves = saved_bytes(gm).by_node
    assert out_proj.name not in saves, saves  # the attention's output, already kept by the attention, counts once


def test_a_new_value_is_laid_out_as_the_traced_one_where_that_is_dense() -> None:
    token_major = torch.empty(2, 8, 4, 16).transpose(1, 2)  # (batch, heads, tokens, head) over token-major memory
    assert dense_stride(token_major, [2, 2, 8, 16]) == (256, 16, 32, 1)
    assert laid_out(token_major, [2, 2, 8, 16]).transpose(1, 2).is_contiguous()
    assert dense_stride(torch.empty(2, 8), [2, 4]) is None  # contiguous stays contiguous
    assert dense_stride(torch.empty(2, 1).expand(2, 8), [1, 8]) is None  # not dense: contiguous
