"""Cutting an op graph into balanced, acyclic pipeline stages: the portfolio.

Two methods run side by side (``method="auto"`` keeps the best plan, :func:`partitioner.cut.objective.choose`):

* ``"dp"`` (:mod:`partitioner.cut.dp`): the best partition among those contiguous in the graph's
  topological order, the fewest bytes cut among those within 1% of it;
* ``"metis"`` (:mod:`partitioner.cut.metis`): multilevel k-way partitioning with compute and memory
  constraints and bytes on the edges, repaired into acyclic stages.

Both results then go through the same boundary refinement (:mod:`partitioner.cut.refine`); the DP's plan is
also kept as it was. Under ``"auto"`` the baselines' plans (:mod:`partitioner.cut.baselines`) are candidates
too, so the plan is never worse than a baseline printed beside it: no baseline is as good in bottleneck,
cut bytes and largest-stage memory and better in one.

When the plan kept would leave less than the budget's headroom free (memory is tight,
:func:`partitioner.cut.objective.choose`), two more candidates join: the DP's plan (refined) under the headroom
line, and the plan whose largest stage needs the least memory; every candidate is scored by the same
:func:`partitioner.cut.objective.evaluate` as the rest.

A model whose forward calls ``torch.distributed.pipelining.pipe_split()`` has chosen its stages itself: those
markers are honoured (:mod:`partitioner.capture.split_points`), not searched over.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np
import torch

from ..capture.chunk import heavy_linears, split_columns
from ..capture.graph import OpGraph
from ..capture.split_points import marker_stages
from ..capture.tracing import trace
from ..cost.op_times import timed_costs
from ..cost.roofline import NodeCosts, estimate
from ..cost.timing import untimeable
from ..tp.pricing import tp_degree
from .baselines import BASELINES, baseline_stage
from .dp import dp_partition
from .metis import metis_partition
from .objective import Evaluation, Problem, budget_error, choose, evaluate, roomy_budget
from .options import UNLIMITED, PartitionOptions
from .plan import PartitionPlan, make_plan
from .refine import refine

__all__ = ["partition", "make_problem", "fixed_plan"]


def make_problem(graph_or_model: Any, num_stages: int, options: PartitionOptions | None = None, *,
                 example_inputs: Any = None, example_kwargs: dict | None = None, costs: NodeCosts | None = None,
                 **changes: Any) -> Problem:
    """Trace a model if needed, and price every op under ``options`` (with ``changes`` applied, e.g.
    ``microbatches=8``), ready for any partitioning method or baseline. ``costs`` (per-op seconds, e.g. from
    a profile of a real run) replace the cost model's."""
    opts = PartitionOptions.of(options, **changes)
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}")
    args, kwargs = _split_inputs(example_inputs, example_kwargs)
    if isinstance(graph_or_model, OpGraph):
        graph = graph_or_model
    elif isinstance(graph_or_model, torch.nn.Module):
        if example_inputs is None and not example_kwargs:
            raise ValueError("partition(model, ...) needs example_inputs (one microbatch) to trace the model")
        graph = trace(graph_or_model, args, kwargs)
    else:
        raise TypeError(f"partition() takes an OpGraph or an nn.Module, got {type(graph_or_model).__name__}")
    ops = sum(k != "output" for k in graph.kinds)
    if num_stages > ops:
        raise ValueError(f"num_stages={num_stages} but the model has only {ops} ops to place; "
                         f"use at most {ops} stages")
    rates = opts.resolve_rates()
    if costs is not None:
        if len(costs.forward_s) != graph.num_nodes or len(costs.backward_s) != graph.num_nodes:
            raise ValueError(f"costs has {len(costs.forward_s)} ops but the graph has {graph.num_nodes}")
    elif opts.measure:
        if graph.fx is None:
            raise ValueError("measure=True needs a traced model, not a synthetic graph")
        if tp_degree(graph) > 1:
            raise ValueError(f"measure=True times every op in this process, but the graph is sharded for tensor "
                             f"parallelism of degree {tp_degree(graph)}: its collectives need the tp group; leave "
                             "measure off (the estimate prices the collectives) or pass measured costs=")
        for comm, what in ((graph.fx.ep_comm, "its experts over an expert-parallel group"),
                           (graph.fx.cp_comm, "its attention over a context-parallel group")):
            if comm is not None:
                raise ValueError(f"measure=True times every op in this process, but the graph runs {what} of "
                                 f"{comm.size}: its collectives need the group; leave measure off (the estimate "
                                 "prices them) or pass measured costs=")
        if graph.timed is None:
            graph.timed = timed_costs(graph, args, kwargs, rates)
        costs = graph.timed
    else:
        costs = estimate(graph, rates, opts.dtype)
    return Problem(graph=graph, costs=costs, num_stages=num_stages, rates=rates, options=opts)


def _split_inputs(example_inputs: Any, example_kwargs: dict | None) -> tuple[tuple, dict]:
    if example_inputs is None:
        return (), dict(example_kwargs or {})
    args = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    return tuple(args), dict(example_kwargs or {})


