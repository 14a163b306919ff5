"""Data-parallel gradients averaged in buckets while the backward runs: DDP's Reducer, over a pipeline's stages.

PyTorch's ``DistributedDataParallel`` (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB, arXiv:2006.15704) hides the gradient all-reduce behind the backward: parameters are put in
buckets of about ``bucket_cap_mb`` (25 MB; the first bucket 1 MB, so the first all-reduce starts early) in the
reverse order of their use in forward, the order their gradients become final; a gradient hook marks each parameter
ready, and a bucket whose parameters are all ready is all-reduced asynchronously at once, buckets strictly in their
order so that every replica issues the same collectives in the same order; before the optimizer steps, the step
waits for every bucket and copies the averages back.

:class:`GradBuckets` does so for one rank's stages. Under a pipeline a parameter's gradient is final only in its
stage's last backward of the step (the last microbatch's; the pipeline executor says which backward that is, the
signal the sharded parameters of :mod:`pipeline.param_gather` reduce by): in that backward, torch's
``register_post_accumulate_grad_hook`` marks a parameter ready once every local stage that reads it has
accumulated its gradient, and the end of the pass marks ready what no gradient reached (zero, as a parameter the
step did not use). The exceptions are launched when the step ends (:meth:`GradBuckets.finish`), in buckets of their
own after the others: a parameter another rank of the pipeline also holds (tied embeddings), whose gradient the
runner sums across those ranks after the backward, and one no local stage reads. Each bucket sums and divides its
gradients as one blocking all-reduce of every gradient would (bit for bit the same over two replicas; over more, the
collective's ring may add the replicas in another order); without ``overlap`` that is what happens: one bucket per
dtype, all-reduced when the step ends.

:attr:`GradBuckets.last` counts what a step moved: collectives, bytes, and how many were launched during the
backward.
"""
from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from partitioner.capture.stage_modules import Stage
from pipeline.p2p import named_failures

__all__ = ["GradBuckets", "ReduceGroup", "ReduceCount", "DEFAULT_BUCKET_CAP_MB", "FIRST_BUCKET_CAP_MB"]

DEFAULT_BUCKET_CAP_MB = 25.0  # DDP's bucket_cap_mb (and SMP v1's DistributedModel(bucket_cap_mb=25))
FIRST_BUCKET_CAP_MB = 1.0     # DDP's first bucket (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES)
_MB = 1024 * 1024


@dataclass(frozen=True)
class ReduceGroup:
    """Parameters whose gradients are averaged over one process group: ``kind`` names the group in errors
    ("data-parallel"), ``peers`` are its other global ranks, ``params`` its parameters by name, ``divisor`` what the
    sum is divided by when it is not the group's size (an expert's gradient already sums its ep group's tokens)."""

    kind: str
    group: Any
    peers: list[int]
    params: list[tuple[str, torch.nn.Parameter]]
    divisor: int = 0  # what the sums are divided by (0: the group's size); experts' sums cover more replicas


class ReduceCount(NamedTuple):
    """What one step's averaging moved on this rank: all-reduces, their bytes, and how many of them were launched
    while the backward ran (the rest when the step ended)."""

    collectives: int
    nbytes: int
    in_backward: int


@dataclass(eq=False)
class _Bucket:
    params: list[torch.nn.Parameter]
    late: bool                                # launched only when the step ends
    waiting: int = 0                          # its parameters not ready yet this step
    grads: list[torch.Tensor] = field(default_factory=list)
    flat: torch.Tensor | None = None
    work: Any = None


@dataclass(eq=False)
class _Channel:
    """One group's buckets, launched strictly in order: ``next`` is the first not launched yet."""

    group: ReduceGroup
    buckets: list[_Bucket]
    next: int = 0


