"""Cutting an op graph into balanced, acyclic pipeline stages.

Two methods, run side by side as a portfolio (``method="auto"`` keeps the better plan):

* ``"dp"``: the exact minimum-bottleneck partition among those contiguous in the graph's topological
  order — dynamic programming over cut positions, ``best[s][j] = min_i max(best[s-1][i], score(i, j))``,
  then a second pass that keeps that bottleneck and minimises the bytes cut (the classic chain-partitioning
  DP; cf. PipeDream, Narayanan et al. SOSP'19, and Bokhari 1988 for chains-on-chains). Graphs with more
  than ``MAX_POSITIONS`` ops are solved on the cheapest-cut position in each of ``MAX_POSITIONS`` windows
  of equal compute, then each boundary is re-placed at full resolution.
* ``"metis"``: multilevel k-way partitioning (Karypis & Kumar, SIAM J. Sci. Comput. 20(1), 1998) through
  pymetis, with two vertex constraints (compute, memory) and edge weights = bytes. METIS knows nothing of
  direction, so its parts are ordered by mean topological position and every op is pushed to at least
  the stage of its producers — the result is acyclic by construction.

Both results then go through the same refinement: move ops on the bottleneck stage to a neighbouring
stage when all their producers (consumers) already sit at or before (after) it, in the spirit of
Fiduccia–Mattheyses boundary refinement, accepting a move only when the exact objective improves.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pymetis
import torch

from .cost import DeviceRates, calibrate, estimate, measure as measure_costs
from .graph import OpGraph
from .objective import Evaluation, Problem, budget_error, evaluate, make_plan
from .plan import PartitionPlan
from .trace import trace

__all__ = ["partition", "METHODS", "MAX_POSITIONS", "parse_size", "make_problem"]

METHODS = ("auto", "dp", "metis")
MAX_POSITIONS = 1536


def parse_size(size: str | int | float | None) -> float | None:
    """``"16GiB"``, ``"512MB"``, ``2**30`` -> bytes."""
    if size is None or isinstance(size, (int, float)):
        return None if size is None else float(size)
    text = str(size).strip()
    units = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    num = text.rstrip("bBiIkKmMgGtT ")
    unit = text[len(num):].strip().lower()
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise ValueError(f"cannot read memory size {size!r}: write a positive number with a unit, e.g. 16GiB, 512MB")
    return value * units[unit]


def make_problem(graph_or_model: Any, num_stages: int, *, example_inputs: Any = None,
                 example_kwargs: dict | None = None, memory_weight: float = 0.2,
                 device_memory: str | float | None = None, microbatches: int = 1, pipeline: str = "1f1b",
                 optimizer: str = "adam", rates: DeviceRates | None = None, measure: bool = False,
                 seed: int = 0) -> Problem:
    """Check the options, trace a model if needed, and price every op."""
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}")
    if not 0.0 <= memory_weight <= 1.0:
        raise ValueError(f"memory_weight must be in [0, 1], got {memory_weight}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
    if isinstance(graph_or_model, OpGraph):
        graph = graph_or_model
    elif isinstance(graph_or_model, torch.nn.Module):
        if example_inputs is None and not example_kwargs:
            raise ValueError("partition(model, ...) needs example_inputs (one microbatch) to trace the model")
        graph = trace(graph_or_model, example_inputs if example_inputs is not None else (), example_kwargs)
    else:
        raise TypeError(f"partition() takes an OpGraph or an nn.Module, got {type(graph_or_model).__name__}")
    ops = sum(k != "output" for k in graph.kinds)
    if num_stages > ops:
        raise ValueError(f"num_stages={num_stages} but the model has only {ops} ops to place; "
                         f"use at most {ops} stages")
    rates = rates or calibrate()
    if measure:
        if graph.fx is None:
            raise ValueError("measure=True needs a traced model, not a synthetic graph")
        costs = measure_costs(graph, *_split_inputs(example_inputs, example_kwargs), rates=rates)
    else:
        costs = estimate(graph, rates)
    return Problem(graph=graph, costs=costs, num_stages=num_stages, rates=rates, memory_weight=memory_weight,
                   device_memory=parse_size(device_memory), microbatches=microbatches, pipeline=pipeline,
                   optimizer=optimizer, seed=seed)


def _split_inputs(example_inputs: Any, example_kwargs: dict | None) -> tuple[tuple, dict]:
    if example_inputs is None:
        return (), dict(example_kwargs or {})
    args = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    return tuple(args), dict(example_kwargs or {})


def partition(graph_or_model: Any, num_stages: int, *, example_inputs: Any = None,
              example_kwargs: dict | None = None, method: str = "auto", memory_weight: float = 0.2,
              device_memory: str | float | None = None, microbatches: int = 1, pipeline: str = "1f1b",
              optimizer: str = "adam", rates: DeviceRates | None = None, measure: bool = False,
              seed: int = 0) -> PartitionPlan:
    """Partition a model (traced with ``example_inputs``, one microbatch) or an :class:`OpGraph`."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not known; use one of {METHODS}")
    p = make_problem(graph_or_model, num_stages, example_inputs=example_inputs, example_kwargs=example_kwargs,
                     memory_weight=memory_weight, device_memory=device_memory, microbatches=microbatches,
                     pipeline=pipeline, optimizer=optimizer, rates=rates, measure=measure, seed=seed)
    candidates: list[tuple[str, Evaluation]] = []
    if method in ("dp", "auto"):
        candidates.append(("dp", refine(p, dp_partition(p))))
    if method in ("metis", "auto") and num_stages > 1:
        candidates.append(("metis", refine(p, metis_partition(p))))
    if not candidates:  # metis with one stage: nothing to cut
        candidates.append(("metis", evaluate(p, np.zeros(p.graph.num_nodes, np.int64))))
    name, best = min(candidates, key=lambda c: c[1].key(p.device_memory))
    if p.device_memory is not None and np.any(best.memory > p.device_memory):
        raise budget_error(p, best)
    return make_plan(p, best, name)


