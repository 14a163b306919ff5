"""What a step runs and returns: eval / ``no_grad`` steps run forward only, ``model.eval()`` turns dropout
off, and a step's return values reach every rank with their reductions."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from smp.engine.step_function import StepOutput
from smp.testing import run_ranks
from tests.smp.features import make_batch, make_net

# --- eval mode / no_grad ------------------------------------------------------------------------------------------


def _step_functions():
    """The step functions these tests run: a training step and a prediction."""
    import smp

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    @smp.step
    def predict(model, x):
        return model(x)

    return train_step, predict


def _forward_only(rank: int, world: int, dropout: float):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4})
    net = make_net(dropout=dropout)
    reference = copy.deepcopy(net).eval()
    model = smp.DistributedModel(net)
    train_step, predict = _step_functions()

    x, y = make_batch(0)
    out = {}
    if dropout:  # partition in train mode, then switch to eval (no optimizer step: the weights stay put)
        train_step(model, x, y)
        model.zero_grad(set_to_none=True)
    model.eval()
    first = predict(model, x).concat()
    out["eval_err"] = float((first - reference(x)).abs().max().detach())
    out["eval_repeatable"] = torch.equal(first, predict(model, x).concat())
    out["eval_grads"] = [p.grad is not None for p in model.local_parameters()]
    model.train()
    with torch.no_grad():
        got = predict(model, x)
    out["no_grad_err"] = float((got.concat() - reference(x)).abs().max().detach())
    out["no_grad_requires_grad"] = any(o.requires_grad for o in got.outputs)
    out["no_grad_grads"] = [p.grad is not None for p in model.local_parameters()]
    return out


def test_eval_and_no_grad_steps_run_forward_only():
    for r in run_ranks(_forward_only, 2, 0.0, timeout=240):
        assert r["eval_err"] < 1e-6 and r["eval_repeatable"], r
        assert r["no_grad_err"] < 1e-6 and not r["no_grad_requires_grad"], r
        assert not any(r["eval_grads"]) and not any(r["no_grad_grads"]), r  # no backward ran


def test_eval_after_training_turns_dropout_off():
    for r in run_ranks(_forward_only, 2, 0.5, timeout=240):
        assert r["eval_repeatable"] and r["eval_err"] < 1e-6, r


# --- what a step returns -------------------------------------------------------------------------------------------


def test_step_output_reductions():
    out = StepOutput([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])])
    assert torch.equal(out.reduce_mean(), torch.tensor([2.0, 4.0]))
    assert torch.equal(out.reduce_sum(), torch.tensor([4.0, 8.0]))
    assert torch.equal(out.concat(), torch.tensor([1.0, 2.0, 3.0, 6.0]))
    assert torch.equal(out.stack(), torch.tensor([[1.0, 2.0], [3.0, 6.0]]))
    scalars = StepOutput([1.5, 2.5])
    assert scalars.outputs == [1.5, 2.5] and float(scalars.reduce_mean()) == 2.0 and len(scalars) == 2


def _returns(rank: int, world: int):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4})
    net = make_net()
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net)

    @smp.step
    def train_step(model, x, y, extra):
        out = model(x)
        loss = F.cross_entropy(out, y)
        model.backward(loss)
        got = {"loss": loss, "out": out, "scalar": loss.item(), "count": int(y.numel()), "flag": bool(extra)}
        if extra:
            got["note"] = f"extra {extra}"
        return got

    x, y = make_batch(0)
    want_out = reference(x).detach()
    want_losses = [float(F.cross_entropy(o, t)) for o, t in zip(want_out.chunk(4), y.chunk(4))]
    steps = []
    # The first call sends the values pickled; the second (same structure) as raw bytes; the third returns
    # one more leaf (a string), so it falls back to pickling.
    for extra in (0, 0, 7):
        got = train_step(model, x, y, extra)
        steps.append({
            "types": {k: type(v).__name__ for k, v in got.items()},
            "mean": float(got["loss"].reduce_mean()), "sum": float(got["loss"].reduce_sum()),
            "stack_shape": tuple(got["out"].stack().shape),
            "concat_err": float((got["out"].concat() - want_out).abs().max()),
            "scalar": got["scalar"], "count": got["count"], "flag": got["flag"],  # Python values: plain lists
            "note": got.get("note"),
            "requires_grad": any(o.requires_grad for o in got["out"].outputs),
        })
    return {"steps": steps, "want_losses": want_losses}


def test_step_returns_on_every_rank():
    results = run_ranks(_returns, 2, timeout=240)
    for r in results:  # the last stage computed them; every rank of the pipeline gets them
        want = r["want_losses"]
        for i, got in enumerate(r["steps"]):
            keys = ["loss", "out", "scalar", "count", "flag"] + (["note"] if i == 2 else [])
            assert got["types"] == {k: "StepOutput" if k in ("loss", "out") else "list" for k in keys}, got
            assert got["scalar"] == pytest.approx(want, rel=1e-6) and isinstance(got["scalar"], list)
            assert all(type(v) is float for v in got["scalar"]), got["scalar"]
            assert got["count"] == [2, 2, 2, 2] and all(type(v) is int for v in got["count"])
            assert got["flag"] == [i == 2] * 4 and all(type(v) is bool for v in got["flag"])
            assert got["note"] == (["extra 7"] * 4 if i == 2 else None)
            assert got["mean"] == pytest.approx(sum(want) / 4, rel=1e-6)
            assert got["sum"] == pytest.approx(sum(want), rel=1e-6)
            assert got["stack_shape"] == (4, 2, 4) and got["concat_err"] < 1e-6
            assert not got["requires_grad"]  # detach_outputs=True by default
    assert results[0]["steps"] == results[1]["steps"]


# --- throughput ---------------------------------------------------------------------------------------------------


def _throughput(rank: int, world: int):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4})
    model = smp.DistributedModel(make_net())
    train_step, predict = _step_functions()

    x, y = make_batch(0)
    train_step(model, x, y)
    trained = train_step(model, x, y).throughput
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        forward = predict(model, x).throughput
    return trained, forward, model.runner.plan.stages


def test_every_rank_returns_the_same_throughput():
    (t0, f0, stages), (t1, f1, _) = run_ranks(_throughput, 2, timeout=240)
    assert t0 == t1 and f0 == f1  # the slowest rank's time: the same figures everywhere
    flops = sum(s.flops for s in stages) * 4
    assert t0.samples == 8 and t0.tokens is None and t0.devices == 2
    assert t0.model_flops == pytest.approx(3 * flops) and f0.model_flops == pytest.approx(flops)
    assert t0.seconds > 0 and t0.flops_per_s_per_device == pytest.approx(t0.model_flops / (2 * t0.seconds))
    assert t0.mfu is None and t0.peak_flops_per_s is None  # this CPU's measured profile: no peak, no MFU
