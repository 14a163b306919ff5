"""The loss of an ``@smp.step`` function is priced on the last stage (smp.engine.step_loss): a cross-entropy over
the logits of a model that returns them, nothing for a model that computes its own loss, and the plan moves work
off the last stage for it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import partitioner
from partitioner.capture.tracing import price_loss
from smp import zoo
from smp.engine.step_loss import step_loss


def _gpt2(labels: bool) -> partitioner.OpGraph:
    z = zoo.build("gpt2", batch=4)
    kwargs = {**z.kwargs, "labels": z.args[0]} if labels else z.kwargs
    return partitioner.trace(z.model, z.args, kwargs)


def test_logits_get_the_cross_entropy_a_step_computes():
    graph = _gpt2(labels=False)
    found = step_loss(graph)
    assert found is not None
    loss_fn, target = found
    logits = torch.randn(4, 32, 512)
    assert target.shape == (4, 32) and target.dtype == torch.long
    assert torch.equal(loss_fn((logits,), target),
                       F.cross_entropy(logits.flatten(0, 1), target.flatten()))
    before = graph.output_work()
    price_loss(graph, loss_fn, target)
    after = graph.output_work()
    # log-softmax and NLL over 4 x 32 x 512 logits, forward and backward: a few flops per logit at least
    assert after["flops"] - before["flops"] >= 4 * 32 * 512
    assert after["move_bytes"] > before["move_bytes"]


def test_a_model_that_returns_its_loss_adds_nothing():
    assert step_loss(_gpt2(labels=True)) is None


def _wide_vocab() -> partitioner.OpGraph:
    """A GPT-like model whose 50,257-token vocabulary makes the loss a large share of the last stage's work."""
    import transformers

    cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=50257, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    return partitioner.trace(model, (torch.zeros(4, 32, dtype=torch.long),), {"use_cache": False})


def test_the_plan_gives_the_last_stage_less_model_when_it_computes_the_loss():
    plain, priced = _wide_vocab(), _wide_vocab()
    price_loss(priced, *step_loss(priced))
    a, b = partitioner.partition(plain, 2, microbatches=4), partitioner.partition(priced, 2, microbatches=4)
    last = [sum(1 for s in p.assignment.values() if s == 1) for p in (a, b)]
    flops = [[st.flops for st in p.stages] for p in (a, b)]
    assert last[1] < last[0], (last, flops)  # fewer of the model's ops on the stage that also computes the loss
    assert sum(flops[1]) > sum(flops[0])  # the loss's work is in the plan
