"""What sharded data parallelism adds to a pipeline's step: each microbatch's all-gathers in its stage's forward and
backward, and each rank's reduce-scatter and all-reduce once, after its last backward of the step.

The all-gathers are priced as adding to the passes and the reduce-scatter and all-reduce of a rank as running after
the rank's last pass (:func:`with_end_of_step`): an upper bound now that the engine prefetches each unit's all-gather
and launches its reduce-scatter during the last backward (:mod:`pipeline.param_gather`). What each rank holds
and spends is :func:`partitioner.sdp.shards.sharded_dp`'s, over the links of its
:class:`partitioner.sdp.group.ShardingGroup`; :func:`sharded_step` prices a plan's step so (``smp inspect --sdp``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from partitioner.capture.graph import OpGraph
from partitioner.cost.collectives import after_pipeline_s
from partitioner.cut.options import PartitionOptions
from partitioner.cut.plan import PartitionPlan
from partitioner.sdp.group import ShardingGroup
from partitioner.sdp.shards import ShardedRank, sharded_dp

from .schedule import peak_in_flight
from .simulate import SimResult
from .stage_simulation import plan_sim

__all__ = ["with_end_of_step", "ShardedStep", "sharded_step"]


def with_end_of_step(sim: SimResult, end_s: Sequence[float]) -> tuple[float, float]:
    """The step and bubble of a simulated schedule when each rank then spends ``end_s[rank]`` on the step's
    reduce-scatter and all-reduce (counted busy); the step's fixed cost (:func:`pipeline.step_model.predict_step`) is
    kept."""
    last = [e[-1] if e else 0.0 for e in sim.ends]
    step = sim.step_s + after_pipeline_s(last, end_s)
    busy = sum(sim.busy_s) + sum(end_s)
    return step, (1.0 - busy / (len(sim.busy_s) * step) if step > 0 else 0.0)


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
    as ``sim``, the pipeline's simulation, keeps them) and simulate ``options``' schedule with the collectives."""
    ranks = sharded_dp(plan, graph, group.degree, threshold=group.threshold, link=group.link,
                       in_flight=peak_in_flight(sim.schedule))
    with_gathers = plan_sim(plan, graph, options, forward_s=[s.forward_s + r.gather_forward_s
                                                             for s, r in zip(plan.stages, ranks)],
                            backward_s=[s.backward_s + r.gather_backward_s for s, r in zip(plan.stages, ranks)])
    step, bubble = with_end_of_step(with_gathers, [r.end_of_step_s for r in ranks])
    return ShardedStep(ranks, step, bubble)
