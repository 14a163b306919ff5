"""Sharded data parallelism whose collectives overlap with compute: the exposed seconds of FSDP's prefetched
all-gathers and its reduce-scatters during the backward.

PyTorch FSDP (Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", VLDB 16(12),
section 3.4 "Communication optimizations": backward and forward prefetching on a separate stream) issues the
all-gather of the next parameters while the current ones compute, and reduce-scatters each gradient while the
backward goes on. Such a pass is priced with the two-stream bound (compute on one stream, the pass's collectives
in order on the other): it takes ``first + max(compute, comm - first - last) + last``, where ``first`` is the
collective no compute precedes (the first unit's gather) and ``last`` the one no compute follows (the
reduce-scatter of the gradient completed last); what it adds to the compute,
``first + last + max(0, comm - first - last - compute)``, is exposed.

FSDP gathers a unit at a time (:func:`fsdp_unit`: torchtitan and the transformer auto-wrap policy wrap each block
of the model's layer list, the rest in the root unit), one collective per unit, so one ring's latency per unit,
not per parameter. Per stage and microbatch (:func:`stage_collectives`, :func:`overlapped`): the forward's gathers
in the order the stage first reads the units; the backward's gathers again (FSDP's ``reshard_after_forward``) in
the reverse order; the reduce-scatters in the backward of the step's last microbatch only (the gradient accumulates
whole over the microbatches, as :mod:`partitioner.sdp.shards` prices it), completed last for the unit read first.
What the reduce-scatters add to that last backward is exposed after the pipeline (the tail), where the scorer puts
the end-of-step reduction.

Our runtime now runs FSDP's design at the graph's granularity (:mod:`pipeline.param_gather`,
:mod:`pipeline.gather_units`: one flat all-gather per unit, the next unit prefetched in forward and backward, one
reduce-scatter per unit launched as its gradients complete), but ``smp plan`` still prices sharded data parallelism
without the overlap (:class:`partitioner.layout.score.Pricing` ``overlap=False``, the default): on CPU ranks gloo's
collectives run on the same cores as the compute, and how much of them the overlap hides there is not measured yet;
``benchmarks/published.py`` prices published FSDP runs with it, as those systems ran.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..capture.graph import OpGraph
from ..cost.collectives import all_gather_s
from ..cost.devices import DeviceRates
from ..cost.precision import param_memory_parts
from ..cut.objective import stage_params
from ..cut.plan import PartitionPlan
from .shards import sharded_params

__all__ = ["StageCollectives", "fsdp_unit", "exposed_s", "stage_collectives", "overlapped"]


@dataclass(frozen=True)
class StageCollectives:
    """One stage's sharded-parameter collectives in the order its forward first reads the parameters: seconds of
    each parameter's all-gather (``gathers_s``) and of its gradient's reduce-scatter (``scatters_s``)."""

    gathers_s: tuple[float, ...]
    scatters_s: tuple[float, ...]


def fsdp_unit(name: str) -> str:
    """The FSDP unit of the parameter ``name``: its path up to the first numeric component (``model.layers.3`` of
    ``model.layers.3.mlp.up_proj.weight``: a block of a ``ModuleList``), else the root unit ``""``."""
    parts = name.split(".")
    cut = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return "" if cut is None else ".".join(parts[:cut + 1])


def exposed_s(compute_s: float, comm_s: float, first_s: float = 0.0, last_s: float = 0.0) -> float:
    """Seconds that ``comm_s`` of collectives on a stream of their own add to a pass of ``compute_s``: the two-stream
    bound, ``first_s`` before any compute and ``last_s`` after all of it, the rest hidden up to ``compute_s``."""
    return first_s + last_s + max(0.0, comm_s - first_s - last_s - compute_s)


def stage_collectives(plan: PartitionPlan, graph: OpGraph, degree: int, threshold: int,
                      link: DeviceRates) -> list[StageCollectives]:
    """Per stage of ``plan`` (made from ``graph``), its sharded parameters' collectives over ``degree`` ranks on
    ``link``, one per :func:`fsdp_unit`, priced as :func:`partitioner.sdp.shards.sharded_dp` prices a collective
    (ring all-gathers, a reduce-scatter moving the same bytes), in the order the stage first reads the units."""
    k, opts = plan.num_stages, plan.options
    stage = plan.stage_of_ops(graph)
    shard = sharded_params(graph, stage, k, degree, threshold)
    parts = param_memory_parts(graph, opts.get("dtype", "fp32"), opts.get("optimizer", "adam"))
    first = np.full(max(len(graph.param_names), 1), graph.num_nodes, np.int64)
    if len(graph.use_node):
        np.minimum.at(first, graph.use_param, graph.use_node)
    p_stage, p_idx = stage_params(graph, stage, k)
    out = []
    for s in range(k):
        held = p_idx[p_stage == s]
        units: dict[str, list[float]] = {}  # unit -> [first read, weight bytes, gradient bytes]
        for p in held[shard[held]]:
            unit = units.setdefault(fsdp_unit(graph.param_names[p]), [float(graph.num_nodes), 0.0, 0.0])
            unit[0] = min(unit[0], float(first[p]))
            unit[1] += float(parts["weights"][p])
            unit[2] += float(parts["gradients"][p])
        ordered = sorted(units.values())
        out.append(StageCollectives(tuple(all_gather_s(w, degree, link) for _, w, _ in ordered),
                                    tuple(all_gather_s(g, degree, link) for _, _, g in ordered)))
    return out


def overlapped(collectives: Sequence[StageCollectives], forward_s: Sequence[float] | np.ndarray,
               backward_s: Sequence[float] | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per stage: the exposed seconds its gathers add to each microbatch's forward and backward of ``forward_s`` and
    ``backward_s`` (the stage's compute, recomputation included), and what the reduce-scatters add to the step's
    last backward (the tail after the pipeline); see the module docstring."""
    fwd, bwd, tail = (np.zeros(len(collectives)) for _ in range(3))
    for s, (c, f, b) in enumerate(zip(collectives, forward_s, backward_s)):
        if not c.gathers_s:
            continue
        gathers, scatters = sum(c.gathers_s), sum(c.scatters_s)
        fwd[s] = exposed_s(f, gathers, first_s=c.gathers_s[0])
        bwd[s] = exposed_s(b, gathers, first_s=c.gathers_s[-1])
        last = exposed_s(b, gathers + scatters, first_s=c.gathers_s[-1], last_s=c.scatters_s[0])
        tail[s] = last - bwd[s]
    return fwd, bwd, tail
