"""Segments of an op graph's topological order, what the chain DP (:mod:`partitioner.cut.dp`) cuts: prefix sums of
the ops' seconds and memory along the order (:func:`prefix_sums`), the values live across each cut position
(:func:`value_spans`, :func:`live_values`), the positions a boundary may take (:func:`candidate_positions`) and the
communication of every segment between two of them (:func:`grid_comm`)."""
from __future__ import annotations

import numpy as np

from ..capture.graph import OpGraph, unique_ints
from .objective import Problem

__all__ = ["MAX_POSITIONS", "CHEAP_POSITIONS", "prefix_sums", "value_spans", "live_values", "candidate_positions",
           "grid_comm"]

MAX_POSITIONS = 1536
CHEAP_POSITIONS = 512    # of MAX_POSITIONS, kept for the cheapest cuts of the whole graph


def prefix_sums(p: Problem) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Prefix sums over the topological order (time, parameter memory, activation bytes) and the bytes
    live across each cut position."""
    g = p.graph
    n = g.num_nodes
    T = np.concatenate([[0.0], np.cumsum(p.time)])
    P = np.concatenate([[0.0], np.cumsum(p.node_param_mem())])
    A = np.concatenate([[0.0], np.cumsum(p.act_bytes)])
    cut = np.zeros(n + 2)
    first, last, nbytes = value_spans(g, p.value_bytes)
    np.add.at(cut, first + 1, nbytes)
    np.add.at(cut, last + 1, -nbytes)
    return T, P, A, np.cumsum(cut)[: n + 1]


def value_spans(g: OpGraph, value_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each value read after the op that produces it: the producer's position, the last reader's
    position and its bytes (it crosses every cut in between)."""
    n, nv = g.num_nodes, len(g.value_bytes)
    first = np.full(nv, n, np.int64)
    last = np.full(nv, -1, np.int64)
    if g.num_edges:
        np.minimum.at(first, g.value, g.src)
        np.maximum.at(last, g.value, g.dst)
    live = last > first
    return first[live], last[live], value_bytes[live]


def live_values(g: OpGraph) -> np.ndarray:
    """Per cut position, how many values are live across it (each is one message)."""
    n = g.num_nodes
    first, last, _ = value_spans(g, g.value_bytes)
    count = np.bincount(first + 1, minlength=n + 2) - np.bincount(last + 1, minlength=n + 2)
    return np.cumsum(count)[: n + 1]


def candidate_positions(T: np.ndarray, cut: np.ndarray) -> np.ndarray:
    """The cut positions the DP places boundaries at (``T``: prefix sums of the ops' seconds, ``cut``: the bytes live
    across each position): all of them up to :data:`MAX_POSITIONS`, else the cheapest cut in each window of equal
    compute and the :data:`CHEAP_POSITIONS` cheapest overall."""
    n = len(T) - 1
    if n + 1 <= MAX_POSITIONS:
        return np.arange(n + 1)
    order = np.lexsort((np.arange(1, n), cut[1:n]))  # interior positions by cut, then position
    # One position per window of equal compute: the one with the fewest live bytes.
    windows = MAX_POSITIONS - CHEAP_POSITIONS
    edges = np.unique(np.searchsorted(T, np.linspace(0, T[-1], windows - 1), side="left"))
    edges = edges[(edges > 0) & (edges < n)]
    starts = np.concatenate([[1], edges])
    rank = np.empty(n - 1, np.int64)
    rank[order] = np.arange(n - 1)
    best_rank = np.minimum.reduceat(rank, starts - 1)
    return np.unique(np.concatenate([[0], order[best_rank] + 1, order[:CHEAP_POSITIONS] + 1, [n]]))


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
            nbytes = p.value_bytes[v]
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
