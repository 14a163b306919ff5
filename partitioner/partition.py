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

import dataclasses
from typing import Any

import numpy as np
import pymetis
import torch

from .cost import DeviceRates, calibrate, estimate, measure as measure_costs
from .graph import OpGraph, unique_ints
from .objective import Evaluation, Problem, budget_error, evaluate, make_plan
from .plan import PartitionPlan
from .trace import trace

__all__ = ["partition", "METHODS", "MAX_POSITIONS", "parse_size", "make_problem", "fixed_plan"]

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
        raise budget_error(p, _least_memory(p))
    return make_plan(p, best, name)


def _least_memory(p: Problem) -> Evaluation:
    """The plan whose largest stage needs the least memory (for the numbers in a budget error)."""
    q = dataclasses.replace(p, memory_weight=1.0, device_memory=None)
    return refine(q, dp_partition(q))


# --- the chain DP --------------------------------------------------------------------------------------


def _prefix(p: Problem) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Prefix sums over the topological order and the bytes live across each cut position."""
    g = p.graph
    n = g.num_nodes
    T = np.concatenate([[0.0], np.cumsum(p.time)])
    P = np.concatenate([[0.0], np.cumsum(p.node_param_mem())])
    A = np.concatenate([[0.0], np.cumsum(g.act_bytes.astype(np.float64))])
    cut = np.zeros(n + 2)
    first, last, nbytes = _value_spans(g)
    np.add.at(cut, first + 1, nbytes)
    np.add.at(cut, last + 1, -nbytes)
    return T, P, A, np.cumsum(cut)[: n + 1]


def _value_spans(g: OpGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each value read after the op that produces it: the producer's position, the last reader's
    position and its bytes (it crosses every cut in between)."""
    n, nv = g.num_nodes, len(g.value_bytes)
    first = np.full(nv, n, np.int64)
    last = np.full(nv, -1, np.int64)
    if g.num_edges:
        np.minimum.at(first, g.value, g.src)
        np.maximum.at(last, g.value, g.dst)
    live = last > first
    return first[live], last[live], g.value_bytes[live]


def _live_values(g: OpGraph) -> np.ndarray:
    """Per cut position, how many values are live across it (each is one message)."""
    n = g.num_nodes
    first, last, _ = _value_spans(g)
    count = np.bincount(first + 1, minlength=n + 2) - np.bincount(last + 1, minlength=n + 2)
    return np.cumsum(count)[: n + 1]


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
        # One message per value live across the cut (objective.evaluate pays latency per value sent).
        self.comm = 2.0 * (self.cut / r.link_bytes_per_s + _live_values(p.graph) * r.link_latency_s)
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

    def grid(self, s: int, cand: np.ndarray, comm: np.ndarray) -> np.ndarray:
        """score(s, cand[a], cand[b]) for every candidate pair, with the segment communication ``comm``
        of :func:`_grid_comm` instead of the per-cut estimate."""
        I, J = cand[:, None], cand[None, :]
        time = self.T[J] - self.T[I] + comm
        mem = self.P[J] - self.P[I] + self.p.inflight[s] * (self.A[J] - self.A[I])
        score = self.wt * time + self.wm * mem
        bad = I >= J
        if self.p.device_memory is not None:
            bad = bad | (mem > self.p.device_memory)
        return np.where(bad, np.inf, score)


