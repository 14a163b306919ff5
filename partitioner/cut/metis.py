"""METIS k-way partitioning of the op graph, repaired into acyclic pipeline stages.

Multilevel k-way partitioning (Karypis & Kumar, "A fast and high quality multilevel scheme for partitioning
irregular graphs", SIAM J. Sci. Comput. 20(1), 1998) through pymetis, with two vertex constraints (compute,
memory) and edge weights = bytes. METIS knows nothing of direction, so its parts are ordered by mean
topological position and every op is pushed to at least the stage of its producers: the result is acyclic
by construction, and :func:`partitioner.cut.refine.refine` then moves ops back across the boundaries.
"""
from __future__ import annotations

import numpy as np
import pymetis

from ..capture.graph import OpGraph
from .objective import Problem

__all__ = ["metis_partition", "repair"]



def metis_partition(p: Problem) -> np.ndarray:
    """Stage of every node: METIS's k-way parts (seeded), repaired to be acyclic (:func:`repair`)."""
    g, k = p.graph, p.num_stages
    n = g.num_nodes
    if g.num_edges == 0:
        return np.minimum(np.arange(n) * k // max(n, 1), k - 1)
    key = np.unique(g.src * n + g.dst, return_inverse=True)
    pairs, inverse = key
    weight = np.zeros(len(pairs))
    np.add.at(weight, inverse, p.value_bytes[g.value])
    a, b = pairs // n, pairs % n
    rows = np.concatenate([a, b])
    cols = np.concatenate([b, a])
    w = np.concatenate([weight, weight])
    order = np.lexsort((cols, rows))
    rows, cols, w = rows[order], cols[order], w[order]
    xadj = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=n))]).astype(np.int64)
    ew = (1 + np.round(w / max(w.max(), 1.0) * 1e5)).astype(np.int64)
    t = p.time / max(p.time.sum(), 1e-30)
    mem = p.node_param_mem() + p.act_bytes
    m = mem / max(float(mem.sum()), 1.0)
    vw = np.stack([1 + np.round(t * 1e6), 1 + np.round(m * 1e6)], axis=1).astype(np.int64).ravel()
    opts = pymetis.Options(seed=p.options.seed)
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
