"""``smp.optimizers.FusedLAMB`` against LAMB's update rule (You et al. 2019, Algorithm 2, with apex's
options), step by step; and in a pipeline, where the clipping norm must cover every stage's gradients."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from smp.optimizers import FusedLAMB, FusedLamb
from smp.testing import run_ranks


def lamb_reference(xs, wds, grads, steps, *, lr, betas=(0.9, 0.999), eps=1e-6, max_grad_norm=1.0,
                   bias_correction=True, adam_w_mode=True, grad_averaging=True, use_nvlamb=False):
    """The update rule written out in float64 numpy, one tensor at a time."""
    b1, b2 = betas
    b3 = 1 - b1 if grad_averaging else 1.0
    xs = [x.astype(np.float64) for x in xs]
    ms = [np.zeros_like(x) for x in xs]
    vs = [np.zeros_like(x) for x in xs]
    for t in range(1, steps + 1):
        gs = [g.astype(np.float64) for g in grads[t - 1]]
        norm = np.sqrt(sum((g ** 2).sum() for g in gs))
        clip = norm / max_grad_norm if max_grad_norm > 0 and norm > max_grad_norm else 1.0
        for i, (x, wd) in enumerate(zip(xs, wds)):
            g = gs[i] / clip
            if not adam_w_mode:
                g = g + wd * x
            ms[i] = b1 * ms[i] + b3 * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            c1, c2 = (1 - b1 ** t, 1 - b2 ** t) if bias_correction else (1.0, 1.0)
            r = (ms[i] / c1) / (np.sqrt(vs[i] / c2) + eps)
            if adam_w_mode:
                r = r + wd * x
            x_norm, r_norm = np.linalg.norm(x), np.linalg.norm(r)
            phi = x_norm / r_norm if (wd != 0 or use_nvlamb) and x_norm > 0 and r_norm > 0 else 1.0
            xs[i] = x - lr * phi * r
    return xs


@pytest.mark.parametrize("options", [
    {},                                                   # apex's defaults: AdamW mode, clipping at 1.0
    {"max_grad_norm": 100.0},                             # no clipping
    {"adam_w_mode": False},                               # L2 regularisation folded into the gradient
    {"grad_averaging": False, "bias_correction": False},
    {"use_nvlamb": True},                                 # trust ratio on the weight-decay-free group too
    {"betas": (0.8, 0.99), "eps": 1e-4, "max_grad_norm": 0.0},
])
def test_fused_lamb_follows_the_update_rule_step_by_step(options):
    rng = np.random.default_rng(0)
    shapes = [(6, 5), (5,), (3, 6), (3,)]
    xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    xs[1][:] = 0  # a zero tensor: its trust ratio falls back to 1
    wds = [0.01, 0.01, 0.0, 0.0]  # the BERT example's two groups: decayed weights, undecayed biases/norms
    steps = 5
    grads = [[(3 * rng.standard_normal(s)).astype(np.float32) for s in shapes] for _ in range(steps)]
    params = [nn.Parameter(torch.tensor(x)) for x in xs]
    groups = [{"params": params[:2], "weight_decay": 0.01}, {"params": params[2:], "weight_decay": 0.0}]
    opt = FusedLAMB(groups, lr=0.05, **options)
    want_by_step = []
    for t in range(steps):
        for p, g in zip(params, grads[t]):
            p.grad = torch.tensor(g)
        opt.step()
        want_by_step.append(lamb_reference(xs, wds, grads, t + 1, lr=0.05, **options))
        for p, want in zip(params, want_by_step[-1]):
            np.testing.assert_allclose(p.detach().numpy(), want, rtol=2e-5, atol=2e-6, err_msg=f"step {t + 1}")
    assert all(opt.state[p]["step"] == steps for p in params)
    assert [g["step"] for g in opt.param_groups] == [steps, steps]  # apex's count, which BERT's lr scheduler reads


def test_fused_lamb_constructor_matches_apex():
    model = nn.Linear(4, 2)
    opt = FusedLamb(model.parameters(), lr=1e-3)  # SMP's documentation spells it FusedLamb
    assert isinstance(opt, FusedLAMB)
    assert opt.defaults["weight_decay"] == 0.01 and opt.defaults["eps"] == 1e-6
    assert opt.defaults["max_grad_norm"] == 1.0 and opt.defaults["betas"] == (0.9, 0.999)
    model(torch.randn(3, 4)).sum().backward()
    opt.zero_grad()  # set_grad_none=True (apex's default)
    assert all(p.grad is None for p in model.parameters())
    opt = FusedLAMB(model.parameters(), set_grad_none=False)
    model(torch.randn(3, 4)).sum().backward()
    opt.zero_grad()
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


@pytest.mark.parametrize("kwargs,error,needle", [
    ({"amsgrad": True}, RuntimeError, "AMSGrad"),
    ({"lr": -1.0}, ValueError, "lr=-1.0"),
    ({"betas": (0.9, 1.0)}, ValueError, "betas=(0.9, 1.0)"),
    ({"weight_decay": -0.1}, ValueError, "weight_decay=-0.1"),
])
def test_fused_lamb_refuses_bad_arguments(kwargs, error, needle):
    with pytest.raises(error, match=needle.replace("(", r"\(").replace(")", r"\)")):
        FusedLAMB(nn.Linear(2, 2).parameters(), **kwargs)


# --- in a pipeline ------------------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.norm(torch.relu(self.embed(x)))))


def _groups(model: nn.Module) -> list[dict]:
    """The BERT example's grouping: no weight decay for biases and LayerNorm."""
    decay = [p for n, p in model.named_parameters() if not any(k in n for k in ("bias", "norm"))]
    rest = [p for n, p in model.named_parameters() if any(k in n for k in ("bias", "norm"))]
    return [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]


def _lamb_pipeline(rank: int, world: int, config: dict):
    import smp

    smp.init(config)
    torch.manual_seed(0)
    net = Net()
    reference = copy.deepcopy(net)
    ref_opt = FusedLAMB(_groups(reference), lr=0.02, max_grad_norm=0.05)  # clipping on every step
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(FusedLAMB(_groups(model), lr=0.02, max_grad_norm=0.05))

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    d, n = smp.dp_rank(), smp.dp_size()
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randint(4, (8,), generator=g)
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        train_step(model, x.chunk(n)[d], y.chunk(n)[d])
        opt.step()
        opt.zero_grad()
    ref = dict(reference.named_parameters())
    return max(float(((p - ref[k]).abs() / (ref[k].abs() + 1e-3)).max()) for k, p in model.local_named_parameters())


@pytest.mark.parametrize("config,world", [
    ({"pipeline_parallel_degree": 2, "microbatches": 2}, 2),
    pytest.param({"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, "shard_optimizer_state": True}, 4,
                 marks=pytest.mark.slow),  # ZeRO rebuilds FusedLAMB from its defaults; each shard sees part of G
])
def test_fused_lamb_in_a_pipeline_steps_as_one_device(config, world):
    for err in run_ranks(_lamb_pipeline, world, config, timeout=240):
        assert err < 1e-4, err
