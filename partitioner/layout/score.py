"""Pricing one layout: the step, throughput, MFU, memory per device, bubble and exposed communication.

A layout (:class:`partitioner.layout.layout.Layout`) is priced with the functions ``smp inspect`` and ``smp simulate``
use, so fixed degrees get their numbers: tp rank 0's graph at the microbatch size (:mod:`partitioner.layout.costs`) is
cut into pp x v stages by :func:`partitioner.partition` with the same options (microbatches, pipeline, device,
precision, links, memory budget, optimizer), the stage costs and the bytes crossing each boundary
(:func:`partitioner.cut.objective.stage_crossings`) go through the pipeline simulator, and the memory of each stage is
:func:`partitioner.stage_memory` with the simulated schedule's microbatches in flight. A boundary between stages on
one node costs the link within a node, between nodes the inter-node link; which ranks share a node follows the
layout's placement, with ``ranks_per_node`` ranks a node (for "DPT", replica 0's as ``smp simulate`` counts them).

What neither command prices, the layout adds, as the runtime runs it:

* activation checkpointing ("full": every stage recomputes its forward in backward, :mod:`pipeline.executor`): the
  backward costs a forward more; a stage keeps the tensors it received per microbatch in flight, and one
  microbatch's activations while it recomputes;
* data parallelism: after the step each pipeline rank averages its stages' gradients over the dp replicas in one
  all-reduce (:mod:`smp.engine.execution`; :func:`partitioner.cost.collectives.gradient_all_reduce_s`: a ring
  all-reduce on the intra-node link when the replicas share a node, else on the inter-node link), so the step is the
  latest of each rank's pipeline end plus its all-reduce; ZeRO-1 (torch's ``ZeroRedundancyOptimizer``, SMP's
  ``shard_optimizer_state``) divides the optimizer state by dp and adds an all-gather of the updated weights;
* sharded data parallelism (sdp = D > 1, ZeRO-3 over D of the dp replicas): priced by
  :func:`partitioner.sdp.shards.sharded_dp` as ``smp simulate --sdp`` prices it: the stages cut without the memory
  budget (the sharded ranks are held to it), each stage's all-gathers added to its forward and backward, each
  rank's reduce-scatter and all-reduce after its pipeline end (instead of the plain all-reduce), its memory the
  sharded rank's peak; the sharding group's link is the intra-node one when its D replicas share a node; the
  collectives overlap compute as the runtime and FSDP run them (:mod:`partitioner.sdp.overlap`: what each pass
  exposes, and the reduce-scatters' tail after the pipeline);
* expert parallelism (ep > 1, :mod:`partitioner.layout.experts`): ep rank 0's graph, its experts' weights, gradients
  and optimizer state at 1/ep, its all-to-alls in the passes on the link the ep group crosses, its experts' gradients
  averaged over the dp / ep replicas holding the same experts;
* throughput and MFU over the job, by :func:`partitioner.cost.throughput.from_counts` (the one definition);
* the memory budget less a headroom (:mod:`partitioner.layout.headroom`, ``Pricing.headroom``: 10% by default) is
  what a layout must fit (:attr:`LayoutScorer.budget`); its stages are cut under the budget whose partitioner's
  preferred line (:data:`partitioner.cut.objective.HEADROOM` free) is that limit.

The simulator is passed in (``simulate``, a :class:`PipelineSimulator`): the partitioner does not import the
pipeline package (:mod:`pipeline.simulate` is what the ``smp`` command passes).

:meth:`LayoutScorer.bound` gives, without partitioning, a lower bound on the step (a rank does at least
``m x max(total op seconds / pp, the largest op)`` of work, as Alpa and Aceso bound a stage) and on the largest
device's memory (the mean over the pp ranks of the parameter state, as if sdp sharded every parameter, and the
activations), and an estimate to order candidates by, without communication: ``(m + pp - 1) c`` for GPipe and 1F1B,
``(m + (pp - 1)/v) c`` interleaved, ``(m + (pp - 1)/3) c`` for ZB-H1 (Narayanan et al. 2021; Qi et al. 2023), where
``c``, a rank's time per microbatch, is v times the least bottleneck of the ops cut in topological order into pp x v
contiguous stages that each fit the memory budget with the microbatches in flight (:func:`chain_bottleneck`; at
least the work / pp; infinite when no such cut fits, which puts the layout last). Where the budget binds, the
partitioner trades speed for memory too, so the estimate follows it there. Once cut, :meth:`LayoutScorer.plan_bound`
bounds the step by the busiest rank's passes, before simulating.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from ..capture.graph import OpGraph
from ..cost.collectives import after_pipeline_s, all_gather_s, all_reduce_s
from ..cost.devices import DeviceRates
from ..cost.optimizer_step import optimizer_step_s
from ..cost.precision import activation_bytes, param_memory_parts
from ..cost.roofline import NodeCosts
from ..cost.throughput import from_counts, peak_of
from ..cut.memory import stage_memory
from ..cut.objective import MemoryBudgetError, stage_crossings
from ..cut.options import UNLIMITED, PartitionOptions
from ..cut.plan import PartitionPlan
from ..cut.portfolio import partition
from ..sdp.shards import PERSISTENCE_THRESHOLD, ShardedRank
from .chain import Chain, chain_bottleneck
from .costs import LayoutCosts
from .experts import expert_gradient_bytes, expert_params, gradient_reduce_s
from .headroom import DEFAULT, Headroom
from .layout import Layout, Score, global_rank, group_link, partition_pipeline, replicas_share_node
from .rank_state import rank_memory, rank_update
from .sharded import SdpCache, sdp_links, sdp_passes

__all__ = ["SimOutcome", "PipelineSimulator", "Pricing", "Bound", "LayoutScorer", "global_rank", "chain_bottleneck"]


@dataclass(frozen=True)
class SimOutcome:
    """What the pipeline simulator returns for one schedule: the step, the idle fraction, when each rank's last
    action ends, and each stage's most microbatches in flight (:func:`pipeline.schedule.peak_in_flight`)."""

    step_s: float
    bubble: float
    rank_end_s: list[float]
    peak_in_flight: list[int]


