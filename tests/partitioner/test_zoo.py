"""Tests for smp.zoo: every model builds, trains, is deterministic and exports faithfully."""

import pytest
import torch
from torch import nn

from smp import zoo


def _logits(output):
    return getattr(output, "logits", output)


@pytest.fixture(scope="module", params=zoo.NAMES)
def small(request) -> zoo.ZooModel:
    return zoo.build(request.param, batch=2)


def test_forward_backward_gives_finite_loss_and_grads(small):
    assert small.model.training
    loss = small.loss()
    assert loss.dim() == 0 and torch.isfinite(loss)
    small.model.zero_grad()
    loss.backward()
    grads = {n: p.grad for n, p in small.model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), [
        n for n, g in grads.items() if g is None
    ]


def test_train_mode_is_deterministic(small):
    # Dropout anywhere (module or functional) would make two forwards differ.
    first = _logits(small.model(*small.args, **small.kwargs))
    second = _logits(small.model(*small.args, **small.kwargs))
    assert torch.equal(first, second)


def test_non_strict_export_matches_eager(small):
    exported = torch.export.export(small.model, small.args, small.kwargs, strict=False)
    expected = _logits(small.model(*small.args, **small.kwargs))
    assert torch.equal(_logits(exported.module()(*small.args, **small.kwargs)), expected)


def test_blocks_path_names_repeated_blocks(small):
    blocks = small.model.get_submodule(small.blocks)
    assert isinstance(blocks, (nn.ModuleList, nn.Sequential)) and len(blocks) >= 2


def test_example_batch_matches_make_batch(small):
    args, kwargs, target = zoo.make_batch(small.name, 2, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(args, small.args))
    assert kwargs.keys() == small.kwargs.keys() and torch.equal(target, small.target)
    other_args, _, _ = zoo.make_batch(small.name, 2, seed=1)
    assert not torch.equal(other_args[0], small.args[0])


def test_same_seed_same_weights():
    a, b = zoo.build("mlp", seed=3), zoo.build("mlp", seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))


@pytest.mark.parametrize("name", zoo.NAMES)
def test_base_has_more_parameters_than_small(name):
    def count(size):
        return sum(p.numel() for p in zoo.build(name, size=size).model.parameters())

    assert count("base") > count("small")


def test_gpt2_keeps_tied_embeddings():
    model = zoo.build("gpt2").model
    assert model.lm_head.weight is model.transformer.wte.weight


def test_inception_conv_is_shared_by_two_branches():
    zm = zoo.build("inception")
    calls = []
    zm.model.blocks[0].shared.register_forward_hook(lambda *_: calls.append(1))
    zm.model(*zm.args)
    assert len(calls) == 2


def test_batch_size_follows_argument():
    zm = zoo.build("t5", batch=3)
    assert zm.args[0].shape[0] == zm.kwargs["decoder_input_ids"].shape[0] == zm.target.shape[0] == 3


def test_unknown_name_lists_names():
    with pytest.raises(ValueError, match="llama") as info:
        zoo.build("llama")
    assert all(name in str(info.value) for name in zoo.NAMES)


def test_unknown_size_lists_sizes():
    with pytest.raises(ValueError, match="huge") as info:
        zoo.build("mlp", size="huge")
    assert all(size in str(info.value) for size in zoo.SIZES)
