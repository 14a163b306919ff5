"""``smp.DistributedOptimizer`` with sharded optimizer state (pp2 x dp2): exact, with and without loss scaling, for
Adam and AdamW (whose defaults hold a key its constructor does not take)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from smp.testing import run_ranks
from tests.smp.features import PARAM_TOL, make_batch, make_net, param_err

# --- sharded optimizer state (pp=2 x dp=2) ------------------------------------------------------------------


def _sharded(rank: int, world: int, scaled: bool, optimizer: str):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, "shard_optimizer_state": True})
    net = make_net()
    reference = copy.deepcopy(net)
    make = getattr(torch.optim, optimizer)
    ref_opt = make(reference.parameters(), lr=1e-2)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 0.5 ** s)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(make(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)  # ZeRO must follow the schedule too
    # A power-of-two scale that never changes: unscaling is exact, so the run still equals the reference.
    scaler = smp.amp.GradScaler(init_scale=2.0 ** 10, growth_interval=10 ** 6, enabled=scaled)

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(scaler.scale(loss))
        return loss

    d, n = smp.dp_rank(), smp.dp_size()
    broadcasts = []
    real = torch.distributed.broadcast

    def counted(*args, **kwargs):  # what ZeRO's step sends: the updated weights, one bucket per owner rank
        broadcasts.append(1)
        return real(*args, **kwargs)

    for step in range(3):
        x, y = make_batch(step)
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        ref_sched.step()
        train_step(model, x.chunk(n)[d], y.chunk(n)[d])
        torch.distributed.broadcast = counted
        scaler.step(opt)  # through the DistributedOptimizer, so the sharded step runs
        torch.distributed.broadcast = real
        scaler.update()
        opt.zero_grad()
        sched.step()
    local = [p for p in model.local_parameters() if p.requires_grad]
    held = len(opt._zero.optim.state) if opt._zero is not None else len(opt.optimizer.state)
    saved = opt.local_state_dict()  # this replica's part of the state, and back
    opt.load_state_dict(saved)
    # The full state, gathered from every stage and replica, matches the single-device optimizer's, and
    # loads back into the shards (each takes its part, nothing more).
    full, want = opt.state_dict(), ref_opt.state_dict()
    state_err = max(float((full["state"][i]["exp_avg_sq"] - v["exp_avg_sq"]).abs().max() /
                          v["exp_avg_sq"].abs().max()) for i, v in want["state"].items())
    opt.load_state_dict(full)
    reloaded = opt.state_dict()
    model_sd, ref_sd = model.state_dict(), reference.state_dict()
    return {"param_err": param_err(model, reference), "local_params": len(local), "state_entries": held,
            "pp_rank": smp.pp_rank(), "broadcasts": len(broadcasts),
            "sharded": opt._zero is not None and saved.get("_smp_zero", False),
            "state_keys": sorted(full["state"]) == sorted(want["state"]), "state_err": state_err,
            "lr": full["param_groups"][0]["lr"] == want["param_groups"][0]["lr"],
            "reloaded": all(torch.equal(reloaded["state"][i]["exp_avg"], v["exp_avg"])
                            for i, v in full["state"].items())
            and len(opt._zero.optim.state) == held,
            "model_sd": sorted(model_sd) == sorted(ref_sd)
            and all(torch.allclose(model_sd[k], v, rtol=1e-4, atol=1e-6) for k, v in ref_sd.items())}


@pytest.mark.parametrize(("scaled", "optimizer"), [pytest.param(False, "Adam", marks=pytest.mark.slow),
                                                  (True, "AdamW")])
def test_shard_optimizer_state_pp2_dp2(scaled, optimizer):
    results = run_ranks(_sharded, 4, scaled, optimizer, timeout=300)
    for r in results:
        assert r["sharded"], r
        assert r["param_err"] < PARAM_TOL, r
        assert 0 < r["state_entries"] < r["local_params"], r  # each replica keeps only its part of the state
        assert r["state_keys"] and r["state_err"] < 1e-3 and r["lr"], r  # full state_dict() == one device's
        assert r["reloaded"], r
        assert r["broadcasts"] == 3 * 2 < 3 * r["local_params"], r  # a bucket per owner of 2 replicas, not per weight
        assert r["model_sd"], r  # the gathered model state_dict() == the reference's
    for stage in (0, 1):  # the replicas of a stage hold disjoint parts that cover its parameters
        rs = [r for r in results if r["pp_rank"] == stage]
        assert sum(r["state_entries"] for r in rs) == rs[0]["local_params"], rs
