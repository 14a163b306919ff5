"""A layout of a training job on N devices, and what it is predicted to cost: :class:`Layout` and :class:`Score`.

A layout is SMP v1's rank grid, pp x tp x rdp = N (SMP's data-parallel degree is tp x rdp: tensor parallelism is
carved out of the data-parallel ranks), of which ``sdp`` replicas shard their parameters (sharded data
parallelism, ZeRO-3 style: a degree dividing rdp) and ``ep`` replicas split each mixture-of-experts layer's experts
(expert parallelism, :mod:`partitioner.ep`: groups of ``ep`` consecutive replicas, as
:meth:`smp.runtime.topology.Topology.ep_grid` carves them) or ``cp`` replicas split every sequence of the batch they
share (context parallelism, :mod:`partitioner.cp`, carved alike), with how each replica runs its share of the global
batch:
its ``microbatches`` microbatches of ``microbatch_size`` samples, the pipeline schedule (:data:`SCHEDULES`: GPipe,
Huang et al. 2019; 1F1B, Narayanan et al. 2021; interleaved 1F1B over ``virtual_stages`` model chunks per rank,
Narayanan et al. SC'21; ZB-H1, Qi et al. 2023), activation checkpointing (:data:`CHECKPOINTING`), ZeRO-1
(Rajbhandari et al. SC'20: the optimizer state sharded over the rdp replicas) and the placement of the axes on
consecutive ranks (:data:`PLACEMENTS`, :mod:`smp.runtime.topology`'s orders with tp innermost, so that a tp group
shares a node's links). The search that chooses one is :mod:`partitioner.layout.search`; the prices come from
:mod:`partitioner.layout.score`.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

from ..cost.devices import DeviceRates

__all__ = ["Layout", "Score", "Proposal", "SCHEDULES", "CHECKPOINTING", "PLACEMENTS", "partition_pipeline",
           "global_rank", "replicas_share_node", "group_link"]

# The schedules a layout may run, by the names of `smp simulate --schedules` (pipeline.schedule accepts them all).
SCHEDULES = ("1f1b", "gpipe", "interleaved-virtual", "zero-bubble")
# Activation checkpointing as the runtime does it: per pipeline stage (pipeline.executor), every stage recomputing
# its forward in backward ("full"); it has no selective (per-op) recomputation.
CHECKPOINTING = ("none", "full")
# Axis orders, slowest-varying first: "DPT" is SMP's "cluster" (a replica's stages on adjacent ranks), "PDT" puts a
# stage's replicas next to each other (Megatron's order). Both keep a tp group on adjacent ranks.
PLACEMENTS = ("DPT", "PDT")


def partition_pipeline(schedule: str) -> str:
    """The pipeline a layout's stages are partitioned for (:class:`partitioner.PartitionOptions`): GPipe's memory for
    ``gpipe``, 1F1B's for the 1F1B family (interleaved and zero-bubble keep 1F1B's forward order)."""
    return "gpipe" if schedule == "gpipe" else "1f1b"


@dataclass(frozen=True)
class Layout:
    """One job: ``pp`` x ``tp`` x ``dp`` devices (``dp`` is SMP's rdp), ``sdp`` of the ``dp`` replicas sharding
    their parameters, each replica running ``microbatches`` microbatches of ``microbatch_size`` samples per step
    under ``schedule`` (``virtual_stages`` model chunks per rank for ``interleaved-virtual``), with
    ``checkpointing``, ``zero1`` and ``placement`` as the module docstring says; ``ep`` of the ``dp`` replicas split
    the experts (1: none); ``cp`` of them split the sequences of one batch (1: none; each group of ``cp`` runs the
    microbatches of one replica's share)."""

    pp: int
    tp: int
    dp: int
    microbatch_size: int
    microbatches: int
    schedule: str = "1f1b"
    virtual_stages: int = 1
    checkpointing: str = "none"
    zero1: bool = False
    placement: str = "DPT"
    sdp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "tp", "dp", "microbatch_size", "microbatches", "virtual_stages", "sdp", "ep", "cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{name} must be a positive integer, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Layout.schedule {self.schedule!r} is not known; use one of {SCHEDULES}")
        if (self.virtual_stages > 1) != (self.schedule == "interleaved-virtual"):
            raise ValueError(f"Layout: virtual_stages={self.virtual_stages} with schedule {self.schedule!r}; the "
                             "interleaved-virtual schedule needs virtual_stages >= 2, every other schedule 1")
        if self.schedule == "interleaved-virtual" and self.microbatches % self.pp:
            raise ValueError(f"Layout: interleaved-virtual needs microbatches % pp == 0, got microbatches="
                             f"{self.microbatches}, pp={self.pp}")
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"Layout.checkpointing {self.checkpointing!r} is not known; use one of {CHECKPOINTING}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"Layout.placement {self.placement!r} is not known; use one of {PLACEMENTS}")
        if self.dp % self.sdp:
            raise ValueError(f"Layout: sdp={self.sdp} must divide dp={self.dp} (the replicas that shard)")
        if self.zero1 and self.sdp > 1:
            raise ValueError("Layout: zero1 and sdp > 1 together; sharded data parallelism shards the optimizer "
                             "state already")
        if self.dp % self.ep:
            raise ValueError(f"Layout: ep={self.ep} must divide dp={self.dp} (the replicas that split the experts)")
        # The runtime refuses ep with sdp; ZeRO-1's optimizer shards over every replica, whose experts differ under ep.
        if self.ep > 1 and (self.sdp > 1 or self.zero1):
            raise ValueError(f"Layout: ep={self.ep} with {'sdp > 1' if self.sdp > 1 else 'zero1'}; expert parallelism "
                             "splits the experts over replicas that hold the other parameters and their optimizer "
                             "state whole")
        if self.dp % self.cp or (self.cp > 1 and (self.sdp > 1 or self.ep > 1)):
            raise ValueError(f"Layout: cp={self.cp} must divide dp={self.dp}, with sdp and ep 1 (the runtime refuses "
                             "context parallelism with them)")

    @property
    def devices(self) -> int:
        """pp x tp x dp."""
        return self.pp * self.tp * self.dp

    @property
    def stages(self) -> int:
        """Pipeline stages the model is cut into: pp x virtual_stages."""
        return self.pp * self.virtual_stages

    @property
    def replica_batch(self) -> int:
        """Samples one pipeline (one replica, a tp group) runs per step: microbatch_size x microbatches."""
        return self.microbatch_size * self.microbatches

    @property
    def groups(self) -> int:
        """Replicas that run batches of their own: dp / cp (a cp group runs one)."""
        return self.dp // self.cp

    @property
    def split(self) -> tuple[int, int]:
        """(ep, cp): how the graph each rank runs is split beside tp (what its costs are keyed by)."""
        return self.ep, self.cp

    @property
    def global_batch(self) -> int:
        """Samples per step over every replica (each cp group's once)."""
        return self.replica_batch * self.groups

    def state_shares(self) -> dict[str, int]:
        """By kind of parameter state, what divides it on a rank at best: ZeRO-1 the optimizer state by dp; sdp every
        kind by its degree, but the gradients, whole during the step unless there is one microbatch (all parameters
        sharded: the least memory sdp can give)."""
        if self.zero1:
            return {"optimizer": self.dp}
        if self.sdp == 1:
            return {}
        return {kind: self.sdp for kind in ("weights", "optimizer", "master")
                + (("gradients",) if self.microbatches == 1 else ())}

    def describe(self) -> str:
        """One short line: ``pp4 tp2 dp8, 16 x 2 samples, 1f1b`` (``pp2 tp2 ep8 dp64, ...`` with experts split)."""
        sched = f"{self.schedule} v={self.virtual_stages}" if self.virtual_stages > 1 else self.schedule
        extra = "".join(f", {x}" for x, on in (("checkpointing", self.checkpointing != "none"),
                                               ("zero1", self.zero1), (f"sdp{self.sdp}", self.sdp > 1)) if on)
        ep = f" ep{self.ep}" if self.ep > 1 else f" cp{self.cp}" if self.cp > 1 else ""
        return (f"pp{self.pp} tp{self.tp}{ep} dp{self.dp}, {self.microbatches} x {self.microbatch_size} samples, "
                f"{sched}{extra}, {self.placement}")

    def to_dict(self) -> dict[str, Any]:
        """The fields, JSON-ready."""
        return asdict(self)


@dataclass(frozen=True)
class Score:
    """What a layout is predicted to cost per step (:mod:`partitioner.layout.score`).

    ``step_s``: the step; ``pipeline_s``: its simulated pipeline, to which the data-parallel gradient reduction after
    it adds ``dp_comm_s`` (exposed) and the optimizer step after that ``optimizer_s``
    (:mod:`partitioner.cost.optimizer_step`: each rank's after its own reduction, to the latest one's end).
    ``samples_per_s`` / ``tokens_per_s`` (None without token ids): over every replica. ``flops_per_s_per_device``
    and ``mfu``: model FLOP/s per device and MFU, by :mod:`partitioner.cost.throughput`'s one definition (None
    without a peak). ``memory_bytes``: the largest device's peak; ``budget_bytes``: what it must fit (None: no
    limit). ``bubble``: the simulated pipeline's idle fraction. ``exposed_comm_s``: how much longer the step is than
    the same step with free communication (stage sends, tp collectives and the gradient reduction; not the optimizer
    step). ``tp_comm_s``: the tp collectives (with the expert all-to-alls under ep) per step on the busiest rank.
    """

    step_s: float
    pipeline_s: float
    dp_comm_s: float
    samples_per_s: float
    tokens_per_s: float | None
    flops_per_s_per_device: float
    mfu: float | None
    memory_bytes: int
    budget_bytes: float | None
    bubble: float
    exposed_comm_s: float
    tp_comm_s: float
    parameter_bytes: int = 0  # of the largest device: weights, gradients, optimizer state, master weights
    activation_bytes: int = 0  # of the largest device: activations held at its peak
    optimizer_s: float = 0.0

    @property
    def fits(self) -> bool:
        """The largest device's peak is within the budget."""
        return self.budget_bytes is None or self.memory_bytes <= self.budget_bytes

    def to_dict(self) -> dict[str, Any]:
        """The fields, JSON-ready."""
        return asdict(self)


@dataclass(frozen=True)
class Proposal:
    """A layout with its score; ``to_dict`` is one row of ``smp plan --json``'s ``layouts``."""

    layout: Layout
    score: Score

    def to_dict(self) -> dict[str, Any]:
        """The layout's fields and the score's, in one flat dict."""
        return {**self.layout.to_dict(), **self.score.to_dict()}


def global_rank(layout: Layout, pipe_rank: int, replica: int, tp_rank: int = 0) -> int:
    """The global rank of (pipeline rank, dp replica, tp rank) under the layout's placement (tp fastest)."""
    pp, tp, dp = layout.pp, layout.tp, layout.dp
    if layout.placement == "DPT":
        return (replica * pp + pipe_rank) * tp + tp_rank
    return (pipe_rank * dp + replica) * tp + tp_rank


@functools.lru_cache(maxsize=4096)
def replicas_share_node(pp: int, tp: int, dp: int, placement: str, ranks_per_node: int) -> tuple[bool, ...]:
    """Per pipeline rank, whether its dp replicas (tp rank 0) are all on one node: the first and the last replica's
    ranks are (placement puts them in order)."""
    probe = Layout(pp=pp, tp=tp, dp=dp, microbatch_size=1, microbatches=pp, placement=placement)
    return tuple(global_rank(probe, r, 0) // ranks_per_node == global_rank(probe, r, dp - 1) // ranks_per_node
                 for r in range(pp))


def group_link(layout: Layout, rates: DeviceRates, inter: DeviceRates, ranks_per_node: int) -> DeviceRates | None:
    """The link ``layout``'s ep or cp groups (consecutive replicas) cross when it is not the one within a node
    (``inter``), else None (``rates``' own link, the one :meth:`partitioner.layout.costs.LayoutCosts.costs` prices
    by default): replicas are pp x tp ranks apart under "DPT", tp under "PDT"."""
    apart = layout.tp * (layout.pp if layout.placement == "DPT" else 1)
    size = max(layout.ep, layout.cp)
    return inter if size > 1 and size * apart > ranks_per_node else None