class PipelineSimulator(Protocol):
    """Simulates ``schedule`` (a :data:`partitioner.layout.layout.SCHEDULES` name) on ``ranks`` ranks
    (``virtual_stages``
    stages each) for ``microbatches`` microbatches, from per-stage seconds, per-boundary seconds and stage edges."""

    def __call__(self, schedule: str, ranks: int, microbatches: int, virtual_stages: int, forward_s: list[float],
                 backward_s: list[float], comm_s: dict[tuple[int, int], float],
                 deps: list[tuple[int, int]], rates: DeviceRates) -> SimOutcome: ...


@dataclass(frozen=True)
class Pricing:
    """What every layout is priced under: the partitioner's ``options`` (device, precision, links, memory budget,
    optimizer, memory weight; microbatches and pipeline are each layout's), ``ranks_per_node`` and, under sdp, the
    elements below which a parameter stays whole (``sdp_threshold``, SMP's ``sdp_param_persistence_threshold``);
    ``overlap``: sdp's collectives overlap with compute, prefetched as the runtime and FSDP run them
    (:mod:`partitioner.sdp.overlap`); False prices each one exposed where it is issued (a what-if);
    ``headroom``: memory every device keeps free of its budget (:mod:`partitioner.layout.headroom`)."""

    options: PartitionOptions
    ranks_per_node: int
    sdp_threshold: int = PERSISTENCE_THRESHOLD
    overlap: bool = True
    headroom: Headroom = DEFAULT

    @property
    def rates(self) -> DeviceRates:
        """The device and link rates (:meth:`partitioner.PartitionOptions.resolve_rates`)."""
        return self.options.resolve_rates()


@dataclass(frozen=True)
class Bound:
    """Before partitioning: ``step_s`` and ``memory_bytes`` are lower bounds on the layout's step and largest
    device; ``estimate_s`` is the optimistic step candidates are ordered by."""

    step_s: float
    estimate_s: float
    memory_bytes: float


class _Sums(NamedTuple):
    """Per microbatch on tp (and ep) rank 0: op seconds, forward seconds, the largest op (and with its recompute),
    and bytes of parameter state (by kind, :func:`partitioner.cost.precision.param_memory_parts`), activations and the
    experts' gradients."""

    seconds: float
    forward_s: float
    op_s: float
    op_recompute_s: float
    parts: dict[str, float]
    activations: float
    expert_gradients: float


