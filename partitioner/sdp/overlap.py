"""Sharded data parallelism whose collectives overlap with compute: the exposed seconds of the prefetched all-gathers
and of the reduce-scatters during the backward, as our runtime and FSDP run them.

PyTorch FSDP (Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", VLDB 16(12),
section 3.4 "Communication optimizations": backward and forward prefetching on a separate stream) issues the
all-gather of the next parameters while the current ones compute, and reduce-scatters each gradient while the
backward goes on; our runtime does the same at the stage graph's granularity (:mod:`pipeline.param_gather`,
:mod:`pipeline.gather_units`: one flat all-gather per unit, the next unit prefetched in forward and backward, one
reduce-scatter per unit launched as its gradients complete, two at most in flight). Such a pass is priced with the
two-stream bound (compute on one stream, the pass's collectives in order on the other): it takes
``first + max(compute, comm - first - last) + last``, where ``first`` is the collective no compute precedes (the
first unit's gather) and ``last`` the one no compute follows (the reduce-scatter of the unit completed last); what
it adds to the compute, ``first + last + max(0, comm - first - last - compute)``, is exposed.

The units are :func:`partitioner.sdp.units.group_units`' (one block of the layer list each; what the runtime
gathers), one collective per unit, so one ring's latency per unit, not per parameter. Per stage and microbatch
(:func:`stage_collectives`, :func:`overlapped`): the forward's gathers in the order the stage first reads the units;
the backward's gathers again (``reshard_after_forward``) in the reverse order but the last unit's, which stays whole
from the forward (FSDP's root unit; the first gather launched as the backward starts); the reduce-scatters in the
backward of the step's last microbatch only (the gradient accumulates whole over the microbatches, as
:mod:`partitioner.sdp.shards` prices it), completed last for the unit read first. What the reduce-scatters add to
that last backward is exposed after the pipeline (the tail), where the scorer puts the end-of-step reduction.
``smp plan``, ``smp inspect --sdp`` and ``smp simulate --sdp`` price sharded data parallelism so;
``benchmarks/published.py`` prices published FSDP runs with it, and ``benchmarks/step_model.py --plan`` checks it
against our runtime's steps on CPU ranks.
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
from .units import keeps_last, padded, stage_units

__all__ = ["StageCollectives", "exposed_s", "stage_collectives", "overlapped"]


@dataclass(frozen=True)
class StageCollectives:
    """One stage's sharded-parameter collectives in the order its forward first reads the units: seconds of each
    unit's all-gather (``gathers_s``) and of its gradients' reduce-scatter (``scatters_s``)."""

    gathers_s: tuple[float, ...]
    scatters_s: tuple[float, ...]


def exposed_s(compute_s: float, comm_s: float, first_s: float = 0.0, last_s: float = 0.0) -> float:
    """Seconds that ``comm_s`` of collectives on a stream of their own add to a pass of ``compute_s``: the two-stream
    bound, ``first_s`` before any compute and ``last_s`` after all of it, the rest hidden up to ``compute_s``."""
    return first_s + last_s + max(0.0, comm_s - first_s - last_s - compute_s)


def stage_collectives(plan: PartitionPlan, graph: OpGraph, degree: int, threshold: int,
                      link: DeviceRates) -> list[StageCollectives]:
    """Per stage of ``plan`` (made from ``graph``), its sharded parameters' collectives over ``degree`` ranks on
    ``link``, one per unit (:func:`partitioner.sdp.units.stage_units`), priced as
    :func:`partitioner.sdp.shards.sharded_dp` prices a collective (ring all-gathers, a reduce-scatter moving the same
    bytes), in the order the stage first reads the units."""
    k, opts = plan.num_stages, plan.options
    stage = plan.stage_of_ops(graph)
    shard = sharded_params(graph, stage, k, degree, threshold)
    parts = param_memory_parts(graph, opts.get("dtype", "fp32"), opts.get("optimizer", "adam"))
    order = np.argsort(stage, kind="stable")  # each stage's ops in forward (index) order
    bounds = np.searchsorted(stage[order], np.arange(k + 1))
    p_stage, p_idx = stage_params(graph, stage, k)
    pad = padded(graph, degree)
    out = []
    for s in range(k):
        held = p_idx[p_stage == s]
        units = stage_units(graph, order[bounds[s]:bounds[s + 1]], held[shard[held]], parts["weights"],
                            parts["gradients"], pad)
        out.append(StageCollectives(tuple(all_gather_s(w, degree, link) for w in units.weights),
                                    tuple(all_gather_s(g, degree, link) for g in units.gradients)))
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
        # the last unit (of two or more) stays whole into the backward, which launches the next gather as it starts
        again, first = (gathers - c.gathers_s[-1], 0.0) if keeps_last(len(c.gathers_s)) else (gathers, gathers)
        bwd[s] = exposed_s(b, again, first_s=first)
        last = exposed_s(b, again + scatters, first_s=first, last_s=c.scatters_s[0])
        tail[s] = last - bwd[s]
    return fwd, bwd, tail