def _grid_comm(p: Problem, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Communication of every candidate segment ``[cand[a], cand[b])`` as its own stage: seconds (values
    in and out, activations forward and gradients back, as :func:`objective.evaluate` prices them) and the
    bytes it receives.

    A value counts as received by a segment when it is produced before the segment and read inside it --
    exactly once per (value, consumer stage), as ``evaluate`` counts it, so a skip connection costs only the
    stages that produce and read it, not the ones it passes over. A value sent to later stages counts once
    on the sending side (a segment cannot know how the stages after it are cut). Each crossing is a
    rectangle of segments (a range of starts times a range of ends), so the whole table is a 2-D prefix sum
    over O(edges) corner updates.
    """
    g, r = p.graph, p.rates
    N = len(cand)
    secs = np.zeros((N + 1) * (N + 1))
    recv = np.zeros((N + 1) * (N + 1))
    if g.num_edges:
        nv = len(g.value_bytes)
        producer = np.zeros(nv, np.int64)
        producer[g.value] = g.src
        interval = np.searchsorted(cand, producer, side="right") - 1   # candidate interval of each producer
        key = unique_ints(g.value * N + (np.searchsorted(cand, g.dst, side="right") - 1))
        v, q = key // N, key % N                                        # (value, consumer interval), sorted
        keep = q != interval[v]
        v, q = v[keep], q[keep]
        if len(v):
            first = np.ones(len(v), bool)
            first[1:] = v[1:] != v[:-1]
            last = np.ones(len(v), bool)
            last[:-1] = v[1:] != v[:-1]
            prev_q = np.where(first, interval[v], np.concatenate([[0], q[:-1]]))
            nbytes = g.value_bytes[v].astype(np.float64)
            cost = 2.0 * (nbytes / r.link_bytes_per_s + r.link_latency_s)

            def rect(out, r0, r1, c0, c1, w):  # add w to out[r0..r1, c0..c1]
                for rows, cols, sign in ((r0, c0, 1), (r0, c1 + 1, -1), (r1 + 1, c0, -1), (r1 + 1, c1 + 1, 1)):
                    out += np.bincount(rows * (N + 1) + cols, weights=sign * w, minlength=(N + 1) * (N + 1))

            # Received: starts after the producer's interval up to this reader's, ends past this reader.
            rect(secs, prev_q + 1, q, q + 1, np.full_like(q, N - 1), cost)
            rect(recv, prev_q + 1, q, q + 1, np.full_like(q, N - 1), nbytes)
            # Sent (once per value): segments holding the producer that end before its last reader.
            pv, lq = interval[v[last]], q[last]
            rect(secs, np.zeros_like(pv), pv, pv + 1, lq, cost[last])
    shape = (N + 1, N + 1)
    return (secs.reshape(shape).cumsum(0).cumsum(1)[:N, :N], recv.reshape(shape).cumsum(0).cumsum(1)[:N, :N])


def dp_partition(p: Problem) -> np.ndarray:
    """Stage of every node under the best contiguous partition (see module docstring)."""
    k, n = p.num_stages, p.graph.num_nodes
    sc = _Scorer(p)
    cand = _candidates(sc.T, sc.cut)
    if n > 1 and not p.placeable[n - 1]:  # no stage of the output node alone: it would do no work
        cand = cand[cand != n - 1]
    N = len(cand)
    comm, recv = _grid_comm(p, cand)
    mats = [sc.grid(s, cand, comm) for s in range(k)] if _stage_dependent(p) else [sc.grid(0, cand, comm)] * k
    del comm
    prev = mats[0][0].copy()
    parents = []
    for s in range(1, k):
        both = np.maximum(prev[:, None], mats[s])
        parents.append(both.argmin(axis=0))
        prev = both[parents[-1], np.arange(N)]
    best = prev[N - 1]
    bounds = _backtrack(parents, N)
    if np.isfinite(best) and k > 1:
        bounds = _fewest_cut_bytes(mats, recv, best) or bounds
    pos = cand[bounds]
    stage = np.searchsorted(pos, np.arange(n), side="right") - 1
    if N < n + 1:  # boundaries were placed on a coarse grid: refine them at full resolution, keep the better
        moved = np.searchsorted(_reposition(sc, pos), np.arange(n), side="right") - 1
        if evaluate(p, moved).key(p.device_memory) < evaluate(p, stage).key(p.device_memory):
            stage = moved
    return stage


def _stage_dependent(p: Problem) -> bool:
    return (p.memory_weight > 0 or p.device_memory is not None) and len(set(p.inflight.tolist())) > 1


def _backtrack(parents: list[np.ndarray], N: int) -> list[int]:
    bounds = [N - 1]
    for par in reversed(parents):
        bounds.append(int(par[bounds[-1]]))
    bounds.append(0)
    return bounds[::-1]


def _fewest_cut_bytes(mats: list[np.ndarray], recv: np.ndarray, best: float) -> list[int] | None:
    """Among partitions whose every stage scores <= best, the one that cuts the fewest bytes (the sum over
    stages of the bytes each receives, ``recv[a, b]`` for the segment between candidates a and b)."""
    limit = best * (1 + 1e-9) + 1e-15
    k, N = len(mats), len(recv)
    prev = np.where(mats[0][0] <= limit, 0.0, np.inf)
    parents = []
    for s in range(1, k):
        total = np.where(mats[s] <= limit, prev[:, None] + recv, np.inf)
        parents.append(total.argmin(axis=0))
        prev = total[parents[-1], np.arange(N)]
    return _backtrack(parents, N) if np.isfinite(prev[N - 1]) else None


def _reposition(sc: _Scorer, pos: np.ndarray, sweeps: int = 3) -> np.ndarray:
    """Move each boundary to its best full-resolution position between its neighbours."""
    pos = pos.copy()
    for _ in range(sweeps):
        before = pos.copy()
        for b in range(1, len(pos) - 1):
            xs = np.arange(pos[b - 1] + 1, pos[b + 1])
            if len(xs) == 0:
                continue
            worst = np.maximum(sc(b - 1, np.full_like(xs, pos[b - 1]), xs), sc(b, xs, np.full_like(xs, pos[b + 1])))
            # The lowest worst score, ties to the fewest live bytes, then the earliest position (what a
            # stable lexsort on (cut, worst) picks, without sorting 10^5 positions).
            tied = np.flatnonzero(worst == worst.min())
            pos[b] = xs[tied[np.argmin(sc.cut[xs[tied]])]]
        if np.array_equal(pos, before):  # a sweep that moves nothing would repeat itself
            break
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


def fixed_plan(graph: OpGraph, num_stages: int, stage: Any, *, method: str = "manual", **options: Any) -> PartitionPlan:
    """A plan for a given op -> stage assignment (hand placement), scored like any other plan."""
    p = make_problem(graph, num_stages, **options)
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
