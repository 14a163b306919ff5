"""Stepping an optimizer in chunks: the same parameters and state as its own step, bit for bit, with
intermediates of one chunk instead of one whole group."""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

from smp.engine.optimizer_step import FOREACH_EQUALS_LOOP, PER_PARAMETER, chunks, step_in_chunks
from smp.testing import run_ranks

SHAPES = [(300, 64), (64, 64), (64,), (1000, 7), (5, 5), (128, 32)]
KWARGS = {torch.optim.SGD: {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
          torch.optim.Adam: {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.1, "maximize": True},
          torch.optim.Adagrad: {"lr_decay": 0.1, "weight_decay": 0.1},
          torch.optim.RMSprop: {"momentum": 0.9, "centered": True},
          torch.optim.NAdam: {"decoupled_weight_decay": True, "weight_decay": 0.1}}


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _train(cls: type, chunked: bool, steps: int = 3, **kwargs) -> tuple[list[torch.Tensor], dict, int]:
    """Two groups (the second with half the learning rate of the defaults' and one parameter left without a
    gradient), ``steps`` steps; the parameters, the state dict and how many ``step`` calls ran."""
    params = _params()
    opt = cls([{"params": params[:4]}, {"params": params[4:], "weight_decay": 0.0}], **{**KWARGS.get(cls, {}),
                                                                                           **kwargs})
    calls = []
    opt.register_step_post_hook(lambda *_: calls.append(1))
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for i, p in enumerate(params):
            p.grad = None if i == 2 else torch.randn(p.shape, generator=g)
        if chunked:
            assert step_in_chunks(opt, chunk_bytes=64 * 64 * 4) is None
        else:
            opt.step()
    return [p.detach().clone() for p in params], opt.state_dict(), len(calls)


def _same_state(a: dict, b: dict) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k]))
               for x, y in zip(a["state"].values(), b["state"].values()) for k in x)


@pytest.mark.parametrize("cls", PER_PARAMETER, ids=lambda c: c.__name__)
def test_chunked_step_is_the_optimizers_own_bit_for_bit(cls):
    # Classes whose foreach and for-loop updates differ in the last bits are chunked only when foreach=True.
    foreach = None if cls in FOREACH_EQUALS_LOOP else True
    want, want_state, own_calls = _train(cls, False, foreach=foreach)
    got, got_state, calls = _train(cls, True, foreach=foreach)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert _same_state(want_state, got_state)  # hyperparameters (foreach included) restored, state equal
    assert own_calls == 3 and calls > 3 * 2  # really in chunks: several per group and step


@pytest.mark.parametrize("kwargs", [{"fused": True}, {"foreach": False}], ids=["fused", "foreach=False"])
def test_groups_that_make_no_group_sized_temporary_step_as_they_are(kwargs):
    want, want_state, _ = _train(torch.optim.Adam, False, **kwargs)
    got, got_state, calls = _train(torch.optim.Adam, True, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(want, got)) and _same_state(want_state, got_state)
    assert calls == 3  # one step call per step


def test_a_closure_or_an_optimizer_torch_does_not_ship_steps_once():
    class Global(torch.optim.SGD):  # a subclass may read every parameter at once (a global clip)
        pass

    _, _, calls = _train(Global, True, lr=0.1)
    assert calls == 3
    params = _params()
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.Adam(params)
    assert step_in_chunks(opt, lambda: torch.tensor(2.0), chunk_bytes=1) == 2.0  # the closure's loss
    assert len(opt.state) == len(params)


def test_chunks_count_only_gradients():
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (10, 10, 30))
    a.grad, c.grad = torch.zeros(10), torch.zeros(30)
    assert chunks([a, b, c], 48) == [[a, b], [c]]  # b has no gradient: it costs nothing
    assert chunks([c, a], 40) == [[c], [a]]        # a parameter larger than a chunk goes alone
    with pytest.raises(ValueError, match="chunk_bytes must be a positive number of bytes, got 0"):
        step_in_chunks(torch.optim.SGD([a], lr=0.1), chunk_bytes=0)


def _peak_growth(chunked: bool) -> int:
    """Bytes the resident high-water mark grows in the second step of foreach Adam over two 34 MiB
    parameters (above glibc's largest mmap threshold, so every tensor's memory is returned when freed)."""
    params = [torch.nn.Parameter(torch.full((34 << 18,), 0.5)) for _ in range(2)]
    for p in params:
        p.grad = torch.full_like(p, 0.1)  # written, so resident
    opt = torch.optim.Adam(params, foreach=True)
    opt.step()  # the state is created here: measure the step after it

    def status(field: str) -> int:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field + ":"))

    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # the high-water mark restarts from the resident size
    base = status("VmRSS")
    step_in_chunks(opt, chunk_bytes=34 << 20) if chunked else opt.step()
    return status("VmHWM") - base


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="reads the resident high-water mark from /proc")
def test_chunks_hold_one_chunk_of_intermediates_not_the_group():
    whole, chunked = _peak_growth(False), _peak_growth(True)
    assert whole >= 60 << 20 and chunked <= 45 << 20, (whole >> 20, chunked >> 20)  # 68 MiB vs 34 MiB


def _distributed(rank: int, world: int):
    import smp

    smp.init({"pipeline_parallel_degree": 1})
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 1 << 16), torch.nn.Linear(1 << 16, 64))  # 2 x 16 MiB weights
    reference = copy.deepcopy(net)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2, foreach=True)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True))
    calls = []
    opt.optimizer.register_step_post_hook(lambda *_: calls.append(1))

    @smp.step
    def train_step(model, x):
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        train_step(model, x)
        opt.step()
        opt.zero_grad()
        reference(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(net.parameters(), reference.parameters()))
    return {"same": same, "calls": len(calls)}


def test_distributed_optimizer_steps_in_chunks():
    (out,) = run_ranks(_distributed, 1, timeout=120)
    assert out["same"] and out["calls"] == 2 * 2, out  # two 16 MiB weights (+ biases): two chunks per step
