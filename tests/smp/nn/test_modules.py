"""``smp.nn``'s distributed modules: SMP v1's constructors (positional order, keywords, refusals) and, split over
two tensor-parallel ranks by ``smp.DistributedModel``, the same forward and backward as in one process."""
from __future__ import annotations

import warnings

import pytest
import torch

import smp
from smp.nn import (
    DistributedAttentionLayer,
    DistributedEmbedding,
    DistributedLinear,
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerLMHead,
    DistributedTransformerOutputLayer,
)
from smp.testing import run_ranks
from tests.smp.features import shard_grad_error


class Composite(torch.nn.Module):
    """Every distributed module in one model: embedding, a transformer, a lone layer, attention and output
    blocks, a linear head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        common = dict(num_attention_heads=4, attention_head_size=8, hidden_size=32, attention_dropout_prob=0.0,
                      hidden_dropout_prob=0.0)
        self.embed = DistributedEmbedding(50, 32)
        self.stack = DistributedTransformer(num_layers=2, intermediate_size=64, **common)
        self.layer = DistributedTransformerLayer(intermediate_size=64, pre_layernorm=True, post_layernorm=False,
                                                 causal_mask_size=16, **common)
        self.attention = DistributedAttentionLayer(**common)
        self.ffn = DistributedTransformerOutputLayer(hidden_size=32, intermediate_size=64, hidden_dropout_prob=0.0,
                                                     activation="relu")
        self.head = DistributedLinear(32, 50)

    def forward(self, ids):
        hidden, mask = self.stack((self.embed(ids), None))
        hidden, _ = self.layer((hidden, mask))
        return self.head(self.ffn(self.attention((hidden, None))))


def _run(rank: int, world: int) -> dict:
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(1))
    ref = Composite()
    loss_of = torch.nn.functional.cross_entropy
    want = loss_of(ref(ids).flatten(0, 1), ids.flatten())
    want.backward()
    smp.init({"pipeline_parallel_degree": 1, "tensor_parallel_degree": world, "ddp": True, "microbatches": 1})
    model = smp.DistributedModel(Composite())

    @smp.step
    def step(model, x):
        loss = loss_of(model(x).flatten(0, 1), x.flatten())
        model.backward(loss)
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = float(step(model, ids).reduce_mean())
    worst, split = shard_grad_error(model, {n: p.grad for n, p in ref.named_parameters()})
    state = model.state_dict()  # the shards gathered
    return {"loss": loss, "want": float(want), "worst": worst, "split": split,
            "weights": max(float((state[n] - p).abs().max()) for n, p in ref.named_parameters()),
            "query": tuple(model.module.stack.seq_layers[0].attention.query.weight.shape)}


def test_every_module_split_over_two_ranks_computes_what_one_process_does():
    for r in run_ranks(_run, 2, timeout=240):
        assert abs(r["loss"] - r["want"]) < 1e-5, r
        assert r["weights"] == 0.0 and r["worst"] < 1e-5, r
        assert r["split"] >= 10 and r["query"] == (16, 32), r  # each rank holds its half of the heads


def test_constructors_take_smps_positional_order_and_keywords():
    lm = DistributedTransformerLMHead(2, 4, 8, 32, 64, 100, 16)  # num_layers ... num_positions, in SMP's order
    assert (lm.config.num_layers, lm.config.vocab_size, lm.config.num_positions) == (2, 100, 16)
    assert lm.lm_head.weight is lm.word_embedding.weight  # tied, as in SMP
    untied = DistributedTransformerLMHead(1, 2, 8, 16, 32, 40, 8, tie_input_output_embedding=False,
                                          final_layernorm=True)
    assert untied.lm_head.weight is not untied.word_embedding.weight and hasattr(untied, "layernorm")
    assert DistributedLinear(6, 4).weight.shape == (4, 6)  # global sizes
    assert DistributedEmbedding(10, 4, padding_idx=0).weight[0].abs().sum() == 0
    layer = DistributedTransformerLayer(4, 8, 32, 64, pre_layernorm=True, post_layernorm=False)
    assert hasattr(layer.attention, "pre_layernorm") and not hasattr(layer.output, "layernorm")


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(TypeError, match="did you mean 'num_attention_heads'"):
        DistributedTransformer(num_atention_heads=4)
    with pytest.raises(TypeError, match="both by position and by keyword"):
        DistributedTransformerOutputLayer(32, hidden_size=32)
    with pytest.raises(ValueError, match="at least one of pre_layernorm"):
        DistributedTransformerLayer(post_layernorm=False)
    with pytest.raises(ValueError, match="activation='swish'"):
        DistributedTransformerOutputLayer(activation="swish")
    with pytest.raises(ValueError, match="cross attention"):
        DistributedTransformerLMHead(add_cross_attention=True)
    with pytest.raises(ValueError, match="max_norm"):
        DistributedEmbedding(10, 4, max_norm=1.0)
