"""DDP's Reducer over a pipeline (:mod:`pipeline.grad_buckets`) with the runner directly, pp2 x dp2 on 4 ranks: for
every schedule (ZB-H1's split backward included, whose weight pass accumulates gradients without autograd's hooks)
the buckets go during the backward and average bit for bit as one all-reduce after it, and match one process."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from smp.testing import run_ranks

PIPELINES, REPLICAS = [[0, 1], [2, 3]], [[0, 2], [1, 3]]


def _averaged(rank: int, world: int, schedule: str) -> dict:
    import torch.distributed as dist

    from partitioner import partition, trace
    from pipeline import PipelineRunner
    from pipeline.grad_buckets import GradBuckets, ReduceGroup

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                        nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    F.mse_loss(net(x), y).backward()
    want = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    group, _ = dist.new_subgroups_by_enumeration(REPLICAS)
    peers = [r for r in next(r for r in REPLICAS if rank in r) if r != rank]
    replica = next(i for i, p in enumerate(PIPELINES) if rank in p)
    plan = partition(trace(net, (x[:4],)), 2, microbatches=2)
    out: dict = {}
    for overlap in (True, False):
        runner = PipelineRunner(plan, schedule=schedule, microbatches=2, pipelines=PIPELINES, timeout_s=30)
        local = {id(p) for p in runner.local_parameters()}
        named = [(n, p) for n, p in net.named_parameters() if id(p) in local]
        buckets = GradBuckets([ReduceGroup("data-parallel", group, peers, named)], runner.local_stages, set(), rank,
                              30.0, cap_mb=0.0002, overlap=overlap)
        runner.executor.grad_buckets = buckets if overlap else None
        buckets.arm()
        runner.step((x.chunk(2)[replica],), target=y.chunk(2)[replica], loss_fn=F.mse_loss)
        count = buckets.finish()
        out[overlap] = ({n: p.grad.clone() for n, p in named}, tuple(count))
        buckets.close()
        runner.close()
        net.zero_grad(set_to_none=True)
    out["want"] = want
    return out


@pytest.mark.slow  # 4 ranks, three schedules
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_buckets_overlap_every_schedule_and_average_as_one_all_reduce(schedule):
    for r in run_ranks(_averaged, 4, schedule, timeout=240):
        (on, (colls, nbytes, early)), (off, blocking) = r[True], r[False]
        assert on and colls > 1 and early == colls and blocking == (1, nbytes, 0), (colls, nbytes, early, blocking)
        for name, grad in on.items():
            assert torch.equal(grad, off[name]), name
            torch.testing.assert_close(grad, r["want"][name], rtol=1e-5, atol=1e-7)
