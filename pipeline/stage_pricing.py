"""A pipeline of P stages priced for simulation: what each stage costs per microbatch and each boundary carries, and
the step of a schedule on them with its ranks spread over nodes (``smp simulate``).

Up to :data:`EXACT_MAX_STAGES` stages (and no more than the model has ops) the costs are a real plan's. Beyond that no
real plan is made: every stage gets the model's total forward and backward time divided by P, as if the model were
proportionally deeper, and every boundary carries the mean boundary of a real plan of up to 16 stages. Bytes are at
the training precision. A boundary costs nothing between stages on one rank, the plan's link within a node, and the
inter-node link between nodes (ranks fill nodes in order, SMP's "cluster" placement). A graph sharded for tensor
parallelism is priced per rank, its tp collectives inside the stage costs and also kept apart (``tp_comm_s``). With
sharded data parallelism (a :class:`partitioner.sdp.group.ShardingGroup`) each stage's all-gathers per microbatch are
inside its forward and backward (kept apart in ``sdp_gather_s``), and its reduce-scatter and all-reduce run once per
step after its rank's last backward (``sdp_end_s``; :mod:`pipeline.sharded_step`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from partitioner.capture.graph import OpGraph
from partitioner.cost.devices import DeviceRates
from partitioner.cost.precision import activation_bytes, param_memory_parts
from partitioner.cut.objective import stage_crossings, stage_params
from partitioner.cut.options import UNLIMITED, PartitionOptions
from partitioner.cut.plan import PartitionPlan
from partitioner.cut.portfolio import partition
from partitioner.sdp.group import ShardingGroup, cut_options
from partitioner.sdp.shards import ShardedRank, sharded_dp
from partitioner.units import format_bytes

from .schedule import Schedule, peak_in_flight
from .sharded_step import exposed, with_end_of_step
from .stage_simulation import simulate_stages

__all__ = ["EXACT_MAX_STAGES", "PipelineCosts", "pipeline_costs", "PricedStep", "simulate_costs"]

# Above this many stages a pipeline's stages are priced as total / P instead of partitioned for real.
EXACT_MAX_STAGES = 64


@dataclass
class PipelineCosts:
    """Per-stage forward/backward seconds and per-boundary bytes of a pipeline to simulate."""

    forward_s: list[float]
    backward_s: list[float]
    deps: list[tuple[int, int]]
    edge_bytes: dict[tuple[int, int], tuple[int, int]]
    exact: bool
    note: str = ""
    rates: dict[str, float] = field(default_factory=dict)
    act_bytes: list[float] = field(default_factory=list)  # activations one microbatch leaves on each stage
    tp_comm_s: list[float] = field(default_factory=list)  # tp collectives per microbatch, inside forward/backward
    param_state: list[dict[str, float]] = field(default_factory=list)  # per stage: weights, gradients, ... bytes
    sdp_gather_s: list[float] = field(default_factory=list)  # sdp all-gathers per microbatch, inside forward/backward
    sdp_end_s: list[float] = field(default_factory=list)  # sdp reduce-scatter and all-reduce, once per step
    sdp: list[ShardedRank] = field(default_factory=list)  # per stage's rank, with a real plan

    def device_rates(self) -> DeviceRates:
        """The plan's :class:`partitioner.DeviceRates` (the defaults when it records none)."""
        return DeviceRates.from_dict(self.rates)


