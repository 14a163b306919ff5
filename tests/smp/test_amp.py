"""Mixed precision on spawned ranks: autocast across stages, and the loss scaler skipping a step on every
rank when any rank overflows."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from smp.testing import run_ranks
from tests.smp.features import PARAM_TOL, make_batch, make_net, param_err

# --- autocast -----------------------------------------------------------------------------------------------


def _autocast(rank: int, world: int):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    net = make_net()
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)

    @smp.step
    def train_step(model, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            loss = F.cross_entropy(out.float(), y)
        model.backward(loss)
        return loss, out

    @smp.step
    def fp32_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    losses, ref_losses, dtypes = [], [], set()
    finite = True
    for step in range(3):
        x, y = make_batch(step)
        ref_loss = F.cross_entropy(reference(x), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        ref_losses.append(float(ref_loss))
        loss, out = train_step(model, x, y)
        losses.append(float(loss.reduce_mean()))
        dtypes |= {str(o.dtype) for o in out.outputs}
        finite &= all(bool(torch.isfinite(p.grad).all()) for p in model.local_parameters())
        opt.step()
        opt.zero_grad()
    boundary = sorted({str(v.dtype) for v in model.runner.split_model.value_meta.values()
                       if isinstance(v, torch.Tensor) and v.is_floating_point()})
    try:  # the stages were built for bf16 boundaries: a step without autocast must say so, not garble
        fp32_step(model, *make_batch(0))
        switched = "no error"
    except RuntimeError as exc:
        switched = str(exc)
    return {"losses": losses, "ref_losses": ref_losses, "out_dtypes": sorted(dtypes), "boundary": boundary,
            "finite": finite, "param_dtypes": sorted({str(p.dtype) for p in model.local_parameters()}),
            "switched": switched}


@pytest.mark.slow  # the smp path (config bf16) is tested on two ranks in tests/smp/test_precision.py
def test_autocast_bf16_on_two_ranks():
    for r in run_ranks(_autocast, 2, timeout=240):
        assert r["out_dtypes"] == ["torch.bfloat16"], r  # the model's matmuls ran in bf16
        assert "torch.bfloat16" in r["boundary"], r    # and what crossed stages was bf16
        assert r["param_dtypes"] == ["torch.float32"] and r["finite"], r
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert math.isfinite(got) and abs(got - want) <= 2e-2 * abs(want), (r["losses"], r["ref_losses"])
        assert "partitioned under torch.autocast('cpu', dtype=torch.bfloat16)" in r["switched"], r["switched"]


# --- loss scaling -------------------------------------------------------------------------------------------


def _scaler(rank: int, world: int, inf_on: int):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    net = make_net()
    reference = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    scaler = smp.amp.GradScaler(init_scale=2.0 ** 12, growth_interval=2)

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(scaler.scale(loss))
        return loss

    changed, scales = [], []
    for step in range(4):
        x, y = make_batch(step)
        train_step(model, x, y)
        if step == 1 and smp.pp_rank() == inf_on:  # an overflow on one stage only
            next(p for p in model.local_parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
        if step != 1:  # the reference takes every step but the skipped one
            ref_opt.zero_grad()
            F.cross_entropy(reference(x), y).backward()
            ref_opt.step()
        before = [p.detach().clone() for p in model.local_parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        changed.append(any(not torch.equal(b, p) for b, p in zip(before, model.local_parameters())))
        scales.append(scaler.get_scale())
    return {"changed": changed, "scales": scales, "param_err": param_err(model, reference)}


@pytest.mark.parametrize("inf_on", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_grad_scaler_skips_on_every_rank(inf_on):
    results = run_ranks(_scaler, 2, inf_on, timeout=240)
    for r in results:
        assert r["changed"] == [True, False, True, True], r  # step 1 skipped on both stages
        assert r["param_err"] < PARAM_TOL, r
    s0 = 2.0 ** 12
    # growth_interval=2: grows after two good steps, halves on the overflow
    assert results[0]["scales"] == results[1]["scales"] == [s0, s0 / 2, s0 / 2, s0], [r["scales"] for r in results]
