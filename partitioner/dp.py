"""The chain DP: the exact minimum-bottleneck partition among those contiguous in the op graph's topological order.

Dynamic programming over cut positions, ``best[s][j] = min_i max(best[s-1][i], score(s, i, j))``, then a
second pass that keeps that bottleneck and minimises the bytes cut (the classic chain-partitioning DP;
Bokhari 1988 for chains-on-chains, cf. PipeDream, Narayanan et al. SOSP'19). A segment's score is its
stage's blended time and memory exactly as :func:`partitioner.objective.evaluate` prices it, communication
included: every value a segment receives or sends is counted once per (value, consumer stage), so a skip
connection costs only the stages that produce and read it (:func:`grid_comm`).

Graphs with more than ``MAX_POSITIONS`` ops are solved on the cheapest-cut position in each of
``MAX_POSITIONS`` windows of equal compute, then each boundary is re-placed at full resolution.
"""
from __future__ import annotations

import numpy as np

from .graph import OpGraph, unique_ints
from .objective import Problem, evaluate

__all__ = ["dp_partition", "grid_comm", "MAX_POSITIONS"]

MAX_POSITIONS = 1536



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
        self.wt = (1 - p.options.memory_weight) / p.norm_time
        self.wm = p.options.memory_weight / p.norm_mem

    def __call__(self, s: int, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        time = self.T[j] - self.T[i] + self.comm[i] + self.comm[j]
        mem = self.P[j] - self.P[i] + self.p.inflight[s] * (self.A[j] - self.A[i])
        score = self.wt * time + self.wm * mem
        bad = i >= j
        if self.p.budget is not None:
            bad = bad | (mem > self.p.budget)
        return np.where(bad, np.inf, score)

    def grid(self, s: int, cand: np.ndarray, comm: np.ndarray) -> np.ndarray:
        """score(s, cand[a], cand[b]) for every candidate pair, with the segment communication ``comm``
        of :func:`grid_comm` instead of the per-cut estimate."""
        starts, ends = cand[:, None], cand[None, :]
        time = self.T[ends] - self.T[starts] + comm
        mem = self.P[ends] - self.P[starts] + self.p.inflight[s] * (self.A[ends] - self.A[starts])
        score = self.wt * time + self.wm * mem
        bad = starts >= ends
        if self.p.budget is not None:
            bad = bad | (mem > self.p.budget)
        return np.where(bad, np.inf, score)


def grid_comm(p: Problem, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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
    comm, recv = grid_comm(p, cand)
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
        if evaluate(p, moved).key(p.budget) < evaluate(p, stage).key(p.budget):
            stage = moved
    return stage


def _stage_dependent(p: Problem) -> bool:
    return (p.options.memory_weight > 0 or p.budget is not None) and len(set(p.inflight.tolist())) > 1


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
