"""Data-parallel replicas start from one model (:mod:`smp.engine.replicas`): ranks that built it from different seeds
stop at the first step with an error naming them, instead of training two models under one name; ranks that seed
their streams apart after building a model without weights (for their own dropout) start from the same weights."""
from __future__ import annotations

import torch

from smp.testing import run_ranks


def _replicas(rank: int, world: int, case: str) -> dict:
    import torch.nn.functional as F

    import smp
    from smp.engine.fingerprint import fingerprint

    smp.init({"pipeline_parallel_degree": 1, "ddp": True, "microbatches": 1})
    torch.manual_seed(rank if case == "seeded apart" else 0)
    with smp.delay_param_initialization(enabled=case == "delayed"):
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    torch.manual_seed(100 + rank)  # each rank's own stream from here on (dropout, augmentation)
    model = smp.DistributedModel(net)

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(rank)
    try:
        train_step(model, torch.randn(4, 8, generator=g), torch.randint(2, (4,), generator=g))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"weights": {n: fingerprint(p) for n, p in model.module.named_parameters()}}


def test_replicas_built_from_different_seeds_stop_at_the_first_step_naming_the_ranks():
    for r in run_ranks(_replicas, 2, "seeded apart", timeout=120):
        assert r["error"].startswith(
            "ReplicasDifferError: the data-parallel replicas of this stage hold different weights when the model is "
            "partitioned: rank 1's 0.weight differs from rank 0's (sum "), r
        assert "rank(s) 1 differ" in r["error"] and "Build the model from one seed on every rank" in r["error"], r


def test_replicas_seeded_apart_after_building_start_from_one_model():
    for case in ("same seed", "delayed"):  # built with weights; built without, initialised at the first step
        a, b = run_ranks(_replicas, 2, case, timeout=120)
        assert "error" not in a and "error" not in b, (a, b)
        assert a["weights"] == b["weights"], case