# --- the chain DP --------------------------------------------------------------------------------------


def _prefix(p: Problem) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Prefix sums over the topological order and the bytes live across each cut position."""
    g = p.graph
    n = g.num_nodes
    T = np.concatenate([[0.0], np.cumsum(p.time)])
    P = np.concatenate([[0.0], np.cumsum(p.node_param_mem())])
    A = np.concatenate([[0.0], np.cumsum(g.act_bytes.astype(np.float64))])
    cut = np.zeros(n + 2)
    if g.num_edges:
        nv = len(g.value_bytes)
        first = np.full(nv, n, np.int64)
        last = np.full(nv, -1, np.int64)
        np.minimum.at(first, g.value, g.src)
        np.maximum.at(last, g.value, g.dst)
        live = last > first
        np.add.at(cut, first[live] + 1, g.value_bytes[live])
        np.add.at(cut, last[live] + 1, -g.value_bytes[live])
    return T, P, A, np.cumsum(cut)[: n + 1]


def _candidates(T: np.ndarray, cut: np.ndarray) -> np.ndarray:
    n = len(T) - 1
    if n + 1 <= MAX_POSITIONS:
        return np.arange(n + 1)
    # One position per window of equal compute: the one with the fewest live bytes.
    edges = np.unique(np.searchsorted(T, np.linspace(0, T[-1], MAX_POSITIONS - 1), side="left"))
    edges = edges[(edges > 0) & (edges < n)]
    starts = np.concatenate([[1], edges])
    order = np.lexsort((np.arange(1, n), cut[1:n]))  # by cut, then position
    rank = np.empty(n - 1, np.int64)
    rank[order] = np.arange(n - 1)
    best_rank = np.minimum.reduceat(rank, starts - 1)
    return np.unique(np.concatenate([[0], order[best_rank] + 1, [n]]))


class _Scorer:
    """score(s, i, j) for a segment [i, j) placed on stage s, vectorised; mirrors objective.evaluate."""

    def __init__(self, p: Problem):
        self.p = p
        self.T, self.P, self.A, self.cut = _prefix(p)
        r = p.rates
        self.comm = 2.0 * (self.cut / r.link_bytes_per_s + (self.cut > 0) * r.link_latency_s)
        self.wt = (1 - p.memory_weight) / p.norm_time
        self.wm = p.memory_weight / p.norm_mem

    def __call__(self, s: int, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        time = self.T[j] - self.T[i] + self.comm[i] + self.comm[j]
        mem = self.P[j] - self.P[i] + self.p.inflight[s] * (self.A[j] - self.A[i])
        score = self.wt * time + self.wm * mem
        bad = i >= j
        if self.p.device_memory is not None:
            bad = bad | (mem > self.p.device_memory)
        return np.where(bad, np.inf, score)


def dp_partition(p: Problem) -> np.ndarray:
    """Stage of every node under the best contiguous partition (see module docstring)."""
    k, n = p.num_stages, p.graph.num_nodes
    sc = _Scorer(p)
    cand = _candidates(sc.T, sc.cut)
    N = len(cand)
    I, J = cand[:, None], cand[None, :]
    mats = [sc(s, I, J) for s in range(k)] if _stage_dependent(p) else [sc(0, I, J)] * k
    prev = mats[0][0].copy()
    parents = []
    for s in range(1, k):
        both = np.maximum(prev[:, None], mats[s])
        parents.append(both.argmin(axis=0))
        prev = both[parents[-1], np.arange(N)]
    best = prev[N - 1]
    bounds = _backtrack(parents, N)
    if np.isfinite(best) and k > 1:
        bounds = _fewest_cut_bytes(mats, sc.cut[cand], best) or bounds
    pos = cand[bounds]
    if N < n + 1:
        pos = _reposition(sc, pos)
    return np.searchsorted(pos, np.arange(n), side="right") - 1


def _stage_dependent(p: Problem) -> bool:
    return (p.memory_weight > 0 or p.device_memory is not None) and len(set(p.inflight.tolist())) > 1


def _backtrack(parents: list[np.ndarray], N: int) -> list[int]:
    bounds = [N - 1]
    for par in reversed(parents):
        bounds.append(int(par[bounds[-1]]))
    bounds.append(0)
    return bounds[::-1]


def _fewest_cut_bytes(mats: list[np.ndarray], cut: np.ndarray, best: float) -> list[int] | None:
    """Among partitions whose every stage scores <= best, the one that cuts the fewest bytes."""
    limit = best * (1 + 1e-9) + 1e-15
    k, N = len(mats), len(cut)
    prev = np.where(mats[0][0] <= limit, 0.0, np.inf)
    parents = []
    for s in range(1, k):
        total = np.where(mats[s] <= limit, prev[:, None] + cut[:, None], np.inf)
        parents.append(total.argmin(axis=0))
        prev = total[parents[-1], np.arange(N)]
    return _backtrack(parents, N) if np.isfinite(prev[N - 1]) else None


def _reposition(sc: _Scorer, pos: np.ndarray, sweeps: int = 3) -> np.ndarray:
    """Move each boundary to its best full-resolution position between its neighbours."""
    pos = pos.copy()
    for _ in range(sweeps):
        for b in range(1, len(pos) - 1):
            xs = np.arange(pos[b - 1] + 1, pos[b + 1])
            if len(xs) == 0:
                continue
            worst = np.maximum(sc(b - 1, np.full_like(xs, pos[b - 1]), xs), sc(b, xs, np.full_like(xs, pos[b + 1])))
            order = np.lexsort((sc.cut[xs], worst))
            pos[b] = xs[order[0]]
    return pos


# --- METIS + acyclic repair ----------------------------------------------------------------------------


def metis_partition(p: Problem) -> np.ndarray:
    g, k = p.graph, p.num_stages
    n = g.num_nodes
    if g.num_edges == 0:
        return np.minimum(np.arange(n) * k // max(n, 1), k - 1)
    key = np.unique(g.src * n + g.dst, return_inverse=True)
    pairs, inverse = key
    weight = np.zeros(len(pairs))
    np.add.at(weight, inverse, g.edge_bytes)
    a, b = pairs // n, pairs % n
    rows = np.concatenate([a, b])
    cols = np.concatenate([b, a])
    w = np.concatenate([weight, weight])
    order = np.lexsort((cols, rows))
    rows, cols, w = rows[order], cols[order], w[order]
    xadj = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=n))]).astype(np.int64)
    ew = (1 + np.round(w / max(w.max(), 1.0) * 1e5)).astype(np.int64)
    t = p.time / max(p.time.sum(), 1e-30)
    m = (p.node_param_mem() + g.act_bytes) / max(float((p.node_param_mem() + g.act_bytes).sum()), 1.0)
    vw = np.stack([1 + np.round(t * 1e6), 1 + np.round(m * 1e6)], axis=1).astype(np.int64).ravel()
    opts = pymetis.Options(seed=p.seed)
    result = pymetis.part_graph(k, adjacency=pymetis.CSRAdjacency(xadj, cols.astype(np.int64)),
                                vweights=vw, eweights=ew, options=opts)
    part = np.asarray(result.vertex_part if hasattr(result, "vertex_part") else result[1], np.int64)
    return repair(g, part, k)


def repair(g: OpGraph, part: np.ndarray, k: int) -> np.ndarray:
    """Order parts by mean topological position, then push every op to at least its producers' stage."""
    idx = np.arange(g.num_nodes, dtype=np.float64)
    counts = np.bincount(part, minlength=k)
    mean_pos = np.bincount(part, weights=idx, minlength=k) / np.maximum(counts, 1)
    rank = np.empty(k, np.int64)
    rank[np.lexsort((np.arange(k), mean_pos))] = np.arange(k)
    stage = rank[part].tolist()
    order = np.argsort(g.dst, kind="stable")
    for s, d in zip(g.src[order].tolist(), g.dst[order].tolist()):
        if stage[s] > stage[d]:
            stage[d] = stage[s]
    out = np.asarray(stage, np.int64)
    out[[i for i, kind in enumerate(g.kinds) if kind == "output"]] = k - 1
    return out


