"""The data-parallel replicas of a stage start from the same weights: checked once, when the model is partitioned.

Each replica trains its own copy of its stage's parameters and only the gradients are averaged, so copies that start
apart stay apart: the replicas train different models, and nothing says so. They start apart when the ranks built
the model from different seeds (a script that seeds each rank by its rank before building the model, for its data
augmentation) or loaded different weights. Seeds may differ; weights may not: after partitioning (and the weights
``model.load_weights`` asked for) every rank fingerprints the parameters it holds (:mod:`smp.engine.fingerprint`: one
pass over each, no random draw) and the replicas compare them in one ``all_gather_object`` over the data-parallel
group, on the first step only; a difference is :class:`ReplicasDifferError` on every replica, naming the ranks and
the first parameter that differs. Tensor-parallel shards are compared between the replicas of the same shard (the
same tp_rank); sharded-data-parallel shards (DTensors, each a different slice) are not compared.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from partitioner.errors import EngineError
from pipeline.p2p import named_failures
from smp.engine.fingerprint import difference, fingerprint
from smp.engine.pipeline_model import PipelineModel
from smp.engine.tp_shards import sharded_names
from smp.runtime.state import State

__all__ = ["check_replicas", "ReplicasDifferError"]


class ReplicasDifferError(EngineError, ValueError):
    """The data-parallel replicas of a stage hold different weights at partitioning (the message names the ranks and
    the first parameter that differs)."""


def _differences(prints: list[tuple[int, dict[str, tuple]]], sharded: set[str]) -> dict[int, tuple[int, str, str]]:
    """Index of each replica whose weights differ from those of the first replica holding the same ones -> (that
    replica's index, the first parameter that differs, how)."""
    first_of_shard: dict[int, int] = {}
    out: dict[int, tuple[int, str, str]] = {}
    for i, (tp_rank, mine) in enumerate(prints):
        first_of_shard.setdefault(tp_rank, i)
        for name, fp in mine.items():
            j = first_of_shard[tp_rank] if name in sharded else 0
            theirs = prints[j][1].get(name)
            why = "it holds no such parameter" if theirs is None else difference(fp, theirs)
            if j != i and why is not None:
                out[i] = (j, name, why)
                break
    return out


def check_replicas(st: State, model: PipelineModel) -> None:
    """Raise :class:`ReplicasDifferError` on every rank of this rank's data-parallel group unless the replicas hold
    the same parameters (tensor-parallel shards: those of the same tp_rank). Every rank of the group must call it,
    right after partitioning."""
    ranks = st.ranks("data-parallel")
    if len(ranks) == 1 or model.runner is None:
        return
    sharded = sharded_names(model.runner.plan.traced_graph())
    mine = {n: fingerprint(p) for n, p in model.local_named_parameters() if not isinstance(p, DTensor)}
    prints: list[Any] = [None] * len(ranks)
    with named_failures("comparing the replicas' weights over the data-parallel group",
                        [r for r in ranks if r != st.rank], st.rank, st.config.timeout_s):
        dist.all_gather_object(prints, (st.topology.tp_rank(st.rank), mine), group=st.group("data-parallel"))
    differ = _differences(prints, sharded)
    if not differ:
        return
    i = min(differ)
    j, name, why = differ[i]
    raise ReplicasDifferError(
        f"the data-parallel replicas of this stage hold different weights when the model is partitioned: rank "
        f"{ranks[i]}'s {name} differs from rank {ranks[j]}'s ({why}); rank(s) "
        f"{', '.join(str(ranks[k]) for k in sorted(differ))} differ. Each replica trains its own copy and only the "
        "gradients are averaged, so copies that start apart stay apart. Build the model from one seed on every rank "
        "(torch.manual_seed(seed) before building it; seed the ranks apart after smp.DistributedModel for their own "
        "dropout or augmentation), or load the same weights on every rank")
