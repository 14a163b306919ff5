"""Sharded data parallelism (SMP v1's ``sharded_data_parallel_degree``): what each pipeline rank holds and what the
sharding costs per step.

Each stage's parameters are sharded over ``degree`` (D) of its data-parallel replicas, ZeRO stage 3 (Rajbhandari et
al. 2020, "ZeRO: Memory optimizations toward training trillion parameter models", SC'20, section 5.3; PyTorch FSDP,
Zhao et al. 2023, VLDB 16(12)), as :mod:`smp.engine.sharded_dp` runs it. A parameter of at least ``threshold``
elements (SMP's ``sdp_param_persistence_threshold``) that only one stage uses is sharded; the rest (small ones, tied
weights used on two stages; buffers are not parameters) stay whole on every replica and are all-reduced as in plain
data parallelism. The sharded parameters are gathered and reduced a unit at a time (:mod:`partitioner.sdp.units`: a
block of the model's layer list, one flat collective each): a unit is all-gathered where the stage first reads it,
the next one prefetched meanwhile, and gathered again in the backward: two all-gathers per unit and microbatch, but
one per step for a stage's last unit (of two or more), kept whole from its forward to the step's end. Its
gradients accumulate whole over the step's microbatches and are reduce-scattered once per step, in the stage's last
backward as soon as they are complete, two units at most in flight: with one microbatch only the units in flight are
whole, with more every sharded gradient of the stage is whole until that last backward. With ``replicas`` (R) above D
(hybrid sharding) each shard's gradient is then all-reduced over the R / D groups.

Per rank (:class:`ShardedRank`): weights, optimizer state and fp32 master weights of sharded parameters / D; their
gradients / D at rest and whole during the step (with the reduce-scatters' buffers); what the gathering holds at once
(:func:`partitioner.sdp.units.gathered_peak`: the whole parameters still read and the all-gather buffers of the unit
being copied out or prefetched); activations as without sharding (:func:`partitioner.stage_memory`). Bytes per
parameter by kind are :func:`partitioner.cost.precision.param_memory_parts`'s. Collectives are ring algorithms priced
with :func:`partitioner.cost.collectives.all_gather_s` (a reduce-scatter moves the same bytes in the same steps) and
:func:`partitioner.cost.collectives.all_reduce_s` on the ``link`` of the sharding group: one collective per unit, one
coalesced all-reduce of the whole parameters' gradients, with its copies
(:func:`partitioner.cost.collectives.gradient_all_reduce_s`, as the engine averages data-parallel gradients). The
seconds here are the collectives' own; what of them the runtime's prefetch hides behind compute is
:mod:`partitioner.sdp.overlap`'s.

A degree that shards nothing (every parameter under the threshold, or used by two stages) changes nothing but the
name: :func:`shardable` says what a degree would shard (:class:`Shardable`), the layout search leaves such a degree
out, and a run warns once (:func:`warn_if_nothing_sharded`, :class:`ShardsNothingWarning`).
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..capture.graph import OpGraph
from ..cost.collectives import all_gather_s, all_reduce_s, gradient_all_reduce_s
from ..cost.devices import DeviceRates
from ..cost.precision import param_memory_parts
from ..cut.memory import stage_memory
from ..cut.objective import stage_params
from ..cut.plan import PartitionPlan
from .units import gathered_peak, keeps_last, padded, parameters, stage_units

__all__ = ["PERSISTENCE_THRESHOLD", "ShardedRank", "sharded_params", "sharded_dp", "Shardable",
           "shardable", "warn_if_nothing_sharded", "ShardsNothingWarning"]

PERSISTENCE_THRESHOLD = 1_000_000  # SMP v1's default sdp_param_persistence_threshold, in elements
_FP32_BYTES = 4


@dataclass(frozen=True)
class ShardedRank:
    """What one pipeline rank holds and spends under sharded data parallelism of ``degree`` over ``replicas``.

    Bytes at the training precision: ``weights_bytes``, ``gradient_bytes`` (at rest: the shards),
    ``gradient_peak_bytes`` (during the step's last backward: whole, and the reduce-scatters' buffers),
    ``optimizer_bytes``, ``master_bytes``, ``gathered_bytes`` (what the gathering holds at once: whole parameters and
    all-gather buffers; ``gathered`` names the parameters whole or being gathered at that peak) and
    ``activation_bytes`` (at the schedule's peak in flight). ``sharded``: parameters sharded, of ``params`` the
    rank's stages hold. Seconds: ``gather_forward_s`` / ``gather_backward_s`` per microbatch, ``reduce_scatter_s``
    and ``all_reduce_s`` once per step, for ``microbatches`` per step."""

    rank: int
    stages: tuple[int, ...]
    degree: int
    replicas: int
    params: int
    sharded: int
    weights_bytes: int
    gradient_bytes: int
    gradient_peak_bytes: int
    optimizer_bytes: int
    master_bytes: int
    gathered_bytes: int
    activation_bytes: int
    gathered: tuple[str, ...]
    gather_forward_s: float
    gather_backward_s: float
    reduce_scatter_s: float
    all_reduce_s: float
    microbatches: int

    @property
    def peak_bytes(self) -> int:
        """Everything at once: the shards, whole gradients, optimizer state, gathered copies and activations."""
        return (self.weights_bytes + self.gradient_peak_bytes + self.optimizer_bytes + self.master_bytes
                + self.gathered_bytes + self.activation_bytes)

    @property
    def all_gather_s(self) -> float:
        """Seconds of all-gathers per step: forward and backward, every microbatch."""
        return self.microbatches * (self.gather_forward_s + self.gather_backward_s)

    @property
    def end_of_step_s(self) -> float:
        """Seconds of the reduce-scatter and all-reduce after the step's last backward."""
        return self.reduce_scatter_s + self.all_reduce_s

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with the derived totals."""
        return {**asdict(self), "stages": list(self.stages), "gathered": list(self.gathered),
                "peak_bytes": self.peak_bytes, "all_gather_s": self.all_gather_s}


def sharded_params(graph: OpGraph, stage: np.ndarray, num_stages: int, degree: int,
                   threshold: int = PERSISTENCE_THRESHOLD) -> np.ndarray:
    """Per parameter, whether ``degree``-way sharding splits it: an ``nn.Parameter`` (frozen ones too; not a buffer)
    of at least ``threshold`` elements that one stage uses (none for degree 1). A graph without its traced program
    (:meth:`OpGraph.load`) knows only its trainable parameters, and their bytes as fp32 elements."""
    if degree <= 1 or not len(graph.param_names):
        return np.zeros(len(graph.param_names), bool)
    numel = _numels(graph)
    return (numel >= max(threshold, 1)) & (_holders(graph, stage, num_stages) == 1)


def _numels(graph: OpGraph) -> np.ndarray:
    """Elements of each of ``graph``'s parameters (0 for a buffer: never sharded)."""
    if graph.fx is not None:
        named = parameters(graph.fx.module)
        return np.array([named[n].numel() if n in named else 0 for n in graph.param_names], np.int64)
    return np.where(np.asarray(graph.param_trainable, bool), np.asarray(graph.param_bytes, np.int64) // _FP32_BYTES, 0)


def _holders(graph: OpGraph, stage: np.ndarray, num_stages: int) -> np.ndarray:
    """How many stages use each of ``graph``'s parameters."""
    _, p_idx = stage_params(graph, np.asarray(stage, np.int64), num_stages)
    return np.bincount(p_idx, minlength=len(graph.param_names))


@dataclass(frozen=True)
class Shardable:
    """What sharding (a degree above 1) shards of a model's ``params`` parameters at ``threshold`` elements (SMP's
    ``sdp_param_persistence_threshold``): ``over`` have that many elements or more, of which ``shared`` are used by
    several stages (kept whole); ``largest`` names the largest parameter under the threshold, with ``largest_numel``
    elements (None: none is), ``shared_names`` the shared ones; ``sharded_numel`` of their ``numel`` elements are
    sharded."""

    params: int
    over: int
    shared: int
    threshold: int
    largest: str | None
    largest_numel: int
    shared_names: tuple[str, ...] = ()
    numel: int = 0
    sharded_numel: int = 0

    @property
    def whole_share(self) -> float:
        """The share of the parameters' ``numel`` elements that stay whole on every replica (under the threshold,
        or shared); 0 without parameters."""
        return 1.0 - self.sharded_numel / self.numel if self.numel else 0.0

    @property
    def sharded(self) -> int:
        """Parameters sharded."""
        return self.over - self.shared

    def why_none(self) -> str:
        """Why nothing is sharded (when :attr:`sharded` is 0), with the numbers, for a message that goes on."""
        which = "the largest" if not self.over else "the largest of the others"
        below = f" ({which}, {self.largest}, has {self.largest_numel:,})" if self.largest else ""
        if not self.over:
            return f"none of the model's {self.params} parameters has {self.threshold:,} elements or more{below}"
        return (f"the {self.over} of the model's {self.params} parameters with {self.threshold:,} elements or more "
                f"({', '.join(self.shared_names[:3])}{', ...' if self.shared > 3 else ''}) are used by several "
                f"stages, which keep them whole{below}")


def shardable(graph: OpGraph, threshold: int = PERSISTENCE_THRESHOLD, stage: np.ndarray | None = None,
              num_stages: int = 1) -> Shardable:
    """What sharding shards of ``graph``'s parameters at ``threshold`` elements (:class:`Shardable`), each op of the
    graph on ``stage`` of ``num_stages`` (default: one stage, none shared)."""
    numel = _numels(graph)
    over = numel >= max(threshold, 1)
    held = _holders(graph, np.zeros(graph.num_nodes, np.int64) if stage is None else stage, num_stages)
    shared = over & (held > 1)
    under = np.where(over, -1, numel)
    i = int(np.argmax(under)) if len(under) else 0
    big = len(under) > 0 and under[i] > 0
    return Shardable(params=int((numel > 0).sum()), over=int(over.sum()), shared=int(shared.sum()),
                     threshold=int(threshold), largest=graph.param_names[i] if big else None,
                     largest_numel=int(under[i]) if big else 0,
                     shared_names=tuple(graph.param_names[j] for j in np.flatnonzero(shared)),
                     numel=int(numel.sum()), sharded_numel=int(numel[over & ~shared].sum()))


def warn_if_nothing_sharded(plan: PartitionPlan, degree: int, threshold: int) -> Shardable | None:
    """Warn (:class:`ShardsNothingWarning`, once) when ``sharded_data_parallel_degree=degree`` shards none of
    ``plan``'s parameters at ``sdp_param_persistence_threshold=threshold``; what it shards, or None for degree 1."""
    if degree <= 1:
        return None
    graph = plan.traced_graph()
    found = shardable(graph, threshold, plan.stage_of_ops(graph), plan.num_stages)
    if not found.sharded:
        fix = (f"set sdp_param_persistence_threshold to {found.largest_numel:,} or less in the smp config (parameters "
               "of that many elements or more are sharded), or " if found.largest else "")
        warnings.warn(f"sharded_data_parallel_degree={degree} shards nothing at sdp_param_persistence_threshold="
                      f"{threshold:,}: {found.why_none()}. Every parameter stays whole on every replica and is "
                      f"all-reduced as under plain data parallelism: sharding saves no memory. Fix: {fix}drop "
                      "sharded_data_parallel_degree", ShardsNothingWarning, stacklevel=2)
    return found


class ShardsNothingWarning(UserWarning):
    """Sharded data parallelism was asked for, but no parameter is sharded; the message says why and the fix."""


def sharded_dp(plan: PartitionPlan, graph: OpGraph, degree: int, *, replicas: int | None = None,
               threshold: int = PERSISTENCE_THRESHOLD, link: DeviceRates | None = None,
               replica_link: DeviceRates | None = None, stage_rank: Sequence[int] | None = None,
               in_flight: Sequence[int] | None = None) -> list[ShardedRank]:
    """Per pipeline rank of ``plan`` (made from ``graph``; ``stage_rank``: each stage's rank, default stage s on
    rank s), what it holds and spends with its stages' parameters sharded over ``degree`` of ``replicas``
    data-parallel replicas (default ``degree``), at the plan's dtype and optimizer. ``link``: the sharding group's
    (its ``link_*`` rates; default the plan's link within a node); ``replica_link``: the all-reduce's across the
    groups and of the whole parameters over all replicas (default ``link``). ``in_flight``: as
    :func:`partitioner.stage_memory`'s. Degree 1 holds what :func:`partitioner.stage_memory` counts."""
    replicas = degree if replicas is None else replicas
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ValueError(f"the sharded data-parallel degree must be a positive integer (1: no sharding), got "
                         f"{degree!r}")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1 or replicas % degree:
        raise ValueError(f"the sharded data-parallel degree {degree} must divide the data-parallel degree "
                         f"{replicas!r} (ranks holding a replica of each stage): choose a divisor of {replicas!r}")
    k, opts = plan.num_stages, plan.options
    stage_rank = list(range(k)) if stage_rank is None else [int(r) for r in stage_rank]
    if len(stage_rank) != k:
        raise ValueError(f"stage_rank has {len(stage_rank)} entries for {k} stages: give each stage's rank")
    device = DeviceRates.from_dict(plan.rates)
    link = link or device
    replica_link = replica_link or link
    stage = plan.stage_of_ops(graph)
    shard = sharded_params(graph, stage, k, degree, threshold)
    parts = param_memory_parts(graph, opts.get("dtype", "fp32"), opts.get("optimizer", "adam"))
    mems = stage_memory(plan, graph, in_flight)
    p_stage, p_idx = stage_params(graph, stage, k)
    order = np.argsort(stage, kind="stable")  # each stage's ops in forward (index) order
    bounds = np.searchsorted(stage[order], np.arange(k + 1))
    pad = padded(graph, degree)
    rows = []
    for s in range(k):
        held = p_idx[p_stage == s]
        mine, whole = held[shard[held]], held[~shard[held]]
        ops, grads = order[bounds[s]:bounds[s + 1]], parts["gradients"]
        units = stage_units(graph, ops, mine, parts["weights"], grads, pad)
        gathered, alive = gathered_peak(graph, ops, units, parts["weights"], degree)
        rows.append(_Stage(
            at_rest={name: float(parts[name][whole].sum()) + float(parts[name][mine].sum()) / degree
                     for name in ("weights", "gradients", "optimizer", "master")},
            gradient_peak=float(grads[whole].sum()) + _gradient_peak(units.gradients, degree,
                                                                     opts.get("microbatches", 1) == 1),
            gathered=gathered, alive=alive, kept=units.weights[-1] if keeps_last(len(units.weights)) else 0.0,
            gathers_s=[all_gather_s(w, degree, link) for w in units.weights],
            scatter_s=float(sum(all_gather_s(g, degree, link) for g in units.gradients)),
            # The whole parameters' gradients over every replica, then each shard's over the R / D groups.
            reduce_s=(gradient_all_reduce_s(float(grads[whole].sum()), replicas, device, replica_link)
                      + all_reduce_s(float(grads[mine].sum()) / degree, replicas // degree, replica_link)),
            params=len(held), sharded=len(mine), activations=mems[s].activation_bytes))
    return [_rank(r, [s for s in range(k) if stage_rank[s] == r], rows, graph, degree, replicas,
                  int(opts.get("microbatches", 1)))
            for r in sorted(set(stage_rank))]


def _gradient_peak(grads: Sequence[float], degree: int, one: bool) -> float:
    """The most bytes a stage's sharded gradients (``grads`` per unit, in forward order) hold in the step's last
    backward, which reduce-scatters each unit once complete, two at most in flight (:mod:`pipeline.param_gather`):
    the shards, and the unit launched laid out twice (whole and as the reduce-scatter's input) beside the input of
    the one still in flight; with several microbatches (not ``one``) every unit is whole from the earlier ones."""
    if not grads:
        return 0.0
    launched = max(2 * g + (grads[i + 1] if i + 1 < len(grads) else 0.0) for i, g in enumerate(grads)) if one \
        else max(grads) + sum(grads)
    return sum(grads) / degree + launched


@dataclass(frozen=True)
class _Stage:
    """One stage's part of its rank's :class:`ShardedRank`."""

    at_rest: dict[str, float]
    gradient_peak: float
    gathered: float
    alive: list[int]
    kept: float  # its last unit, whole all step (beside another stage's gathers on the same rank)
    gathers_s: list[float]  # per unit, in forward order
    scatter_s: float
    reduce_s: float
    params: int
    sharded: int
    activations: int

    def gather_s(self, microbatches: int) -> tuple[float, float]:
        """Seconds of all-gathers per microbatch's forward and backward: every unit but the last (of two or more),
        gathered once a step and kept whole to the step's end (:func:`partitioner.sdp.units.gathered_peak`)."""
        if not keeps_last(len(self.gathers_s)):
            return sum(self.gathers_s), sum(self.gathers_s)
        rest = sum(self.gathers_s[:-1])
        return rest + self.gathers_s[-1] / microbatches, rest


def _rank(rank: int, stages: list[int], rows: list[_Stage], graph: OpGraph, degree: int, replicas: int,
          microbatches: int) -> ShardedRank:
    """One rank's :class:`ShardedRank` from its stages': bytes and seconds add up, the gathered copies are one
    stage's at a time (a rank runs one op at a time) beside the other stages' last units, kept whole all step."""
    mine = [rows[s] for s in stages]
    kept = sum(row.kept for row in mine)
    peak = max(mine, key=lambda row: row.gathered - row.kept)

    def rest(name: str) -> int:
        return round(sum(row.at_rest[name] for row in mine))

    forward, backward = (sum(pair) for pair in zip(*(row.gather_s(microbatches) for row in mine)))
    return ShardedRank(
        rank=rank, stages=tuple(stages), degree=degree, replicas=replicas, params=sum(row.params for row in mine),
        sharded=sum(row.sharded for row in mine), weights_bytes=rest("weights"), gradient_bytes=rest("gradients"),
        gradient_peak_bytes=round(sum(row.gradient_peak for row in mine)), optimizer_bytes=rest("optimizer"),
        master_bytes=rest("master"), gathered_bytes=round(peak.gathered - peak.kept + kept),
        activation_bytes=sum(row.activations for row in mine), gathered=tuple(graph.param_names[p] for p in peak.alive),
        gather_forward_s=forward, gather_backward_s=backward, reduce_scatter_s=sum(row.scatter_s for row in mine),
        all_reduce_s=sum(row.reduce_s for row in mine), microbatches=microbatches)
