"""smp.engine.planning.pipeline_runner: trace, partition on rank 0, share the plan, keep this rank's tensors, run."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from smp.testing import run_ranks


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 1024))


def _run(rank: int, world: int) -> dict:
    from smp.engine.planning import pipeline_runner

    x, y = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)), torch.arange(8) * 100
    want = sum(float(F.cross_entropy(_model()(x[i:i + 2]), y[i:i + 2])) for i in range(0, 8, 2)) / 4
    model = _model()
    # example inputs: one microbatch (x[:2] of 4); the step takes the whole batch
    priced = pipeline_runner(model, (x[:2],), microbatches=4, loss_fn=F.cross_entropy, target=y[:2], timeout_s=60)
    plain = pipeline_runner(_model(), (x[:2],), microbatches=4, timeout_s=60)
    out = lambda r: r.plan.graph.flops[r.plan.graph.kinds.index("output")]  # noqa: E731
    loss = priced.step((x,), target=y, loss_fn=F.cross_entropy).loss
    held = sorted(n for n, p in model.named_parameters() if not p.is_meta)
    for r in (priced, plain):
        r.close()
    return {"loss": loss, "want": want, "priced": out(priced), "plain": out(plain), "held": held}


def test_pipeline_runner_prices_the_loss_it_is_given_and_trains_this_ranks_share():
    got = run_ranks(_run, 2, timeout=120)
    for r in got:
        assert abs(r["loss"] - r["want"]) < 1e-5 * abs(r["want"]), r
        assert r["priced"] >= 5 * 2 * 1024 and r["plain"] == 0, r
    assert got[0]["held"] and got[1]["held"] and not set(got[0]["held"]) & set(got[1]["held"])
