"""A layout's expert parallelism: the degrees to search, the link its all-to-alls cross, and its gradient reduction.

Expert parallelism of degree ``ep`` (:mod:`partitioner.ep`) splits each mixture-of-experts layer's experts over ``ep``
consecutive data-parallel replicas of a tp rank, as :meth:`smp.runtime.topology.Topology.ep_grid` carves them: a
degree divides the replicas and every layer's experts (:func:`ep_choices`). The group's all-to-alls run on the link
within a node when its ``ep`` replicas share one, else on the inter-node link
(:func:`~partitioner.layout.layout.group_link`). After the step, the gradients of the parameters every replica holds
whole are averaged over the dp replicas and those of a rank's experts over the ``dp / ep`` replicas holding the same
experts (the expert-data-parallel group, :mod:`smp.engine.grad_averaging`): :func:`gradient_reduce_s` prices both,
one after the other as the runtime issues them; :func:`expert_gradient_bytes` says how much of each stage's gradients
are the experts'.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..capture.graph import OpGraph
from ..cost.collectives import all_gather_s, gradient_all_reduce_s
from ..cost.devices import DeviceRates
from ..cost.precision import param_memory_parts
from ..cut.memory import StageMemory
from ..cut.objective import stage_params
from ..cut.plan import PartitionPlan
from .layout import Layout

__all__ = ["ep_choices", "expert_params", "expert_gradient_bytes", "gradient_reduce_s"]


def ep_choices(dp: int, experts: Sequence[int]) -> list[int]:
    """The expert-parallel degrees of ``dp`` replicas for layers of ``experts`` experts each: the divisors of ``dp``
    that divide every layer's experts, ascending (1 alone for a dense model)."""
    if not experts:
        return [1]
    return [e for e in range(1, dp + 1) if dp % e == 0 and all(x % e == 0 for x in experts)]


def expert_params(graph: OpGraph) -> np.ndarray:
    """Per parameter of ``graph``, whether it is an ep rank's experts (all False without expert parallelism)."""
    experts = graph.fx.experts if graph.fx is not None else None
    held = experts.params if experts is not None else {}
    return np.array([name in held for name in graph.param_names], bool)


def expert_gradient_bytes(plan: PartitionPlan, graph: OpGraph, dtype: str, optimizer: str) -> np.ndarray:
    """Per stage of ``plan`` (cut from ep rank 0's ``graph``), the bytes of its experts' gradients."""
    p_stage, p_idx = stage_params(graph, plan.stage_of_ops(graph), plan.num_stages)
    grads = np.where(expert_params(graph), param_memory_parts(graph, dtype, optimizer)["gradients"], 0.0)
    return np.bincount(p_stage, weights=grads[p_idx], minlength=plan.num_stages)


def gradient_reduce_s(layout: Layout, mine: Sequence[StageMemory], experts_bytes: float, rates: DeviceRates,
                      link: DeviceRates) -> float:
    """Seconds of a pipeline rank's gradient averaging after the step, its stages ``mine`` holding ``experts_bytes``
    of experts' gradients: the others' all-reduce over the dp replicas on ``link`` (and ZeRO-1's all-gather of the
    updated weights), the experts' over the ``dp / ep`` replicas holding the same experts, which span the dp
    replicas, on the same link (:func:`partitioner.cost.collectives.gradient_all_reduce_s`)."""
    if layout.dp == 1:
        return 0.0
    grads = sum(s.gradient_bytes for s in mine)
    seconds = gradient_all_reduce_s(grads - experts_bytes, layout.dp, rates, link)
    if experts_bytes and layout.dp > layout.ep:
        seconds += gradient_all_reduce_s(experts_bytes, layout.dp // layout.ep, rates, link)
    if layout.zero1:
        seconds += all_gather_s(sum(s.weights_bytes for s in mine), layout.dp, link)
    return seconds
