"""As in SMP v1, the step arguments of pp_rank 0 are the truth (:mod:`smp.engine.step_values`): with data only on
pp_rank 0 (``torch.empty(0)`` elsewhere), or a different real batch and Python argument on every rank, a
pipelined run (pp2, pp2 x dp2) trains exactly what a single process trains on pp_rank 0's batches; Python
values returned by the step come back as lists."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from smp.engine.step_values import InputsError
from smp.testing import run_ranks
from tests.smp.scripts import MANUAL, two_stage_mlp


def _batch(step: int, who: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * who + step)
    return torch.randn(8, 16, generator=g), torch.randint(4, (8,), generator=g)


def _train(rank: int, world: int, mode: str, placement: str):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": world > 2, "placement_strategy": placement,
              **MANUAL})
    net = two_stage_mlp(16, 16, 4)
    reference = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(model, x, y, scale):
        loss = F.cross_entropy(model(x), y) * scale
        model.backward(loss)
        return loss, loss.item(), scale

    got, want, own_labels = [], [], []
    for step in range(3):
        scale = step + 1  # an int: it must come from pp_rank 0 too
        if smp.pp_rank() == 0:
            args = (*_batch(step, smp.dp_rank()), scale)
        elif mode == "placeholder":
            args = (torch.empty(0), torch.empty(0), -1)
        else:  # another real batch of another size, and another scale
            args = (*(t[:4] for t in _batch(step, 100 + rank)), 7)
        loss, items, scales = train_step(model, *args)
        got.append((float(loss.reduce_mean()), sum(items) / len(items), scales))
        # The single-process run on the pp_rank 0 batches of every replica (one replica's loss is reported).
        ref = [F.cross_entropy(reference(x), y) * scale for x, y in (_batch(step, d) for d in range(smp.dp_size()))]
        want.append(float(ref[smp.dp_rank()]))
        x0, _ = _batch(step, smp.dp_rank())
        own_labels.append(float(F.cross_entropy(reference(x0[:4]), args[1][:4]) * args[2]) if mode == "mismatch"
                          else None)  # what training against this rank's own labels would have given
        ref_opt.zero_grad()
        (sum(ref) / len(ref)).backward()
        ref_opt.step()
        opt.step()
        opt.zero_grad()
    ref_params = dict(reference.named_parameters())
    err = max(float((p - ref_params[n]).abs().max()) for n, p in model.local_named_parameters())
    return {"got": got, "want": want, "own_labels": own_labels, "param_err": err}


@pytest.mark.parametrize("mode,world,placement", [
    ("placeholder", 2, "cluster"), ("mismatch", 2, "cluster"),  # the default run
    pytest.param("mismatch", 4, "cluster", marks=pytest.mark.slow),
    pytest.param("placeholder", 4, "cluster", marks=pytest.mark.slow),
    pytest.param("placeholder", 4, "spread", marks=pytest.mark.slow),
    pytest.param("mismatch", 4, "spread", marks=pytest.mark.slow),
])
def test_step_arguments_come_from_pp_rank_0(mode, world, placement):
    for r in run_ranks(_train, world, mode, placement, timeout=240):
        for (loss, item_mean, scales), want in zip(r["got"], r["want"]):
            assert loss == pytest.approx(want, rel=1e-6), r
            assert item_mean == pytest.approx(want, rel=1e-6) and scales == [scales[0]] * 2 and scales[0] > 0, r
        assert [s for _, _, s in r["got"]] == [[1, 1], [2, 2], [3, 3]], r  # Python values: lists
        assert r["param_err"] < 1e-6, r
        if mode == "mismatch" and r["own_labels"][0] is not None:
            assert all(abs(o - g[0]) > 1e-3 for o, g in zip(r["own_labels"], r["got"])), r


def _other_objects(rank: int, world: int):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "timeout_s": 2, **MANUAL})
    model = smp.DistributedModel(two_stage_mlp(16, 16, 4))

    @smp.step
    def train_step(model, x, y, extra=None):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    x, y = _batch(0, 0)
    extra = object() if rank == 1 else None  # an object of the rank's own on rank 1 only: it cannot be matched
    try:
        train_step(model, x, y, extra=extra)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def test_other_objects_must_match_in_number():
    (kind0, msg0), (kind1, msg1) = run_ranks(_other_objects, 2, timeout=120)
    assert kind1 == InputsError.__name__ and "pp_rank 0 hold 1 object(s)" in msg1 and "this rank's hold 2" in msg1
    assert "pass the same objects" in msg1
    assert kind0 != "ok", msg0  # rank 0 ends too (within timeout_s), not hangs