class GradBuckets:
    """DDP's reducer over ``groups`` for the local ``stages`` of one pipeline rank (see the module docstring).
    ``late``: ids of parameters whose gradients change after the backward (summed across pipeline ranks).
    ``cap_mb``: the bucket size; ``overlap=False``: one bucket per dtype, all-reduced when the step ends.
    The executor calls :meth:`final_pass` and :meth:`stage_done`; the step calls :meth:`arm` before its backward
    and :meth:`finish` after it."""

    def __init__(self, groups: Sequence[ReduceGroup], stages: Sequence[Stage], late: set[int], rank: int,
                 timeout_s: float, cap_mb: float = DEFAULT_BUCKET_CAP_MB, overlap: bool = True):
        self.rank, self.timeout_s, self.overlap = rank, timeout_s, overlap
        self._stage_params = {s.index: _forward_use(s) for s in stages}
        self._holders: dict[int, set[int]] = {}  # id(param) -> local stages that read it
        order: dict[int, int] = {}               # id(param) -> its place in the order of first use in forward
        for index in sorted(self._stage_params):
            for p in self._stage_params[index]:
                self._holders.setdefault(id(p), set()).add(index)
                order.setdefault(id(p), len(order))
        self._names: dict[int, str] = {}
        self._channels: list[_Channel] = []
        for g in groups:
            self._names.update((id(p), n) for n, p in g.params)
            early = [p for _, p in g.params if overlap and id(p) in order and id(p) not in late]
            early.sort(key=lambda p: -order[id(p)])  # backward order: the last used in forward first
            taken = {id(p) for p in early}
            rest = [p for _, p in g.params if id(p) not in taken]
            cap, first = (cap_mb, FIRST_BUCKET_CAP_MB) if overlap else (float("inf"), float("inf"))
            self._channels.append(_Channel(g, [_Bucket(ps, False) for ps in _assign(early, cap, first)] +
                                           [_Bucket(ps, True) for ps in _assign(rest, cap, first)]))
        self._bucket_of = {id(p): (c, b) for c in self._channels for b in c.buckets for p in b.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulated)
                       for c in self._channels for b in c.buckets if not b.late for p in b.params]
        self._armed = False
        self._running: int | None = None  # the local stage whose last backward of the step is running
        self._done: dict[int, set[int]] = {}  # id(param) -> local stages whose last backward delivered its gradient
        self.last = ReduceCount(0, 0, 0)

    @property
    def buckets(self) -> list[list[int]]:
        """Each bucket's parameter sizes (elements), every group's in launch order."""
        return [[p.numel() for p in b.params] for c in self._channels for b in c.buckets]

    # -- the step's side ----------------------------------------------------------------------------------------
    def arm(self) -> None:
        """A training step begins: from now on the stages' last backwards launch buckets as they fill."""
        self._armed, self._running, self._done = True, None, {}
        for c in self._channels:
            c.next = 0
            for b in c.buckets:
                b.waiting = 0 if b.late else len(b.params)
                b.grads, b.flat, b.work = [], None, None

    def finish(self) -> ReduceCount:
        """Launch what is left (in bucket order), wait for every bucket (bounded by ``timeout_s``, a failure naming
        the ranks), and leave each parameter's average in its ``.grad`` (zero where no gradient came)."""
        every = [(c, b) for c in self._channels for b in c.buckets]
        early = sum(b.work is not None for _, b in every)
        try:
            for c, b in every:
                if b.work is None:
                    self._launch(c, b)
            for c, b in every:
                with self._named(c, "averaging gradients over the {kind} replicas"):
                    b.work.wait(datetime.timedelta(seconds=self.timeout_s))
                assert b.flat is not None
                b.flat /= c.group.divisor or len(c.group.peers) + 1
                for g, avg in zip(b.grads, _unflatten_dense_tensors(b.flat, b.grads)):
                    g.copy_(avg)
            self.last = ReduceCount(len(every), sum(b.flat.numel() * b.flat.element_size()
                                                    for _, b in every if b.flat is not None), early)
        finally:
            self._armed, self._running = False, None
            for _, b in every:
                b.grads, b.flat, b.work = [], None, None
        return self.last

    def close(self) -> None:
        """Remove the gradient hooks (the runner this reducer served was replaced)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- the executor's side -----------------------------------------------------------------------------------
    def final_pass(self, stage: int, final: bool) -> None:
        """A backward (or weight) pass of local ``stage`` begins; ``final``: its last of the step."""
        self._running = stage if final and self._armed else None

    def stage_done(self, stage: int) -> None:
        """Local ``stage``'s last backward of the step is over: its parameters' gradients are final."""
        if self._armed:
            for p in self._stage_params.get(stage, []):
                if id(p) in self._bucket_of:
                    self._deliver(p, stage)

    def _accumulated(self, p: torch.Tensor) -> None:
        """``register_post_accumulate_grad_hook``: ``p``'s gradient just accumulated."""
        c, b = self._bucket_of[id(p)]
        if self._armed and b.work is not None:
            raise RuntimeError(
                f"rank {self.rank}: the gradient of {self._names.get(id(p), 'a parameter')} changed after its "
                f"average over the {c.group.kind} replicas (ranks {c.group.peers} and this one) was launched; the "
                "stage's last backward of the step was expected to bring its last gradient")
        if self._running is not None:
            self._deliver(p, self._running)

    def _deliver(self, p: torch.Tensor, stage: int) -> None:
        done = self._done.setdefault(id(p), set())
        if stage in done or stage not in self._holders.get(id(p), ()):
            return
        done.add(stage)
        if done == self._holders[id(p)]:
            c, b = self._bucket_of[id(p)]
            b.waiting -= 1
            while c.next < len(c.buckets) and not c.buckets[c.next].late and not c.buckets[c.next].waiting:
                self._launch(c, c.buckets[c.next])
                c.next += 1

    def _launch(self, c: _Channel, b: _Bucket) -> None:
        for p in b.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        b.grads = [p.grad for p in b.params if p.grad is not None]  # all of them: filled with zeros above
        b.flat = _flatten_dense_tensors(b.grads)
        with self._named(c, "launching the average of gradients over the {kind} replicas"):
            b.work = dist.all_reduce(b.flat, group=c.group.group, async_op=True)

    def _named(self, c: _Channel, what: str) -> Any:
        return named_failures(what.format(kind=c.group.kind), c.group.peers, self.rank, self.timeout_s)


