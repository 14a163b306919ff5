"""``partitioner.tp.rank_zero``: tp rank 0's graph and its sharding, and the weights a degree would leave some rank no
slice of."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from partitioner import trace
from partitioner.tp.rank_zero import rank_zero_graph, thin_params
from partitioner.tp.sharding import Shard, Sharding
from tests.smp.test_tp_training import VOCAB, build


def test_rank_zero_holds_its_share_of_each_sharded_weight() -> None:
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(build("gpt2"), (ids,), {"labels": ids})
    local, sharding = rank_zero_graph(graph, 2)
    assert sharding.tp == 2 and sharding.params and not thin_params(sharding)
    assert local.param_bytes.sum() < graph.param_bytes.sum()
    with pytest.raises(ValueError, match="traced graph"):
        rank_zero_graph(dataclasses.replace(graph, fx=None), 2)  # a graph loaded from disk: no program to shard


def test_a_degree_above_a_weights_slices_is_thin() -> None:
    sharding = Sharding(4, params={"a": Shard(0, 8), "b": Shard(1, 6, groups=3), "c": Shard(0, 3)})
    assert thin_params(sharding) == [(2, "b"), (3, "c")]  # fewest slices first
    assert thin_params(Sharding(2, params={"a": Shard(0, 8)})) == []
