"""What sharded data parallelism adds to a pipeline's step: what each microbatch's all-gathers expose in its stage's
forward and backward, and each rank's all-reduce and what its reduce-scatters expose once, after its last backward
of the step.

The runtime prefetches each unit's all-gather and launches each unit's reduce-scatter during the last backward
(:mod:`pipeline.param_gather`), so a pass exposes only what its compute cannot hide
(:func:`partitioner.sdp.overlap.overlapped`: the first unit's gather, and the rest beyond the compute), and the
reduce-scatters a tail after the pipeline (:func:`exposed`); on a device whose collectives share the ops' cores
(a CPU, :attr:`partitioner.DeviceRates.collectives_on_host`) nothing hides, and each pass pays its gathers whole.
What each rank holds and spends is
:func:`partitioner.sdp.shards.sharded_dp`'s, over the links of its :class:`partitioner.sdp.group.ShardingGroup`;
:func:`sharded_step` prices a plan's step so (``smp inspect --sdp``), :mod:`pipeline.stage_pricing` a simulation's
(``smp simulate --sdp``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from partitioner.capture.graph import OpGraph
from partitioner.cost.collectives import after_pipeline_s
from partitioner.cost.devices import DeviceRates
from partitioner.cut.options import PartitionOptions
from partitioner.cut.plan import PartitionPlan
from partitioner.sdp.group import ShardingGroup
from partitioner.sdp.overlap import overlapped, stage_collectives
from partitioner.sdp.shards import ShardedRank, sharded_dp

from .schedule import peak_in_flight
from .simulate import SimResult
from .stage_simulation import plan_sim

__all__ = ["with_end_of_step", "exposed", "ShardedStep", "sharded_step"]


def with_end_of_step(sim: SimResult, end_s: Sequence[float]) -> tuple[float, float]:
    """The step and bubble of a simulated schedule when each rank then spends ``end_s[rank]`` on the step's
    all-reduce and what its reduce-scatters expose (counted busy); the step's fixed cost
    (:func:`pipeline.step_model.predict_step`) is kept."""
    last = [e[-1] if e else 0.0 for e in sim.ends]
    step = sim.step_s + after_pipeline_s(last, end_s)
    busy = sum(sim.busy_s) + sum(end_s)
    return step, (1.0 - busy / (len(sim.busy_s) * step) if step > 0 else 0.0)


def exposed(plan: PartitionPlan, graph: OpGraph, group: ShardingGroup, ranks: Sequence[ShardedRank],
            forward_s: Sequence[float], backward_s: Sequence[float]) -> tuple[list[float], list[float], list[float]]:
    """Per stage of ``plan`` (made from ``graph``; ``ranks``: :func:`partitioner.sdp.shards.sharded_dp` of it, stage s
    on rank s) whose passes compute ``forward_s`` and ``backward_s``: the seconds ``group``'s collectives add to each
    microbatch's forward and backward, and after the stage's last backward (its all-reduce, and what its
    reduce-scatters expose)."""
    link = group.link or DeviceRates.from_dict(plan.rates)
    if link.collectives_on_host:  # nothing hides behind the compute: each pass's gathers whole
        gathers = [r.gather_forward_s for r in ranks]
        return gathers, [r.gather_backward_s for r in ranks], [r.end_of_step_s for r in ranks]
    fwd, bwd, tail = overlapped(stage_collectives(plan, graph, group.degree, group.threshold, link), forward_s,
                                backward_s)
    return fwd.tolist(), bwd.tolist(), [r.all_reduce_s + float(t) for r, t in zip(ranks, tail)]


@dataclass(frozen=True)
class ShardedStep:
    """A plan's step with its parameters sharded: each pipeline rank's :class:`~partitioner.sdp.shards.ShardedRank`,
    and the predicted step and bubble with the collectives."""

    ranks: list[ShardedRank]
    step_s: float
    bubble: float


def sharded_step(plan: PartitionPlan, graph: OpGraph, options: PartitionOptions, sim: SimResult,
                 group: ShardingGroup) -> ShardedStep:
    """Price ``plan``'s ranks (made from ``graph``) with their parameters sharded over ``group`` (activations in flight
    as ``sim``, the pipeline's simulation, keeps them) and simulate ``options``' schedule with what the collectives
    expose (:func:`exposed`)."""
    ranks = sharded_dp(plan, graph, group.degree, threshold=group.threshold, link=group.link,
                       in_flight=peak_in_flight(sim.schedule))
    forward_s, backward_s = [s.forward_s for s in plan.stages], [s.backward_s for s in plan.stages]
    fwd, bwd, end = exposed(plan, graph, group, ranks, forward_s, backward_s)
    with_gathers = plan_sim(plan, graph, options, forward_s=[f + g for f, g in zip(forward_s, fwd)],
                            backward_s=[b + g for b, g in zip(backward_s, bwd)])
    step, bubble = with_end_of_step(with_gathers, end)
    return ShardedStep(ranks, step, bubble)
