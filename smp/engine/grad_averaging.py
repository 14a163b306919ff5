"""A step's gradients averaged over the data-parallel replicas of each stage, overlapped with its backward.

SMP v1 averaged them as torch's DDP does, in buckets all-reduced while the backward runs (``overlapping_allreduce``,
``bucket_cap_mb``: its ``smp.DistributedModel`` arguments, and the config key); so does this engine, with
:class:`pipeline.grad_buckets.GradBuckets` (DDP's Reducer; Li et al. 2020, "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB, arXiv:2006.15704). Whole parameters average over the "data-parallel"
group, a tensor-parallel rank's shards over the "reduced-data-parallel" group (the replicas of that shard), an
expert-parallel rank's experts over the ranks holding the same experts, divided by every replica; sharded
data parallelism's DTensor shards are reduce-scattered by :mod:`pipeline.param_gather` instead. With
``overlapping_allreduce`` False every group's gradients go in one all-reduce per dtype after the backward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline import PipelineRunner
from pipeline.grad_buckets import DEFAULT_BUCKET_CAP_MB, GradBuckets, ReduceCount, ReduceGroup
from pipeline.p2p import named_failures
from pipeline.param_gather import is_sharded
from smp.runtime.state import State

__all__ = ["GradAveraging"]


@dataclass(eq=False)
class GradAveraging:
    """How one model averages its gradients over its replicas (``overlap``, ``bucket_cap_mb``: SMP v1's
    ``DistributedModel`` arguments), and the reducer of its current runner."""

    overlap: bool = True
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    buckets: GradBuckets | None = None
    _runner: PipelineRunner | None = None

    def __post_init__(self) -> None:
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of megabytes, got {self.bucket_cap_mb!r}")

    @property
    def last(self) -> ReduceCount | None:
        """What the last training step moved on this rank (None before one ran with replicas)."""
        return self.buckets.last if self.buckets is not None else None

    def begin(self, st: State, runner: PipelineRunner, params: list[tuple[str, torch.nn.Parameter]],
              shards: set[int], call: str) -> None:
        """Before a training step's backward (with data-parallel replicas): announce the averaging on its groups,
        build the reducer when the runner is new (``params``: this rank's trainable parameters by name; ``shards``:
        the ids of those tensor parallelism split), and hand it to the executor of the step's shape class."""
        if self._runner is not runner:
            if self.buckets is not None:
                self.buckets.close()
            self.buckets, self._runner = self._reducer(st, runner, params, shards), runner
        assert self.buckets is not None
        for kind in self._kinds(st):
            st.calls[kind].announce(call)
        self.buckets.arm()
        runner.executor.grad_buckets = self.buckets if self.buckets.overlap else None

    def end(self, st: State, runner: PipelineRunner, params: list[torch.nn.Parameter]) -> None:
        """After the step's backward: sharded parameters' gradients reduce-scattered (sharded data parallelism),
        then every bucket waited for and its average copied back."""
        assert self.buckets is not None  # begin() ran
        if runner.gather is not None:  # sharded parameters: their whole gradients reduce-scattered, once per step
            with named_failures("reducing the sharded gradients over the sharded-data-parallel replicas",
                                [r for r in st.ranks("reduced-data-parallel") if r != st.rank], st.rank,
                                st.config.timeout_s):
                runner.gather.reduce_gradients(params)
        self.buckets.finish()

    def _kinds(self, st: State) -> list[str]:
        return ["data-parallel"] + (["reduced-data-parallel"] if st.topology.tp > 1 and st.topology.rdp > 1 else [])

    def _reducer(self, st: State, runner: PipelineRunner, params: list[tuple[str, torch.nn.Parameter]],
                 shards: set[int]) -> GradBuckets:
        """The buckets of ``params`` but DTensor shards: a tensor-parallel rank's ``shards`` over the replicas of the
        shard, whole parameters over every replica of the stage."""
        prog = runner.plan.traced_graph().fx
        experts = set(prog.experts.params) if prog.experts is not None else set()
        # sequence parallelism's weights read whole: partial sums on each tp rank, summed with the average
        partial = set(prog.sharding.deferred) if prog.sharding is not None else set()
        whole = [(n, p) for n, p in params if not is_sharded(p)]
        groups = [ReduceGroup(kind, st.group(kind), [r for r in st.ranks(kind) if r != st.rank],
                              [(n, p) for n, p in whole if n not in experts and n not in partial
                               and (id(p) in shards) == (kind == "reduced-data-parallel")])
                  for kind in self._kinds(st)]
        if partial:  # summed over the tp ranks (and the replicas) of the data-parallel group, averaged over replicas
            groups.append(ReduceGroup("data-parallel", st.group("data-parallel"),
                                      [r for r in st.ranks("data-parallel") if r != st.rank],
                                      [(n, p) for n, p in whole if n in partial], divisor=st.topology.rdp))
        if experts:  # an ep rank's experts: their gradients sum its ep group's tokens, then the other ep groups'
            groups.append(ReduceGroup("expert-data-parallel", st.edp_group, [r for r in st.edp_ranks if r != st.rank],
                                      [(n, p) for n, p in whole if n in experts], divisor=st.topology.rdp))
        overlap = self.overlap and st.config.overlapping_allreduce
        return GradBuckets(groups, runner.local_stages, _summed_across_ranks(runner), st.rank, st.config.timeout_s,
                           self.bucket_cap_mb, overlap)


def _summed_across_ranks(runner: PipelineRunner) -> set[int]:
    """Ids of this rank's parameters that other ranks of its pipeline hold too (tied weights on stages of several
    ranks): the runner sums their gradients across those ranks after the backward."""
    stage_rank = runner.schedule.stage_to_rank
    shared = {name for name, stages in runner.plan.shared_params.items() if len({stage_rank[s] for s in stages}) > 1}
    out = set()
    for st in runner.local_stages:
        params = dict(st.module.named_parameters(remove_duplicate=False))
        out |= {id(params[path]) for path, name in st.param_names.items() if name in shared and path in params}
    return out