class LayoutScorer:
    """Prices layouts of one model (``costs``) under ``pricing`` with ``simulate``; partitions are cached by what
    they depend on (tp, microbatch size, stages, microbatches, pipeline), so layouts that differ only in schedule
    variant, checkpointing, ZeRO-1 or placement share one."""

    def __init__(self, costs: LayoutCosts, pricing: Pricing, simulate: PipelineSimulator) -> None:
        self.costs, self.pricing, self.simulate = costs, pricing, simulate
        self.rates = pricing.rates
        self.inter = dataclasses.replace(self.rates, link_bytes_per_s=self.rates.inter_node_bytes_per_s,
                                         link_latency_s=self.rates.inter_node_latency_s)
        self._plans: dict[tuple, PartitionPlan] = {}
        self._sdp = SdpCache()
        self.device_budget = pricing.options.budget(self.rates)  # the device's; a layout fits budget, less headroom
        self.budget = pricing.headroom.usable(self.device_budget)
        self._totals: dict[tuple, _Sums] = {}
        self._chains: dict[tuple, float] = {}
        self._ops: dict[tuple, Chain] = {}  # per (tp, size, checkpointing, shares): what its chains share

    @property
    def partitions(self) -> int:
        """Stage partitions made so far (each once, whichever layouts share it)."""
        return len({id(plan) for plan in self._plans.values()})

    def priced(self, layout: Layout) -> tuple[OpGraph, NodeCosts]:
        """The graph the layout's stages are cut from (tp rank 0's at its microbatch size, ep rank 0's of it) and its
        per-op seconds, the all-to-alls on the link its ep group crosses."""
        return (self.costs.graph(layout.tp, layout.microbatch_size, *layout.split),
                self.costs.costs(layout.tp, layout.microbatch_size, layout.ep, self.priced_across(layout), layout.cp))

    def priced_across(self, layout: Layout) -> DeviceRates | None:
        """The inter-node link when the layout's ep or cp group spans nodes, else None (:func:`group_link`)."""
        return group_link(layout, self.rates, self.inter, self.pricing.ranks_per_node)

    # -- bounds ----------------------------------------------------------------------------------------------------

    def _sums(self, layout: Layout) -> _Sums:
        """The totals of the layout's graph on one microbatch that the bounds read (cached)."""
        key = (layout.tp, layout.microbatch_size, layout.split, self.priced_across(layout))
        if key not in self._totals:
            (g, c), o = self.priced(layout), self.pricing.options
            per_param = param_memory_parts(g, o.dtype, o.optimizer)
            parts = {kind: float(v.sum()) for kind, v in per_param.items()}
            self._totals[key] = _Sums(float(c.total_s.sum()), float(c.forward_s.sum()), float(c.total_s.max(initial=0)),
                                      float((c.total_s + c.forward_s).max(initial=0)), parts,
                                      float(activation_bytes(g, o.dtype).sum()),
                                      float(per_param["gradients"][expert_params(g)].sum()))
        return self._totals[key]

    def memory_bound(self, layout: Layout) -> float:
        """The lower bound on the largest device's memory of :meth:`bound`, alone (cheap: a layout over the budget
        needs no estimate)."""
        t = self._sums(layout)
        m, pp, v = layout.microbatches, layout.pp, layout.virtual_stages
        shares = layout.state_shares()
        state = sum(x / shares.get(kind, 1) for kind, x in t.parts.items())
        # Every stage holds a microbatch's activations at once (checkpointed: while it recomputes), GPipe's all m.
        held = t.activations / v if layout.checkpointing == "full" else (
            (m if layout.schedule == "gpipe" else 1) * t.activations)
        return (state + held) / pp

    def bound(self, layout: Layout) -> Bound:
        """Lower bounds on the step and the largest device's memory, and the estimate to order by (module
        docstring); nothing is partitioned or simulated."""
        t = self._sums(layout)
        ckpt = layout.checkpointing == "full"
        work = t.seconds + t.forward_s if ckpt else t.seconds
        m, pp, v = layout.microbatches, layout.pp, layout.virtual_stages
        busy = m * max(work / pp, t.op_recompute_s if ckpt else t.op_s)
        # Some rank holds at least the mean of the gradients, and reduces them at best over the intra-node link (the
        # experts' over fewer replicas: left out).
        local = any(replicas_share_node(pp, layout.tp, layout.dp, layout.placement, self.pricing.ranks_per_node))
        reduce = all_reduce_s((t.parts["gradients"] - t.expert_gradients) / pp, layout.dp,
                              self.rates if local else self.inter)
        if layout.sdp > 1:  # a reduce-scatter over the sharding group moves no less than an all-gather of the same
            reduce = min(all_gather_s(t.parts["gradients"] / pp, layout.sdp, link) for link in (self.rates, self.inter))
        fill = {"1f1b": pp - 1.0, "gpipe": pp - 1.0, "interleaved-virtual": (pp - 1.0) / v,
                "zero-bubble": (pp - 1.0) / 3}[layout.schedule]
        rank_s = v * self._chain(layout)
        return Bound(step_s=max(busy, reduce), estimate_s=max(busy, (m + fill) * max(rank_s, work / pp)) + reduce,
                     memory_bytes=self.memory_bound(layout))

    def _chain(self, layout: Layout) -> float:
        """A stage's time in the estimate: the least bottleneck of the ops cut in topological order into the layout's
        stages, each fitting the budget with the microbatches the partitioner counts in flight (1F1B's p - s, GPipe's
        m; a checkpointed stage one, recomputing); infinity when no such cut fits (cached)."""
        ckpt, m, k = layout.checkpointing == "full", layout.microbatches, layout.stages
        flight = [1] * k if ckpt else [m] * k if layout.schedule == "gpipe" else [min(m, k - s) for s in range(k)]
        shares = layout.state_shares()
        key = (layout.tp, layout.microbatch_size, k, ckpt, tuple(flight), tuple(sorted(shares.items())), layout.split,
               self.priced_across(layout))
        if key not in self._chains:
            ops = key[:2] + key[3:4] + key[5:]  # the chain's ops and memory: every stage count and flight shares them
            if ops not in self._ops:
                g, c = self.priced(layout)
                o = self.pricing.options
                parts = param_memory_parts(g, o.dtype, o.optimizer)
                state = np.sum([v / shares.get(kind, 1) for kind, v in parts.items()], axis=0)
                self._ops[ops] = Chain(c.total_s + c.forward_s if ckpt else c.total_s, fixed=g.by_first_user(state),
                                       acts=activation_bytes(g, o.dtype), budget=self.budget)
            self._chains[key] = self._ops[ops].bottleneck(k, flight)
        return self._chains[key]

    # -- the price -------------------------------------------------------------------------------------------------

    def plan(self, layout: Layout) -> PartitionPlan:
        """The layout's stages: :func:`partitioner.partition` of tp rank 0's graph at the microbatch size into pp x v
        stages with the pricing's options, this layout's microbatches and pipeline (cached). When no plan fits the
        partitioner's memory budget, the plan for no budget (checkpointing or ZeRO-1 may still make it fit: the
        score says); under sdp, as ``smp simulate --sdp``, the plan for no budget (the sharded ranks are held to it)."""
        pipeline = partition_pipeline(layout.schedule)
        key = (layout.tp, layout.microbatch_size, layout.stages, layout.microbatches, pipeline, layout.split,
               self.priced_across(layout), layout.sdp > 1)
        if key not in self._plans:
            graph, costs = self.priced(layout)
            cut = self.pricing.headroom.cut_budget(self.device_budget)
            opts = PartitionOptions.of(self.pricing.options, microbatches=layout.microbatches, pipeline=pipeline,
                                       **({} if cut == self.device_budget else {"device_memory": cut}))
            if layout.sdp == 1:
                with contextlib.suppress(MemoryBudgetError):
                    self._plans[key] = partition(graph, layout.stages, opts, costs=costs)
            free = key[:7] + (True,)  # the plan for no budget: the sdp layouts', and those no budgeted plan fits
            if key not in self._plans:
                if free not in self._plans:
                    unlimited = PartitionOptions.of(opts, device_memory=UNLIMITED)
                    self._plans[free] = partition(graph, layout.stages, unlimited, costs=costs)
                self._plans[key] = self._plans[free]
        return self._plans[key]

    def stage_comm(self, layout: Layout,
                   crossing: dict[tuple[int, int], tuple[int, int]]) -> dict[tuple[int, int], float]:
        """Seconds per stage boundary and microbatch: nothing between stages of one rank, the intra-node link within
        a node, the inter-node link across (replica 0's ranks)."""
        rpn, pp = self.pricing.ranks_per_node, layout.pp
        comm = {}
        for (s, t), (nbytes, count) in crossing.items():
            a, b = s % pp, t % pp
            if a == b:
                comm[(s, t)] = 0.0
                continue
            same = global_rank(layout, a, 0) // rpn == global_rank(layout, b, 0) // rpn
            comm[(s, t)] = (self.rates if same else self.inter).comm_s(nbytes, messages=count)
        return comm

    def _replica_link(self, layout: Layout, pipe_rank: int) -> DeviceRates:
        """The link a pipeline rank's dp replicas reduce over: within a node when they all share one."""
        shared = replicas_share_node(layout.pp, layout.tp, layout.dp, layout.placement, self.pricing.ranks_per_node)
        return self.rates if shared[pipe_rank] else self.inter

    def plan_bound(self, layout: Layout) -> float:
        """A lower bound on the layout's step from its stages (:meth:`plan`), before simulating them: the busiest
        pipeline rank's passes, m forwards and backwards of each of its stages, one at a time (communication, the
        runtime's overheads, sdp's gathers and the reduction after the pipeline only add to it); a hair below, so
        that rounding never puts it above the simulated step."""
        plan, ckpt = self.plan(layout), layout.checkpointing == "full"
        fwd = np.array([s.forward_s for s in plan.stages])
        work = fwd * (2.0 if ckpt else 1.0) + np.array([s.backward_s for s in plan.stages])
        per_rank = np.bincount(np.arange(layout.stages) % layout.pp, weights=work, minlength=layout.pp)
        return layout.microbatches * float(per_rank.max(initial=0.0)) * (1 - 1e-9)

    def exposed(self, layout: Layout, score: Score) -> Score:
        """``score`` (of :meth:`score` with ``exposed=False``) with its exposed communication."""
        quiet = self._quiet_step(layout)  # the optimizer step is not communication
        return dataclasses.replace(score, exposed_comm_s=max(0.0, score.step_s - score.optimizer_s - quiet))

    def _quiet_step(self, layout: Layout) -> float:
        """The layout's pipeline step with free communication (no stage sends, tp collectives or sdp gathers)."""
        plan, (graph, costs) = self.plan(layout), self.priced(layout)
        k, ckpt = layout.stages, layout.checkpointing == "full"
        stage = plan.stage_of_ops(graph)
        fwd = np.array([s.forward_s for s in plan.stages])
        bwd = np.array([s.backward_s for s in plan.stages]) + (fwd if ckpt else 0.0)
        tp_f, tp_b = (np.bincount(stage, weights=x, minlength=k) if x is not None else np.zeros(k)
                      for x in (costs.tp_forward_s, costs.tp_backward_s))
        deps = sorted(stage_crossings(graph, stage, k, self.pricing.options.dtype))
        return self._sim(layout, np.maximum(fwd - tp_f, 0.0), np.maximum(bwd - tp_b - (tp_f if ckpt else 0.0), 0.0),
                         {}, deps).step_s

    def score(self, layout: Layout, *, exposed: bool = True) -> Score:
        """The layout's :class:`partitioner.layout.layout.Score` (see the module docstring); ``exposed=False``:
        without its exposed communication (NaN), which takes a second simulation (:meth:`exposed` adds it)."""
        plan, o, (graph, costs) = self.plan(layout), self.pricing.options, self.priced(layout)
        k, pp, m, ckpt = layout.stages, layout.pp, layout.microbatches, layout.checkpointing == "full"
        stage = plan.stage_of_ops(graph)
        fwd = np.array([s.forward_s for s in plan.stages])
        bwd = np.array([s.backward_s for s in plan.stages]) + (fwd if ckpt else 0.0)
        tp_f, tp_b = (np.bincount(stage, weights=x, minlength=k) if x is not None else np.zeros(k)
                      for x in (costs.tp_forward_s, costs.tp_backward_s))
        # sdp: each stage's all-gathers in its forward and backward, every microbatch (overlapped: what is exposed)
        link = sdp_links(layout, self.rates, self.inter, self.pricing.ranks_per_node)[0]
        gf, gb, tail = sdp_passes(layout, plan, graph, self.pricing.sdp_threshold, link, fwd, bwd, self.pricing.overlap,
                                  self._sdp.collectives)
        crossing = stage_crossings(graph, stage, k, o.dtype)
        deps = sorted(crossing)
        sim = self._sim(layout, fwd + gf, bwd + gb, self.stage_comm(layout, crossing), deps)
        memory = stage_memory(plan, graph, sim.peak_in_flight)
        ranks = [[s for s in range(k) if s % pp == r] for r in range(pp)]
        held = [rank_memory(layout, [memory[s] for s in mine], [plan.stages[s].bytes_in for s in mine])
                for mine in ranks]
        experts = expert_gradient_bytes(plan, graph, o.dtype, o.optimizer)
        reduce = [gradient_reduce_s(layout, [memory[s] for s in mine], float(experts[mine].sum()), self.rates,
                                    self._replica_link(layout, r)) for r, mine in enumerate(ranks)]
        updated = [rank_update(layout, [memory[s] for s in mine]) for mine in ranks]
        if layout.sdp > 1:  # the sharded ranks' state, and their reduce-scatter and all-reduce instead
            sharded = self.sharded(layout, plan, sim.peak_in_flight)
            held = [(r.peak_bytes - r.activation_bytes, acts) for r, (_, acts) in zip(sharded, held)]
            reduce = [r.end_of_step_s if tail is None else r.all_reduce_s + tail[r.rank] for r in sharded]
            updated = [(r.optimizer_bytes, r.master_bytes) for r in sharded]
        # after each rank's pipeline its all-reduce, then its optimizer step; the step's fixed cost stays
        after = after_pipeline_s(sim.rank_end_s, reduce)
        opt = [optimizer_step_s(state, master, o.optimizer, self.rates) for state, master in updated]
        done = after_pipeline_s(sim.rank_end_s, [x + u for x, u in zip(reduce, opt)])
        step = sim.step_s + done
        worst = max(range(pp), key=lambda r: sum(held[r]))
        tp_step = m * max(sum(tp_f[s] + tp_b[s] + (tp_f[s] if ckpt else 0.0) for s in mine) for mine in ranks)
        samples = layout.global_batch
        per_sample = self.costs.tokens_per_sample
        flops = self.costs.model_flops(layout.microbatch_size) * m * layout.groups * 3  # a training step
        out = from_counts(step, samples, None if per_sample is None else round(samples * per_sample), flops,
                          layout.devices, peak_of(self.rates, o.dtype))
        score = Score(step_s=step, pipeline_s=sim.step_s, dp_comm_s=after, samples_per_s=out.samples_per_s,
                      tokens_per_s=out.tokens_per_s, flops_per_s_per_device=out.flops_per_s_per_device, mfu=out.mfu,
                      memory_bytes=int(round(sum(held[worst]))), budget_bytes=self.budget, bubble=sim.bubble,
                      exposed_comm_s=math.nan, tp_comm_s=float(tp_step), parameter_bytes=int(round(held[worst][0])),
                      activation_bytes=int(round(held[worst][1])), optimizer_s=done - after)
        return self.exposed(layout, score) if exposed else score

    def sharded(self, layout: Layout, plan: PartitionPlan,
                in_flight: Sequence[int] | None = None) -> list[ShardedRank]:
        """The layout's sharded data parallelism (:func:`partitioner.sdp.shards.sharded_dp`)
        on ``plan``: per stage, or with ``in_flight`` (the schedule's peak per stage) per pipeline rank. The sharding
        group, sdp replicas, and all dp replicas run on the intra-node link when they share a node (replicas are
        pp x tp ranks apart under "DPT", tp under "PDT"), else on the inter-node one."""
        link, replica_link = sdp_links(layout, self.rates, self.inter, self.pricing.ranks_per_node)
        graph = self.costs.graph(layout.tp, layout.microbatch_size)
        return self._sdp.ranks(plan, graph, layout.sdp, replicas=layout.dp, threshold=self.pricing.sdp_threshold,
                               link=link, replica_link=replica_link,
                               stage_rank=None if in_flight is None else [s % layout.pp for s in range(layout.stages)],
                               in_flight=in_flight)

    def _sim(self, layout: Layout, fwd: Any, bwd: Any, comm: dict[tuple[int, int], float],
             deps: list[tuple[int, int]]) -> SimOutcome:
        return self.simulate(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages,
                             [float(x) for x in fwd], [float(x) for x in bwd], comm, deps, self.rates)
