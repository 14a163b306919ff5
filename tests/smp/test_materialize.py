"""A rank holds only its share (smp/materialize.py): weightless models materialise just the named tensors,
initialised the way their modules say, the same on every rank and without touching the user's random
streams; materialised models release the rest."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from smp.delayed_init import delay_param_initialization
from smp.engine.materialize import MaterializeError, has_meta, materialize, release
from smp.testing import run_ranks


def _config() -> LlamaConfig:
    return LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=32, use_cache=False)


def test_delayed_models_have_meta_parameters_and_real_buffers():
    with delay_param_initialization():
        model = LlamaForCausalLM(_config())
        plain = torch.nn.Linear(4, 4)
    assert all(p.is_meta for p in model.parameters()) and plain.weight.is_meta
    assert not model.model.rotary_emb.inv_freq.is_meta  # small, computed at construction: kept
    with delay_param_initialization(enabled=False):
        assert not torch.nn.Linear(2, 2).weight.is_meta
    assert not torch.nn.Linear(2, 2).weight.is_meta  # the patch is gone after the block


def test_materialising_part_of_a_model_initialises_it_and_leaves_the_rest():
    torch.manual_seed(1)
    with delay_param_initialization():
        model = LlamaForCausalLM(_config())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rng = torch.get_rng_state()
    mine = ["model.layers.1.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"]
    assert materialize(model, mine, "cpu") == sorted(mine)
    assert torch.equal(rng, torch.get_rng_state())  # the user's stream is untouched
    assert model.model.norm.weight.eq(1).all()  # HF's _init_weights: norms start at one
    std = float(model.model.layers[1].mlp.up_proj.weight.detach().std())
    assert 0.01 < std < 0.03  # initializer_range 0.02
    assert model.model.layers[0].mlp.up_proj.weight.is_meta and has_meta(model)
    assert optimizer.param_groups[0]["params"][-1] is model.lm_head.weight  # same objects, now with data
    # The same module gets the same values on whichever rank materialises it.
    torch.manual_seed(1)
    with delay_param_initialization():
        again = LlamaForCausalLM(_config())
    materialize(again, ["model.layers.1.mlp.up_proj.weight"], "cpu")
    assert torch.equal(again.model.layers[1].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight)


def test_plain_modules_use_reset_parameters_and_meta_buffers_need_an_initialiser():
    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    materialize(net, ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var"], "cpu")
    assert net[1].running_var.eq(1).all() and net[1].weight.eq(1).all() and net[0].weight.abs().max() <= 8 ** -0.5

    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("freq", torch.arange(4.0), persistent=False)

    with torch.device("meta"):
        r = Rotary()
    with pytest.raises(MaterializeError, match=r"freq were built on the meta device and no initialiser restores them"):
        materialize(r, ["freq"], "cpu")


def test_release_keeps_the_named_and_tied_tensors():
    model = LlamaForCausalLM(LlamaConfig(**{**_config().to_dict(), "tie_word_embeddings": True}))
    before = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    freed = release(model, ["lm_head.weight"])
    assert not model.model.embed_tokens.weight.is_meta  # tied to the kept head
    assert model.model.layers[0].self_attn.q_proj.weight.is_meta
    assert 0 < freed < before


class _Block(torch.nn.Module):
    """Two linear layers that keep their last output (as torch's pipelining test model MultiMLPWithDw keeps its
    activations): after a forward, a live autograd graph holds the block's weights."""

    def __init__(self, width: int):
        super().__init__()
        self.net1, self.net2 = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = self.net2(torch.relu(self.net1(x)))
        return self.last


def test_a_tensor_a_live_graph_holds_changes_in_place_and_the_old_graph_refuses_backward():
    block = _Block(4)
    weight = block.net1.weight
    out = block(torch.randn(2, 4)).sum()  # not backpropagated: the graph keeps net1.weight for its backward
    release(block, ["net2.weight", "net2.bias"])
    assert block.net1.weight is weight and weight.is_meta  # the same object, its memory released
    materialize(block, ["net1.weight", "net1.bias"], "cpu")
    assert block.net1.weight is weight and not weight.is_meta and weight.grad is None
    with pytest.raises(RuntimeError, match="made before smp.DistributedModel partitioned the model"):
        out.backward()  # it would accumulate into a tensor the model no longer holds


def _checked_then_wrapped(rank: int, world: int) -> dict:
    """A model of 4 :class:`_Block` s that the user ran (a training forward and backward, then a forward whose
    activations its blocks keep) before wrapping it on 2 stages; two SGD steps against the same steps in one
    process."""
    import copy

    import torch.nn.functional as F

    import smp
    from tests.smp.scripts import MANUAL

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, **MANUAL})
    torch.manual_seed(0)
    plain = torch.nn.Sequential(*[_Block(16) for _ in range(4)])
    reference = copy.deepcopy(plain)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    for m in (plain, reference):
        F.mse_loss(m(x), y).backward()
        m(x)  # each block keeps its output
    for block in plain[2:]:
        smp.set_partition(block, 1)
    model = smp.DistributedModel(plain)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    @smp.step
    def train_step(model, x, y):
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    ref_grads = dict(reference.named_parameters())
    worst, losses = 0.0, []
    for _ in range(2):
        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        loss = float(train_step(model, x, y).reduce_mean())
        losses.append((loss, float(ref_loss.detach())))
        for name, p in model.local_named_parameters():
            worst = max(worst, float((p.grad - ref_grads[name].grad).abs().max()))
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"losses": losses, "worst": worst, "held": sorted(n for n, p in plain.named_parameters() if not p.is_meta)}


def test_a_model_run_before_wrapping_trains_on_two_stages_exactly_as_in_one_process():
    results = run_ranks(_checked_then_wrapped, 2, timeout=120)
    for rank, r in enumerate(results):
        for got, want in r["losses"]:
            assert abs(got - want) <= 1e-6 * abs(want), r["losses"]
        assert r["worst"] < 1e-6, r
        assert {n.split(".")[0] for n in r["held"]} == ({"0", "1"} if rank == 0 else {"2", "3"}), r["held"]