def _forward_use(stage: Stage) -> list[torch.nn.Parameter]:
    """The parameters ``stage`` reads, in the order its graph first reads them."""
    params = dict(stage.module.named_parameters(remove_duplicate=False))
    seen: dict[int, torch.nn.Parameter] = {}
    for node in stage.module.graph.nodes:
        p = params.get(str(node.target)) if node.op == "get_attr" else None
        if p is not None and p.requires_grad:
            seen.setdefault(id(p), p)
    return list(seen.values())


def _assign(params: list[torch.nn.Parameter], cap_mb: float, first_mb: float) -> list[list[torch.nn.Parameter]]:
    """``params`` (in order) cut into buckets of one dtype and device each, as DDP's
    ``compute_bucket_assignment_by_size``: a bucket closes once it holds ``cap_mb`` (the first of each dtype
    ``first_mb``); buckets ordered by their first parameter."""
    open_: dict[tuple[torch.dtype, torch.device], tuple[int, list[torch.nn.Parameter], int]] = {}
    closed: dict[tuple[torch.dtype, torch.device], int] = {}
    out: list[tuple[int, list[torch.nn.Parameter]]] = []
    for i, p in enumerate(params):
        key = (p.dtype, p.device)
        start, ps, nbytes = open_.pop(key, (i, [], 0))
        ps.append(p)
        nbytes += p.numel() * p.element_size()
        if nbytes >= (cap_mb if closed.get(key) else min(first_mb, cap_mb)) * _MB:
            out.append((start, ps))
            closed[key] = closed.get(key, 0) + 1
        else:
            open_[key] = (start, ps, nbytes)
    out += [(start, ps) for start, ps, _ in open_.values()]
    return [ps for _, ps in sorted(out, key=lambda x: x[0])]
