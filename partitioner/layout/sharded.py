"""A layout's sharded data parallelism: the links of its sharding and replica groups, what the sdp gathers add to each
pass of its stages (:mod:`partitioner.sdp`), as :class:`partitioner.layout.score.LayoutScorer` prices it, and where a
degree above 1 would shard nothing (:func:`unsharded_tps`, :func:`shards_nothing`): the search leaves those out.
:class:`SdpCache` keeps a scorer's sdp prices per plan."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..capture.graph import OpGraph
from ..cost.devices import DeviceRates
from ..cut.plan import PartitionPlan
from ..sdp.overlap import StageCollectives, overlapped, stage_collectives
from ..sdp.shards import Shardable, ShardedRank, shardable, sharded_dp
from .costs import LayoutCosts
from .layout import Layout

__all__ = ["sdp_links", "sdp_passes", "unsharded_tps", "shards_nothing", "SdpCache"]


def sdp_links(layout: Layout, rates: DeviceRates, inter: DeviceRates,
              ranks_per_node: int) -> tuple[DeviceRates, DeviceRates]:
    """The links of ``layout``'s sharding group (sdp replicas) and of all its dp replicas: ``rates`` (within a node)
    when they share a node (replicas are pp x tp ranks apart under "DPT", tp under "PDT"), else ``inter``."""
    apart = layout.tp * (layout.pp if layout.placement == "DPT" else 1)
    link, replica_link = (rates if n * apart <= ranks_per_node else inter for n in (layout.sdp, layout.dp))
    return link, replica_link


def sdp_passes(layout: Layout, plan: PartitionPlan, graph: OpGraph, threshold: int, link: DeviceRates,
               forward_s: np.ndarray, backward_s: np.ndarray, overlap: bool,
               collectives: Callable[..., list[StageCollectives]] = stage_collectives
               ) -> tuple[np.ndarray | float, np.ndarray | float, np.ndarray | None]:
    """What ``layout``'s sharded data parallelism adds, per stage, to each microbatch's forward and backward of
    ``forward_s`` / ``backward_s``, and per pipeline rank after its pipeline (None: the reduce-scatter of
    :class:`partitioner.sdp.shards.ShardedRank`, not overlapped). With ``overlap`` (the runtime's prefetch),
    :func:`partitioner.sdp.overlap.overlapped`'s exposed seconds of the stages' ``collectives`` (what
    :func:`partitioner.sdp.overlap.stage_collectives` returns, or a cache of it); without, the stage's gathers whole
    in each pass, as on a device whose collectives share the ops' cores (a CPU: ``link.collectives_on_host``)."""
    if layout.sdp == 1:
        return 0.0, 0.0, None
    if not overlap or link.collectives_on_host:
        ranks = sharded_dp(plan, graph, layout.sdp, replicas=layout.dp, threshold=threshold, link=link)
        return (np.array([r.gather_forward_s for r in ranks]), np.array([r.gather_backward_s for r in ranks]), None)
    fwd, bwd, tail = overlapped(collectives(plan, graph, layout.sdp, threshold, link), forward_s, backward_s)
    return fwd, bwd, np.bincount(np.arange(layout.stages) % layout.pp, weights=tail, minlength=layout.pp)


def unsharded_tps(costs: LayoutCosts, threshold: int) -> dict[int, Shardable]:
    """The tp degrees of ``costs`` under which sharded data parallelism would shard nothing (tp rank 0's graph has
    no parameter of ``threshold`` elements or more), with what that graph has (:class:`Shardable`)."""
    found = {tp: shardable(next(iter(costs.lines[tp].traced.values())), threshold) for tp in costs.tp_degrees}
    return {tp: s for tp, s in found.items() if not s.over}


def shards_nothing(layout: Layout, plan: PartitionPlan, graph: OpGraph, threshold: int) -> bool:
    """Whether ``layout``'s sdp (above 1) shards none of the parameters of ``plan``'s stages: each is under
    ``threshold`` elements or used by several stages. Such a layout is its sdp 1 twin under another name."""
    return layout.sdp > 1 and not shardable(graph, threshold, plan.stage_of_ops(graph), plan.num_stages).sharded


class SdpCache:
    """A scorer's sharded-data-parallel prices of its plans, each worked out once: the layouts that share a plan (they
    differ in checkpointing, or in a placement that keeps the links) share its collectives and its ranks."""

    def __init__(self) -> None:
        self._found: dict[tuple, tuple[PartitionPlan, Any]] = {}  # key -> (the plan, kept alive while its id is a key)

    def collectives(self, plan: PartitionPlan, graph: OpGraph, degree: int, threshold: int,
                    link: DeviceRates) -> list[StageCollectives]:
        """:func:`partitioner.sdp.overlap.stage_collectives`, cached."""
        key = ("collectives", id(plan), degree, threshold, link)
        if key not in self._found:
            self._found[key] = plan, stage_collectives(plan, graph, degree, threshold, link)
        return self._found[key][1]

    def ranks(self, plan: PartitionPlan, graph: OpGraph, degree: int, **options: Any) -> list[ShardedRank]:
        """:func:`partitioner.sdp.shards.sharded_dp` with ``options``, cached."""
        key = ("ranks", id(plan), degree,
               *((k, tuple(v) if isinstance(v, (list, np.ndarray)) else v) for k, v in options.items()))
        if key not in self._found:
            self._found[key] = plan, sharded_dp(plan, graph, degree, **options)
        return self._found[key][1]
