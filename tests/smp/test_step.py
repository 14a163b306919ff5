"""``@smp.step`` over many steps and when the user's function misbehaves: memory stays flat, a step function
that stalls ends every rank within ``timeout_s`` naming the stalled rank, and a training step that never
calls ``model.backward`` warns."""
from __future__ import annotations

import gc
import os
import time
import warnings
import weakref

import torch
import torch.nn.functional as F

from smp.testing import run_ranks
from tests.smp.scripts import MANUAL, mlp_step, outcome, two_stage_mlp


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _soak(rank: int, world: int, steps: int):
    import smp
    from smp.engine.step_run import _Micro

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, **MANUAL})
    model = smp.DistributedModel(two_stage_mlp(64, 64, 64, 2048))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    outputs = []  # weak references to the model outputs each microbatch saw (last stage)
    losses = []  # and to the losses each computed
    held = []  # per microbatch: earlier microbatches' outputs and losses of its step still alive, but the one before

    @smp.step
    def train_step(model, x, y):
        out = model(x)
        k = len(outputs) % 4
        earlier = slice(len(outputs) - k, len(outputs) - 1)
        held.append(sum(r() is not None for r in outputs[earlier] + losses[earlier]))
        outputs.append(weakref.ref(out))
        loss = F.cross_entropy(out, y)
        losses.append(weakref.ref(loss))
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 64, generator=g), torch.randint(2048, (32,), generator=g)
    rss = {}
    for i in range(steps):
        train_step(model, x, y)
        opt.step()
        opt.zero_grad()
        if i in (steps // 4, steps - 1):
            gc.collect()
            rss[i] = _rss_mib()
    gc.collect()
    return {"micros": sum(1 for o in gc.get_objects() if isinstance(o, _Micro)), "held": max(held, default=0),
            "outputs_seen": len(outputs), "outputs_alive": sum(r() is not None for r in outputs), "rss": rss}


def test_memory_stays_flat_over_200_steps():
    steps = 200
    results = run_ranks(_soak, 2, steps, timeout=240)
    for r in results:
        # Each step's microbatches, with their outputs and activations, are freed once the step returns.
        assert r["micros"] == 0 and r["outputs_alive"] == 0, results
        # ... and within the step, a microbatch's outputs once its backward ran (1F1B's last stage runs it before
        # the next forward): a step holding every microbatch's logits made GPT-2's @smp.step 1.4x slower. So is its
        # loss, whose graph would keep the stage's received inputs (GPT-2's split head: 4 x 6.4 MB a microbatch).
        assert r["held"] == 0, results
        # Leaking one step's 4 microbatches (8 x 2048 logits, their softmax and gradients) grows RSS by
        # ~0.5 MiB a step, 75 MiB over the measured span; allocator noise is a few MiB.
        assert r["rss"][steps - 1] - r["rss"][steps // 4] < 15, results
    assert results[1]["outputs_seen"] == 4 * steps  # the last stage's rank saw every output


def _stall(rank: int, world: int):
    import smp

    stalling = []

    def stall() -> None:
        if stalling and smp.pp_rank() == 1:
            time.sleep(30)  # far past the timeout; the test's processes end long before

    _, step = mlp_step({"timeout_s": 2}, after_backward=stall)
    step()  # steps work
    stalling.append(True)
    return outcome(step)


def test_stalled_last_stage_ends_every_rank_within_the_timeout():
    out = run_ranks(_stall, 2, timeout=120)
    (kind0, msg0, t0), (kind1, msg1, t1) = out
    assert kind1 == "StepTimeoutError" and "rank 1" in msg1 and "train_step" in msg1, out
    assert "did not return after model.backward(loss) within 2 s" in msg1 and "raise timeout_s" in msg1, msg1
    assert kind0 == "PeerError" and "rank 1 failed: StepTimeoutError" in msg0, out
    assert t0 < 8 and t1 < 8, (t0, t1)  # 2 s, plus a loaded host's slack; never the 30 s stall


def _no_backward(rank: int, world: int):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, **MANUAL})
    model = smp.DistributedModel(two_stage_mlp(16, 16, 4))

    @smp.step
    def forgetful_step(model, x, y, backward):
        loss = F.cross_entropy(model(x), y)
        if backward:
            model.backward(loss)
        return loss

    x, y = torch.randn(8, 16), torch.randint(4, (8,))
    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for backward in (True, True, False, False):  # the third travels the results' fast path
            forgetful_step(model, x, y, backward)
            seen.append([str(w.message) for w in caught if issubclass(w.category, UserWarning)])
        model.eval()
        forgetful_step(model, x, y, False)
        model.train()
        with torch.no_grad():
            forgetful_step(model, x, y, False)
        seen.append([str(w.message) for w in caught if issubclass(w.category, UserWarning)])
    return seen


def test_training_step_without_backward_warns_once_on_every_rank():
    for seen in run_ranks(_no_backward, 2, timeout=120):
        assert seen[0] == seen[1] == [], seen
        assert len(seen[2]) == 1, seen
        assert "forgetful_step" in seen[2][0] and "gradients were not computed" in seen[2][0], seen
        assert seen[3] == seen[2] and seen[4] == seen[2], seen  # once; never in eval mode or under no_grad


def _returns(rank: int, world: int):
    import smp

    smp.init({"pipeline_parallel_degree": 1, "microbatches": 4})
    torch.manual_seed(0)
    model = smp.DistributedModel(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return {"loss": loss, "item": loss.item(), "n": len(x), "none": None}

    out = train_step(model, torch.randn(8, 16), torch.randint(4, (8,)))
    return (type(out["loss"]).__name__, type(out["item"]).__name__, sum(out["item"]) / 4,
            float(out["loss"].reduce_mean()), out["n"], out["none"])


def test_python_values_come_back_as_lists_tensors_as_step_output():
    [(loss_kind, item_kind, item_mean, loss_mean, n, none)] = run_ranks(_returns, 1, timeout=120)
    assert (loss_kind, item_kind) == ("StepOutput", "list"), (loss_kind, item_kind)
    assert abs(item_mean - loss_mean) < 1e-6 and n == [2, 2, 2, 2] and none == [None] * 4


def _skips_last(rank: int, world: int):
    import smp

    smp.init({"pipeline_parallel_degree": 1, "microbatches": 2, **MANUAL})
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Flatten(), torch.nn.Linear(24, 4))
    reference = [p.detach().clone().requires_grad_() for p in net.parameters()]
    model = smp.DistributedModel(net)

    @smp.step
    def train_step(model, ids, y, skip):
        loss = F.cross_entropy(model(ids), y)
        if not bool(skip.any()):  # a NaN loss, say: this microbatch is not backpropagated
            model.backward(loss)
        return loss

    ids, y = torch.randint(50, (4, 3)), torch.randint(4, (4,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_step(model, ids, y, torch.tensor([0, 0, 1, 1]))
    emb, w, b = reference  # the first microbatch's gradient, over the step's two (SMP averages them)
    loss = F.cross_entropy(F.linear(F.embedding(ids[:2], emb).flatten(1), w, b), y[:2]) / 2
    loss.backward()
    return [float((p.grad - r.grad).abs().max()) for p, r in zip(model.local_parameters(), reference)]


def test_a_last_microbatch_left_out_of_the_backward_keeps_the_others_gradients():
    for diffs in run_ranks(_skips_last, 1, timeout=120):
        assert max(diffs) < 1e-6, diffs  # the embedding's included: summed in the step, handed over at its end
