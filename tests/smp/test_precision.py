"""Mixed precision from the config: ``fp16`` (autocast + SMP's loss scaler driven by the DistributedOptimizer)
and ``bf16`` (autocast), on spawned ranks; the loss scaler's schedule on its own."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from smp.engine.mixed_precision import LossScaler, loss_scaler
from smp.runtime.compat import NoEffectWarning
from smp.runtime.config import load_config
from smp.testing import run_ranks


def _scales(scaler: LossScaler, overflows: list[bool]) -> list[float]:
    """The scale after each step, given whether the step overflowed (the found-inf flag unscale_ records)."""
    out = []
    for overflow in overflows:
        scaler._per_optimizer_states[0]["found_inf_per_device"] = {torch.device("cpu"): torch.tensor([float(overflow)])}
        scaler.update()
        out.append(scaler.get_scale())
    return out


@pytest.mark.parametrize("args,overflows,want", [
    # grows after scale_window good steps, counted from the last overflow; delayed_shift=2 absorbs one overflow
    ({"scale_window": 3, "delayed_shift": 2}, [0, 0, 0, 1, 1, 1, 0, 0, 0], [16, 16, 32, 32, 16, 8, 8, 8, 16]),
    # without consecutive_hysteresis a good step does not restore the hysteresis ...
    ({"scale_window": 3, "delayed_shift": 2}, [1, 0, 1, 1], [16, 16, 8, 4]),
    # ... with it, it does
    ({"scale_window": 3, "delayed_shift": 2, "consecutive_hysteresis": True}, [1, 0, 1, 1], [16, 16, 16, 8]),
    ({"scale_window": 100, "min_scale": 4}, [1, 1, 1, 1], [8, 4, 4, 4]),
    ({"scale_window": 1, "scale_factor": 4.0}, [0, 1, 0], [64, 16, 64]),
])
def test_dynamic_loss_scale_follows_smp_schedule(args, overflows, want):
    scaler = LossScaler(dynamic=True, init_scale=16.0, **args)
    assert _scales(scaler, [bool(o) for o in overflows]) == want


def test_static_loss_scale_never_changes():
    assert _scales(LossScaler(static_loss_scale=128.0), [True, False, True]) == [128.0] * 3


def test_loss_scaler_from_optimizer_arguments():
    fp16, fp32 = load_config({"partitions": 2, "fp16": True}), load_config({"partitions": 2})
    scaler = loss_scaler(fp16, None, True, {"scale_window": 1000, "min_scale": 1, "delayed_shift": 2})
    assert scaler.dynamic and scaler.get_scale() == 2.0 ** 32 and scaler.delayed_shift == 2  # SMP's init_scale
    static = loss_scaler(fp16)  # SMP's defaults: a static scale of 1
    assert not static.dynamic and static.get_scale() == 1.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert loss_scaler(fp32) is None
        assert caught == []
        assert loss_scaler(fp32, None, True, {"scale_window": 1000}) is None  # the GPT-2 example without fp16
    assert [w.category for w in caught] == [NoEffectWarning] and "set 'fp16': True" in str(caught[0].message)
    with pytest.raises(TypeError, match="unknown dynamic_loss_args \\['window'\\]"):
        loss_scaler(fp16, None, True, {"window": 2})
    with pytest.raises(ValueError, match="needs dynamic_loss_scale=True"):
        loss_scaler(fp16, None, False)
    with pytest.raises(ValueError, match="scale_factor=1.0 must be > 1"):
        loss_scaler(fp16, None, True, {"scale_factor": 1.0})


# --- on two ranks -------------------------------------------------------------------------------------------


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=g), torch.randint(4, (8,), generator=g)


def _mixed(rank: int, world: int, precision: str, inf_on: int):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, precision: True})
    net = _net()
    reference = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    model = smp.DistributedModel(net)
    # The arguments of SMP's GPT-2 example; a small init_scale so that the first steps do not overflow.
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), static_loss_scale=None,
                                   dynamic_loss_scale=True,
                                   dynamic_loss_args={"init_scale": 2.0 ** 10, "scale_window": 2, "min_scale": 1})

    @smp.step
    def train_step(model, x, y):  # an SMP script: no autocast, no scaler in sight
        out = model(x)
        loss = F.cross_entropy(out.float(), y)
        model.backward(loss)
        return loss, out

    losses, ref_losses, dtypes, overflow, changed, scales, norms = [], [], set(), [], [], [], []
    for step in range(4):
        x, y = _batch(step)
        loss, out = train_step(model, x, y)
        losses.append(float(loss.reduce_mean()))
        dtypes |= {str(o.dtype) for o in out.outputs}
        skipped = inf_on >= 0 and step == 1
        if skipped and smp.pp_rank() == inf_on:  # an overflow on one stage only
            next(p for p in model.local_parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(reference(x), y)
        ref_loss.backward()
        ref_losses.append(float(ref_loss))
        ref_norm = float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
        if not skipped:
            ref_opt.step()
        before = [p.detach().clone() for p in model.local_parameters()]
        norm = float(opt.clip_master_grads(100.0)) if opt.loss_scaler is not None else ref_norm
        norms.append((norm, ref_norm))
        opt.step()
        opt.zero_grad()
        overflow.append(opt.overflow)
        changed.append(any(not torch.equal(b, p) for b, p in zip(before, model.local_parameters())))
        scales.append(opt.loss_scaler.get_scale() if opt.loss_scaler is not None else None)
    ref = dict(reference.named_parameters())
    err = max(float(((p - ref[k]).abs() / (ref[k].abs() + 1e-2)).max()) for k, p in model.local_named_parameters())
    return {"losses": losses, "ref_losses": ref_losses, "dtypes": sorted(dtypes), "overflow": overflow,
            "changed": changed, "scales": scales, "norms": norms, "param_err": err,
            "param_dtypes": sorted({str(p.dtype) for p in model.local_parameters()})}


def test_fp16_config_autocasts_and_scales_the_loss():
    results = run_ranks(_mixed, 2, "fp16", 0, timeout=240)  # the overflow on the rank without the loss
    s0 = 2.0 ** 10
    for r in results:
        assert r["dtypes"] == ["torch.float16"] and r["param_dtypes"] == ["torch.float32"], r
        assert r["overflow"] == [False, True, False, False] and r["changed"] == [True, False, True, True], r
        # scale_window=2: grows after two good steps since the last overflow, halves on it
        assert r["scales"] == [s0, s0 / 2, s0 / 2, s0], r
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= 2e-2 * abs(want), (r["losses"], r["ref_losses"])
        for step, (norm, ref_norm) in enumerate(r["norms"]):  # unscaled, over both stages' gradients
            if step != 1:
                assert abs(norm - ref_norm) <= 2e-2 * ref_norm, r["norms"]
        assert r["param_err"] < 2e-2, r


def test_bf16_config_autocasts_without_loss_scaling():
    for r in run_ranks(_mixed, 2, "bf16", -1, timeout=240):
        assert r["dtypes"] == ["torch.bfloat16"] and r["param_dtypes"] == ["torch.float32"], r
        assert r["scales"] == [None] * 4 and r["overflow"] == [False] * 4, r
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= 3e-2 * abs(want), (r["losses"], r["ref_losses"])


def _hf_labels(rank: int, world: int):
    """A Hugging Face model computing its own loss from ``labels=`` (as SMP's GPT-2 example does) under bf16:
    the pipelined loss and the single-process bf16 autocast loss."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "bf16": True})
    torch.manual_seed(0)
    net = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16,
                                     bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 100, (4, 8), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = sum(float(net(input_ids=half, labels=half).loss) for half in ids.chunk(2)) / 2
    model = smp.DistributedModel(net)

    @smp.step
    def train_step(model, ids):
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    return float(train_step(model, ids).reduce_mean()), ref


def test_bf16_with_a_model_that_computes_its_own_loss():
    """The stages' fake run that finds which boundary values carry gradients runs under the traced autocast
    (it failed with a dtype mismatch before)."""
    for got, want in run_ranks(_hf_labels, 2, timeout=240):
        assert abs(got - want) <= 1e-2 * abs(want), (got, want)