# --- boundary refinement -------------------------------------------------------------------------------


def refine(p: Problem, stage: np.ndarray, max_rounds: int | None = None) -> Evaluation:
    """Greedy moves off the worst stage that keep every edge pointing forward; exact objective decides."""
    g, k = p.graph, p.num_stages
    best = evaluate(p, stage)
    if k == 1:
        return best
    fixed = np.array([kind == "output" for kind in g.kinds])
    node_w = ((1 - p.memory_weight) * p.time / p.norm_time
              + p.memory_weight * (g.act_bytes * 1.0) / p.norm_mem)
    rounds = max_rounds if max_rounds is not None else (8 * k if g.num_nodes <= 100_000 else 2 * k)
    budget = p.device_memory
    for _ in range(rounds):
        stage = best.stage
        worst = int(np.argmax(best.score))
        pm = g.predecessors_max(stage)
        sm = g.successors_min(stage, k)
        in_worst = (stage == worst) & ~fixed
        if in_worst.sum() <= 1:
            break
        options = []
        if worst > 0:
            options.append((worst - 1, np.flatnonzero(in_worst & (pm <= worst - 1))))
        if worst < k - 1:
            options.append((worst + 1, np.flatnonzero(in_worst & (sm >= worst + 1))[::-1]))
        options.sort(key=lambda o: best.score[o[0]])
        improved = False
        for target, nodes in options:
            if len(nodes) == 0:
                continue
            gap = (best.score[worst] - best.score[target]) / 2
            take = int(np.searchsorted(np.cumsum(node_w[nodes]), gap, side="right"))
            take = min(max(take, 1), int(in_worst.sum()) - 1)
            while take >= 1:
                trial = stage.copy()
                trial[nodes[:take]] = target
                ev = evaluate(p, trial)
                if ev.key(budget) < best.key(budget):
                    best, improved = ev, True
                    break
                take //= 2
            if improved:
                break
        if not improved:
            break
    return best
