"""A stage's sharding group as a pipeline is priced with it: its degree, threshold and link, the options its stages
are cut with, its ranks held to the memory budget, and what a plan or a simulation records of it.

Each stage's parameters are sharded over ``degree`` data-parallel replicas (SMP's ``sharded_data_parallel_degree``;
:func:`partitioner.sdp.shards.sharded_dp` prices what each rank holds and spends). The stages are cut as without
sharding (the partitioner counts parameters whole), but without the memory budget (:func:`cut_options`): the sharded
ranks are held to it instead (:func:`over_budget`). The group's collectives run on the plan's link within a node when
the replicas of a stage share one, else on the inter-node link (a ring is as slow as its slowest hop:
:func:`group_link`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..cost.devices import DeviceRates
from ..cut.options import PartitionOptions
from ..units import UNLIMITED
from .shards import PERSISTENCE_THRESHOLD, ShardedRank

__all__ = ["ShardingGroup", "group_link", "cut_options", "over_budget", "sharded_dp_record"]


@dataclass(frozen=True)
class ShardingGroup:
    """How a stage's parameters are sharded: over ``degree`` replicas (1: not sharded), a parameter of fewer than
    ``threshold`` elements kept whole, the collectives on ``link`` (its ``link_*`` rates; None: the plan's link
    within a node)."""

    degree: int
    threshold: int = PERSISTENCE_THRESHOLD
    link: DeviceRates | None = None


def group_link(rates: DeviceRates, degree: int, ranks_apart: int, ranks_per_node: int,
               inter: tuple[float, float] | None = None) -> DeviceRates:
    """The rates whose ``link_*`` a stage's sharding group runs on: ``rates``' link when the ``degree`` replicas,
    ``ranks_apart`` ranks apart, fit in ``ranks_per_node``; else the inter-node link (``inter``: its bandwidth in
    bytes per second and latency in seconds, default the rates')."""
    if degree * ranks_apart <= ranks_per_node:
        return rates
    bw, lat = inter or (rates.inter_node_bytes_per_s, rates.inter_node_latency_s)
    return replace(rates, link=rates.inter_node_link, link_bytes_per_s=bw, link_latency_s=lat)


def cut_options(options: PartitionOptions, degree: int) -> PartitionOptions:
    """The options the stages are cut with under sharding of ``degree``: ``options``, without the memory budget
    above 1 (the partitioner counts every parameter whole; :func:`over_budget` holds the sharded ranks to it)."""
    return options if degree == 1 else PartitionOptions.of(options, device_memory=UNLIMITED)


def over_budget(ranks: Sequence[ShardedRank], budget: float | None) -> ShardedRank | None:
    """The sharded rank of the largest peak when that peak exceeds ``budget`` bytes (None: every rank fits, or no
    budget)."""
    worst = max(ranks, key=lambda r: r.peak_bytes)
    return None if budget is None or worst.peak_bytes <= budget else worst


def sharded_dp_record(ranks: Sequence[ShardedRank], threshold: int, link: DeviceRates, budget: float | None,
                      step_s: float | None = None, bubble: float | None = None) -> dict[str, Any]:
    """What a plan or a simulation records of sharded data parallelism (JSON-ready): the degree, the replicas, the
    threshold, the link, the budget, each rank's :meth:`~partitioner.sdp.shards.ShardedRank.to_dict` and the
    predicted step with the collectives."""
    out = {"degree": ranks[0].degree, "replicas": ranks[0].replicas, "threshold": threshold,
           "link": {"name": link.link, "bytes_per_s": link.link_bytes_per_s, "latency_s": link.link_latency_s},
           "device_memory": budget, "ranks": [r.to_dict() for r in ranks]}
    if step_s is not None:
        out.update(predicted_step_s=step_s, bubble=bubble)
    return out
