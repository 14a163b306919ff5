"""The stage sets of shape classes (pipeline.shape_classes): an LRU cache of a bounded size, the key of a
microbatch, and the error of a runner that cannot trace new shapes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.shape_classes import ShapeCache, StageSet
from smp.testing import run_ranks


def _set(key):
    return StageSet(key=key, plan=None, split_model=None, local_stages=[], executor=None)  # type: ignore[arg-type]


def test_least_recently_used_class_is_dropped():
    cache = ShapeCache(2)
    a, b, c = ((((4, 8),), "int64"),), ((((4, 6),), "int64"),), ((((4, 12),), "int64"),)
    cache.put(_set(a))
    cache.put(_set(b))
    assert cache.get(a) is not None  # a is now the most recently used
    cache.put(_set(c))
    assert list(cache.sets) == [a, c] and cache.get(b) is None
    assert (cache.hits, cache.misses, cache.evictions) == (1, 1, 1)


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_size_must_be_a_positive_integer(size):
    with pytest.raises(ValueError, match="shape_cache_size must be a positive integer"):
        ShapeCache(size)


def _without_model(rank: int, world: int) -> str:
    from partitioner import DeviceRates, partition, trace
    from pipeline import PipelineRunner
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    plan = partition(trace(model, (torch.randn(2, 4),)), 1, rates=DeviceRates())
    runner = PipelineRunner(plan, microbatches=2)
    runner.step((torch.randn(4, 4),))  # the traced shapes
    with pytest.raises(ValueError) as err:
        runner.step((torch.randn(6, 4),))
    return str(err.value)


def test_a_runner_without_the_model_names_the_shapes_and_the_fix():
    message = run_ranks(_without_model, 1)[0]
    assert "shapes input_1 (3, 4) float32 differs from the traced shapes input_1 (2, 4) float32" in message
    assert "pass PipelineRunner(model=...)" in message and "keep the shapes fixed" in message
