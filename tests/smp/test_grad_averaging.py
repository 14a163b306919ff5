"""Data-parallel averaging overlapped with the backward (:mod:`pipeline.grad_buckets`, DDP's Reducer): on spawned
ranks, every step's averaged gradients are bit for bit those of the blocking all-reduce after the step
(``overlapping_allreduce`` False), and match one process's full-batch gradients; the buckets go in the order
gradients become final, during the backward, and what they move is counted; a replica that is gone is named by the
wait for its buckets."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from smp.testing import run_ranks
from tests.smp.test_checkpoint import Tied

DP2 = {"pipeline_parallel_degree": 1, "ddp": True, "microbatches": 2}
PP2_DP2 = {"pipeline_parallel_degree": 2, "ddp": True, "microbatches": 2}


def _model(kind: str) -> tuple[nn.Module, object, object]:
    """(model (seed 0), loss_fn, batch(step) -> (inputs, target)) of ``kind``: "mlp" or "tied" (GPT-2's tied
    embedding and head, on both ends of a pipeline)."""
    torch.manual_seed(0)
    if kind == "mlp":
        net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                            nn.Linear(64, 4))

        def batch(k: int):
            g = torch.Generator().manual_seed(100 + k)
            return torch.randn(8, 16, generator=g), torch.randint(4, (8,), generator=g)
        return net, F.cross_entropy, batch

    def tokens(k: int):
        g = torch.Generator().manual_seed(100 + k)
        return torch.randint(32, (8, 6), generator=g), torch.randint(32, (8, 6), generator=g)
    return Tied(), lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()), tokens


def _averaged(rank: int, world: int, config: dict, kind: str, cap_mb: float, steps: int) -> dict:
    """``steps`` steps of the ``kind`` model with the averaging overlapped, then (smp's state reset, the same model
    again) blocking: each step's gradients (before the optimizer steps), losses and counts, and one process's."""
    from smp.runtime import state

    out = {}
    for mode, overlap in (("on", True), ("off", False)):
        state.reset()
        out[mode] = _train(config, kind, overlap, cap_mb, steps)
    return out


def _train(config: dict, kind: str, overlap: bool, cap_mb: float, steps: int) -> dict:
    import smp

    smp.init(config)
    net, loss_fn, batch = _model(kind)
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net, overlapping_allreduce=overlap, bucket_cap_mb=cap_mb)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)

    @smp.step
    def train_step(model, x, y):
        loss = loss_fn(model(x), y)
        model.backward(loss)
        return loss

    out: dict = {"grads": [], "ref_grads": [], "losses": [], "counts": []}
    for k in range(steps):
        x, y = batch(k)
        d, n = smp.dp_rank(), smp.dp_size()
        out["losses"].append(float(train_step(model, x.chunk(n)[d], y.chunk(n)[d]).reduce_mean()))
        out["grads"].append({name: p.grad.clone() for name, p in model.local_named_parameters()})
        out["counts"].append(tuple(model.grad_averaging.last))
        opt.step()
        opt.zero_grad()
        loss_fn(reference(x), y).backward()
        out["ref_grads"].append({name: p.grad.clone() for name, p in reference.named_parameters()})
        ref_opt.step()
        ref_opt.zero_grad()
    out["buckets"] = model.grad_averaging.buckets.buckets
    out["nbytes"] = sum(p.numel() * p.element_size() for p in model.local_parameters())
    return out


def _check(results: list[dict]) -> None:
    for r in results:
        on, off = r["on"], r["off"]
        assert on["losses"] == off["losses"]
        for got, blocking, ref in zip(on["grads"], off["grads"], on["ref_grads"]):
            assert got.keys() == blocking.keys() and got
            for name, g in got.items():
                assert torch.equal(g, blocking[name]), name  # the same sums, divided the same way
                torch.testing.assert_close(g, ref[name], rtol=1e-5, atol=1e-7)


def test_dp2_buckets_overlap_the_backward_and_average_bit_for_bit_as_one_all_reduce():
    results = run_ranks(_averaged, 2, DP2, "mlp", 0.01, 3, timeout=120)
    _check(results)
    for r in results:
        on, off = r["on"], r["off"]
        # 10 KiB buckets, by element counts: the last layer's bias and weight first (the first gradients to be
        # final), each bucket closed by the first parameter that fills it, the first layer's left in the last
        assert on["buckets"] == [[4, 256, 64, 4096], [64, 4096], [64, 1024]], on["buckets"]
        assert on["counts"] == [(3, on["nbytes"], 3)] * 3  # every bucket launched during the backward
        assert off["counts"] == [(1, on["nbytes"], 0)] * 3  # one all-reduce after it


def test_bucket_cap_mb_must_be_positive():
    from smp.engine.grad_averaging import GradAveraging

    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number of megabytes, got 0"):
        GradAveraging(True, 0)


@pytest.mark.slow  # 4 ranks
def test_pp2_dp2_tied_weights_average_after_the_pipeline_sums_them():
    results = run_ranks(_averaged, 4, PP2_DP2, "tied", 0.001, 3, timeout=240)
    _check(results)
    for r in results:
        on = r["on"]
        collectives, _, early = on["counts"][0]
        # the tied weight (32 x 16, on both stages) goes last, once the pipeline has summed its two gradients
        assert on["buckets"][-1] == [512] and collectives == len(on["buckets"]) > early >= 1, on


def _peer_gone(rank: int, world: int) -> str:
    import smp

    smp.init({**DP2, "timeout_s": 10})
    net, loss_fn, batch = _model("mlp")
    model = smp.DistributedModel(net, bucket_cap_mb=0.01)

    @smp.step
    def train_step(model, x, y):
        loss = loss_fn(model(x), y)
        model.backward(loss)
        return loss

    x, y = batch(0)
    train_step(model, x.chunk(2)[rank], y.chunk(2)[rank])
    if rank == 1:
        raise SystemExit("rank 1 stops after its first step")
    try:
        train_step(model, x.chunk(2)[rank], y.chunk(2)[rank])  # its buckets go out; nobody answers
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_replica_that_is_gone_is_named_by_the_averaging_that_waits_for_it():
    first, second = run_ranks(_peer_gone, 2, timeout=120, pg_timeout=20, allow_failure=True)
    assert second.startswith("FAILED") and "rank 1 stops" in second, second
    # "PeerError: rank 0: averaging gradients over the data-parallel replicas failed: rank 1 closed the connection:
    # it has likely died; rank 1 is not in @smp.step train_step (call #2 on the data-parallel): its last smp call is
    # #1 @smp.step train_step"
    assert first.startswith("PeerError: rank 0: ") and "gradients over the data-parallel replicas failed: rank 1 " \
        in first and "rank 1 is not in @smp.step train_step" in first, first
