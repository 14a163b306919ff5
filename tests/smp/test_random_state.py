"""The engine never consumes the user's global random streams: after the first ``@smp.step`` (which traces,
partitions, builds and runs the pipeline) torch's, numpy's and Python's generators on every rank are where
a plain forward/backward of the same model leaves them."""
from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from smp.testing import run_ranks


def _build() -> nn.Module:
    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def _states() -> dict:
    out = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _same(a: dict, b: dict) -> dict[str, bool]:
    return {"torch": torch.equal(a["torch"], b["torch"]), "random": a["random"] == b["random"],
            "numpy": a["numpy"][0] == b["numpy"][0] and bool(np.array_equal(a["numpy"][1], b["numpy"][1]))
            and a["numpy"][2:] == b["numpy"][2:],
            "cuda": "cuda" not in a or torch.equal(a["cuda"], b["cuda"])}


def _first_step(rank: int, world: int):
    import smp

    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 16, generator=g), torch.randint(4, (8,), generator=g)
    reference = _build()
    F.cross_entropy(reference(x), y).backward()
    want = _states()

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    model = smp.DistributedModel(_build())

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    train_step(model, x, y)
    return _same(want, _states())


def test_first_step_leaves_the_global_random_streams_alone():
    for r in run_ranks(_first_step, 2, timeout=180):
        assert all(r.values()), r