def partition(graph_or_model: Any, num_stages: int, options: PartitionOptions | None = None, *,
              example_inputs: Any = None, example_kwargs: dict | None = None, costs: NodeCosts | None = None,
              **changes: Any) -> PartitionPlan:
    """Partition a model (traced with ``example_inputs``, one microbatch) or an :class:`OpGraph` into
    ``num_stages`` stages, under ``options`` with ``changes`` applied (``partition(g, 4, microbatches=8)``);
    see :class:`partitioner.PartitionOptions`. A model with ``pipe_split()`` markers is cut at them. ``costs``:
    per-op seconds to use instead of the cost model's.
    With ``split_heavy_linears``, a graph whose heavy linears are split into column chunks
    (:mod:`partitioner.capture.chunk`) is partitioned too, and its plan (whose graph is the split one) is kept if
    it is the better one."""
    p = make_problem(graph_or_model, num_stages, options, example_inputs=example_inputs,
                     example_kwargs=example_kwargs, costs=costs, **changes)
    marked = marker_stages(p.graph, num_stages)
    if marked is not None:  # the user's pipe_split() markers
        return make_plan(p, evaluate(p, marked), "pipe_split")
    problems = [p]
    chunks = heavy_linears(p.graph, p.time, num_stages) if costs is None and p.options.split_heavy_linears else {}
    if chunks:  # an op heavier than a stage's share: no cut balances the stages until it is split
        problems.append(make_problem(split_columns(p.graph, chunks), num_stages, p.options,
                                     example_inputs=example_inputs, example_kwargs=example_kwargs))
    # The split graph's plan is kept only if it is better: its chunks' outputs cost bytes on the link.
    found = [(q, name, ev) for q in problems for name, ev in _candidates(q)]
    name, best = choose([(name, ev) for _, name, ev in found], p.budget)
    if best.usable(p.budget) and not best.roomy(p.budget):  # tight: plans with headroom, and the smallest one
        found += [(q, name, ev) for q in problems for name, ev in _tight_candidates(q)]
        name, best = choose([(name, ev) for _, name, ev in found], p.budget)
    q = next(q for q, _, ev in found if ev is best)
    if q.budget is not None and np.any(best.memory > q.budget):
        raise budget_error(q, lambda: _least_memory(q))
    args, kwargs = _split_inputs(example_inputs, example_kwargs)
    if q.options.time_prices and not q.costs.measured and (args or kwargs) and _timeable(q):  # priced as it runs here
        q = make_problem(q.graph, num_stages, q.options, measure=True, example_inputs=args, example_kwargs=kwargs)
        best = evaluate(q, best.stage)
    return make_plan(q, best, name)


def _timeable(p: Problem) -> bool:
    """Whether ``time_prices`` (:class:`PartitionOptions`) can time ``p``'s ops in this process: a traced model with
    weights, priced for this CPU in fp32, without tensor-, expert- or context-parallel collectives, autocast or
    functorch transforms."""
    o, fx = p.options, p.graph.fx
    return (o.device == "cpu" and o.dtype == "fp32" and o.rates is None and fx is not None
            and tp_degree(p.graph) == 1 and fx.ep_comm is None and fx.cp_comm is None
            and not torch.is_autocast_enabled("cpu")
            and not untimeable(p.graph)
            and not any(t.is_meta for t in itertools.chain(fx.module.parameters(), fx.module.buffers())))


def _candidates(p: Problem) -> list[tuple[str, Evaluation]]:
    """Every method's plans of ``p`` (by ``options.method``; under ``"auto"`` the baselines' too)."""
    num_stages = p.num_stages
    method = p.options.method
    candidates: list[tuple[str, Evaluation]] = []
    if method in ("dp", "auto"):
        for stage in dp_partition(p):
            candidates += [("dp", evaluate(p, stage)), ("dp", refine(p, stage))]
    if method in ("metis", "auto") and num_stages > 1:
        candidates.append(("metis", refine(p, metis_partition(p))))
    if not candidates:  # metis with one stage: nothing to cut
        candidates.append(("metis", evaluate(p, np.zeros(p.graph.num_nodes, np.int64))))
    if method == "auto":
        candidates += [(name, evaluate(p, baseline_stage(p, name))) for name in BASELINES]
    return candidates


def _tight_candidates(p: Problem) -> list[tuple[str, Evaluation]]:
    """For a tight budget: the DP's plans, refined, with every stage under the headroom line, and the plan
    with the smallest largest stage; all scored under ``p`` itself, so their numbers are the plan's own."""
    line = dataclasses.replace(p, options=dataclasses.replace(p.options, device_memory=roomy_budget(p.budget)))
    stages = [refine(line, stage).stage for stage in dp_partition(line)] + [_least_memory(p).stage]
    return [("dp", evaluate(p, stage)) for stage in stages]


def _least_memory(p: Problem) -> Evaluation:
    """The plan whose largest stage needs the least memory (for the numbers in a budget error)."""
    q = dataclasses.replace(p, options=dataclasses.replace(p.options, memory_weight=1.0, device_memory=UNLIMITED))
    return refine(q, dp_partition(q)[0])


def fixed_plan(graph: OpGraph, num_stages: int, stage: Any, options: PartitionOptions | None = None, *,
               method: str = "manual", **changes: Any) -> PartitionPlan:
    """A plan for a given op -> stage assignment (hand placement), scored like any other plan."""
    p = make_problem(graph, num_stages, options, **changes)
    stage = np.asarray(stage, np.int64)
    if stage.shape != (graph.num_nodes,) or stage.min(initial=0) < 0 or stage.max(initial=0) >= num_stages:
        raise ValueError(f"an assignment needs one stage in [0, {num_stages}) per op ({graph.num_nodes} ops)")
    back = stage[graph.src] > stage[graph.dst]
    if back.any():
        e = int(np.argmax(back))
        u, v = graph.src[e], graph.dst[e]
        raise ValueError(f"this placement is not a pipeline: {graph.modules[u] or 'the root module'} on partition "
                         f"{stage[u]} feeds {graph.modules[v] or 'the root module'} on partition {stage[v]}; "
                         "partitions must follow the order in which data flows through the model")
    empty = sorted(set(range(num_stages)) - set(stage.tolist()))
    if empty:
        raise ValueError(f"partition(s) {empty} have no ops: place some modules on them or use fewer partitions")
    return make_plan(p, evaluate(p, stage), method)
