"""Data-parallel replicas start from one model (:mod:`smp.engine.replicas`): ranks that built it from different seeds
(SageMaker's published BERT script seeds each rank by its rank) take the first replica's weights at the first step, as
SMP broadcasts them at partitioning, and rank 0 says so; ranks that seed their streams apart after building a model
without weights (for their own dropout) start from the same weights."""
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
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = {n: fingerprint(p) for n, p in model.module.named_parameters() if not p.is_meta}
        train_step(model, torch.randn(4, 8, generator=g), torch.randint(2, (4,), generator=g))
        after = {n: fingerprint(p) for n, p in model.module.named_parameters()}  # no optimizer step: as broadcast
    return {"before": before, "after": after, "warnings": [f"{w.category.__name__}: {w.message}" for w in caught
                                                           if "replicas" in str(w.message)]}


def test_replicas_built_from_different_seeds_take_the_first_replicas_weights_and_rank_0_says_so():
    a, b = run_ranks(_replicas, 2, "seeded apart", timeout=120)
    assert a["before"] != b["before"]
    assert a["after"] == b["after"] == a["before"]
    assert len(a["warnings"]) == 1 and not b["warnings"], (a["warnings"], b["warnings"])
    assert a["warnings"][0].startswith(
        "ReplicasDifferWarning: the data-parallel replicas of a stage held different weights when the model was "
        "partitioned (rank 1's 0.weight differs from rank 0's: sum "), a["warnings"]
    assert "rank(s) 1 differ): every replica now holds the first replica's, as SMP broadcasts" in a["warnings"][0]


def test_replicas_seeded_apart_after_building_start_from_one_model():
    for case in ("same seed", "delayed"):  # built with weights; built without, initialised at the first step
        a, b = run_ranks(_replicas, 2, case, timeout=120)
        assert not a["warnings"] and not b["warnings"], (a, b)
        assert a["after"] == b["after"], case