def pipeline_costs(graph: OpGraph, options: PartitionOptions, stages: int, *, exact: bool = True,
                   sdp: ShardingGroup | None = None) -> PipelineCosts:
    """A real plan of ``graph`` for ``stages`` stages under ``options`` when ``exact`` and ``stages <= min(ops,
    EXACT_MAX_STAGES)``; otherwise the model's totals scaled to total / P per stage, with the mean boundary of a real
    plan of up to 16 stages. With ``sdp`` of degree above 1 the stages' parameters are sharded over its group (the
    stages cut without the memory budget, :func:`partitioner.sdp.group.cut_options`)."""
    ops = sum(k != "output" for k in graph.kinds)
    dtype = options.dtype
    act_bytes = activation_bytes(graph, dtype)
    parts = param_memory_parts(graph, dtype, options.optimizer)
    degree = sdp.degree if sdp is not None else 1

    def acts(plan: PartitionPlan) -> list[float]:
        return np.bincount(plan.stage_of_ops(graph), weights=act_bytes, minlength=plan.num_stages).tolist()

    def state(plan: PartitionPlan, k: int) -> list[dict[str, float]]:
        p_stage, p_idx = stage_params(graph, plan.stage_of_ops(graph), plan.num_stages)
        per = {kind: np.bincount(p_stage, weights=v[p_idx], minlength=plan.num_stages) for kind, v in parts.items()}
        if k != plan.num_stages:  # the model spread evenly over k stages
            return [{kind: float(v.sum()) / k for kind, v in per.items()}] * k
        return [{kind: float(v[s]) for kind, v in per.items()} for s in range(k)]

    def tp(plan: PartitionPlan, k: int) -> list[float]:
        comm = plan.tensor_parallel.get("comm_s") or []
        return list(comm) if k == plan.num_stages else [sum(comm) / k] * k

    def sharded(plan: PartitionPlan, costs: PipelineCosts) -> PipelineCosts:
        if sdp is None or degree == 1:
            return costs
        ranks = sharded_dp(plan, graph, degree, threshold=sdp.threshold, link=sdp.link)
        fwd, bwd, end = exposed(plan, graph, sdp, ranks, [s.forward_s for s in plan.stages],
                                [s.backward_s for s in plan.stages])
        if not costs.exact:  # the model spread evenly over the stages
            ranks, fwd, bwd, end = [], *([sum(x) / stages] * stages for x in (fwd, bwd, end))
        costs.forward_s = [f + g for f, g in zip(costs.forward_s, fwd)]
        costs.backward_s = [b + g for b, g in zip(costs.backward_s, bwd)]
        costs.sdp_gather_s, costs.sdp_end_s, costs.sdp = [f + b for f, b in zip(fwd, bwd)], end, ranks
        return costs

    if exact and stages <= min(ops, EXACT_MAX_STAGES):
        plan = partition(graph, stages, cut_options(options, degree))
        crossing = stage_crossings(graph, plan.stage_of_ops(graph), stages, dtype)
        return sharded(plan, PipelineCosts(
            [s.forward_s for s in plan.stages], [s.backward_s for s in plan.stages], sorted(crossing), crossing, True,
            f"a real {stages}-stage plan ({plan.method}, balance {plan.balance:.3f})", plan.rates, acts(plan),
            tp(plan, stages), state(plan, stages)))
    k0 = max(1, min(ops, 16, stages))
    plan = partition(graph, k0, options, device_memory=UNLIMITED)  # a stage of many: no budget applies
    fwd = sum(s.forward_s for s in plan.stages)
    bwd = sum(s.backward_s for s in plan.stages)
    crossing = stage_crossings(graph, plan.stage_of_ops(graph), k0, dtype)
    per_boundary = plan.cut_bytes / max(k0 - 1, 1)
    tensors = max(1, round(sum(c for _, c in crossing.values()) / max(k0 - 1, 1)))
    why = (f"P={stages} > the model's {ops} ops, so no real plan exists" if stages > ops
           else f"P={stages} > {EXACT_MAX_STAGES}")
    deeper = f", as if the model were {stages / ops:.1f}x deeper" if stages > ops else ""
    note = (f"{why}: every stage gets total/P = ({fwd * 1e3:.2f} + {bwd * 1e3:.2f} ms)/{stages} per microbatch"
            f"{deeper}; each boundary carries {format_bytes(per_boundary)}, the mean boundary of a real {k0}-stage "
            "plan")
    chain = [(s, s + 1) for s in range(stages - 1)]
    total_act = float(act_bytes.sum())
    return sharded(plan, PipelineCosts([fwd / stages] * stages, [bwd / stages] * stages, chain,
                                       {e: (int(per_boundary), tensors) for e in chain}, False, note, plan.rates,
                                       [total_act / stages] * stages, tp(plan, stages), state(plan, stages)))


@dataclass(frozen=True)
class PricedStep:
    """One schedule simulated on a :class:`PipelineCosts`: the step, the bubble, and the most activation bytes a rank
    holds (None: the costs record no activations)."""

    step_s: float
    bubble: float
    peak_activation_bytes: float | None


def simulate_costs(schedule: str, costs: PipelineCosts, microbatches: int, ranks: int, ranks_per_node: int,
                   inter: tuple[float, float], virtual_stages: int = 1) -> PricedStep:
    """Simulate ``schedule`` (zero-bubble splits each backward into equal B and W halves) on ``costs``' stages, stage
    s on rank s % ``ranks``, ``ranks_per_node`` ranks a node (``inter``: the inter-node link's bytes per second and
    latency); with sharded data parallelism each rank's reduce-scatter and all-reduce after its last backward are in
    the step."""
    fwd, bwd = costs.forward_s, costs.backward_s
    stage_rank = [s % ranks for s in range(len(fwd))]
    comm = _link_comm(costs, stage_rank, ranks_per_node, *inter)
    sim = simulate_stages(schedule, microbatches, fwd, bwd, costs.device_rates(), deps=costs.deps, comm=comm,
                          num_ranks=ranks, virtual_stages=virtual_stages)
    peak = _peak_activation_bytes(sim.schedule, costs.act_bytes) if costs.act_bytes else None
    step, bubble = sim.step_s, sim.bubble
    if costs.sdp_end_s:
        end = [0.0] * ranks
        for s, x in enumerate(costs.sdp_end_s):
            end[stage_rank[s]] += x
        step, bubble = with_end_of_step(sim, end)
    return PricedStep(step, bubble, peak)


def _link_comm(costs: PipelineCosts, stage_rank: Sequence[int], ranks_per_node: int,
               inter_bw: float, inter_lat: float) -> dict[tuple[int, int], float]:
    """Seconds per boundary: 0 on one rank, the plan's link within a node, the inter-node link across."""
    intra = costs.device_rates()
    inter = DeviceRates(link_bytes_per_s=inter_bw, link_latency_s=inter_lat)
    comm = {}
    for (s, t), (b, c) in costs.edge_bytes.items():
        ra, rb = stage_rank[s], stage_rank[t]
        if ra == rb:
            comm[(s, t)] = 0.0
        else:
            link = intra if ra // ranks_per_node == rb // ranks_per_node else inter
            comm[(s, t)] = link.comm_s(b, messages=c)
    return comm


def _peak_activation_bytes(schedule: Schedule, act_bytes: Sequence[float]) -> float:
    """The most activation bytes a rank holds: per rank, its stages' activations at their peaks in flight
    (:func:`pipeline.schedule.peak_in_flight`; with several stages per rank, an upper bound)."""
    held = [0.0] * schedule.num_ranks
    for s, peak in enumerate(peak_in_flight(schedule)):
        held[schedule.stage_to_rank[s]] += peak * act_bytes[s]
    return max(held)
