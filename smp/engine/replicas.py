"""The data-parallel replicas of a stage start from the same weights: made so once, when the model is partitioned.

Each replica trains its own copy of its stage's parameters and only the gradients are averaged, so copies that start
apart would stay apart. They start apart when the ranks built the model from different seeds (SageMaker's published
BERT script seeds every rank by its rank before building the model) or loaded different weights. SMP v1 broadcast
the parameters and buffers over the data-parallel ranks at partitioning (its documentation: "the broadcast is
deferred to the first call of the smp.step-decorated function when the partition is done"), as torch's
``DistributedDataParallel`` does when it wraps a model; so does this engine, and it says so. After partitioning (and
the weights ``model.load_weights`` asked for) every rank fingerprints the parameters it holds
(:mod:`smp.engine.fingerprint`: one pass over each, no random draw) and the replicas compare them in one
``all_gather_object`` over the data-parallel group, on the first step only. When they differ, every replica takes
the first replica's parameters and buffers (one broadcast each; a tensor-parallel shard, or an expert-parallel
rank's experts, from the first replica of the same shard) and a :class:`ReplicasDifferWarning` names the ranks and
the first parameter that differed.
Sharded-data-parallel shards (DTensors, each a different slice) are neither compared nor broadcast.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pipeline.p2p import named_failures
from smp.engine.fingerprint import difference, fingerprint
from smp.engine.pipeline_model import PipelineModel
from smp.engine.tp_shards import expert_specs, sharded_names
from smp.runtime.state import State

__all__ = ["sync_replicas", "ReplicasDifferWarning"]


class ReplicasDifferWarning(UserWarning):
    """The data-parallel replicas of a stage held different weights at partitioning and now hold the first replica's
    (the message names the ranks and the first parameter that differed)."""


def _differences(prints: list[tuple[Any, dict[str, tuple]]], sharded: set[str]) -> dict[int, tuple[int, str, str]]:
    """Index of each replica whose weights differ from those of the first replica holding the same ones (``prints``:
    per replica, the key of the shards it holds and its fingerprints) -> (that replica's index, the first parameter
    that differs, how)."""
    first_of_shard: dict[Any, int] = {}
    out: dict[int, tuple[int, str, str]] = {}
    for i, (key, mine) in enumerate(prints):
        first_of_shard.setdefault(key, i)
        for name, fp in mine.items():
            j = first_of_shard[key] if name in sharded else 0
            theirs = prints[j][1].get(name)
            why = "it holds no such parameter" if theirs is None else difference(fp, theirs)
            if j != i and why is not None:
                out[i] = (j, name, why)
                break
    return out


def sync_replicas(st: State, model: PipelineModel) -> None:
    """Give every replica of this rank's stage the first replica's parameters and buffers when they differ, with a
    :class:`ReplicasDifferWarning` (see the module docstring). Every rank of the data-parallel group must call it,
    right after partitioning."""
    ranks = st.ranks("data-parallel")
    if len(ranks) == 1 or model.runner is None:
        return
    experts = set(expert_specs(model.runner.plan.traced_graph()))
    sharded = sharded_names(model.runner.plan.traced_graph()) | experts
    mine = {n: fingerprint(p) for n, p in model.local_named_parameters() if not isinstance(p, DTensor)}
    shard_key = (st.topology.tp_rank(st.rank), st.ep_coordinates()[1])  # replicas with this key hold the same shards
    prints: list[Any] = [None] * len(ranks)
    with named_failures("comparing the replicas' weights over the data-parallel group",
                        [r for r in ranks if r != st.rank], st.rank, st.config.timeout_s):
        dist.all_gather_object(prints, (shard_key, mine), group=st.group("data-parallel"))
    differ = _differences(prints, sharded)
    if not differ:
        return
    i = min(differ)
    j, name, why = differ[i]
    if st.rank == ranks[0]:
        warnings.warn(f"the data-parallel replicas of a stage held different weights when the model was partitioned "
                      f"(rank {ranks[i]}'s {name} differs from rank {ranks[j]}'s: {why}; rank(s) "
                      f"{', '.join(str(ranks[k]) for k in sorted(differ))} differ): every replica now holds the first "
                      "replica's, as SMP broadcasts them at partitioning. The ranks built the model from different "
                      "seeds or loaded different weights", ReplicasDifferWarning, stacklevel=2)
    with torch.no_grad(), named_failures("broadcasting the first replica's weights over the data-parallel group",
                                         [r for r in ranks if r != st.rank], st.rank, st.config.timeout_s):
        for n, p in model.local_named_parameters():
            if n in experts:  # from the first replica holding the same experts
                if len(st.edp_ranks) > 1:
                    dist.broadcast(p.data, src=st.edp_ranks[0], group=st.edp_group)
            elif not isinstance(p, DTensor):
                kind = "reduced-data-parallel" if n in sharded else "data-parallel"
                dist.broadcast(p.data, src=st.ranks(kind)[0], group=st.group(kind))
        for b in model.local_buffers():
            if not isinstance(b, DTensor):
                dist.broadcast(b, src=ranks[0], group=st.group("data-parallel"))
