"""The estimate's time per stage: the least bottleneck of a model's ops cut, in order, into contiguous stages that
each fit the memory budget (:func:`chain_bottleneck`), what :meth:`partitioner.layout.score.LayoutScorer.bound`
orders candidates by."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["chain_bottleneck"]


def chain_bottleneck(seconds: np.ndarray, stages: int, *, fixed: np.ndarray | None = None,
                     acts: np.ndarray | None = None, in_flight: Sequence[int] = (), budget: float | None = None,
                     rtol: float = 1e-3) -> float:
    """The least bottleneck of ``seconds`` (per op, in order) cut into at most ``stages`` contiguous runs, to
    ``rtol``: bisection on the bottleneck, each probe packed greedily (the classic linear-partition bound; greedy
    packing is optimal for contiguous runs). With a ``budget``, stage s must also hold its ops' ``fixed`` bytes and
    ``in_flight[s]`` times their ``acts``: infinity when no contiguous cut fits."""
    t = np.asarray(seconds, np.float64)
    cum = np.concatenate([[0.0], np.cumsum(t)])
    memory: dict[int, np.ndarray] = {}
    if budget is not None and fixed is not None and acts is not None:
        cf, ca = (np.concatenate([[0.0], np.cumsum(np.asarray(x, np.float64))]) for x in (fixed, acts))
        memory = {f: cf + f * ca for f in set(in_flight)}

    def fits(cap: float) -> bool:
        pos = 0
        for s in range(stages):
            end = int(np.searchsorted(cum, cum[pos] + cap, side="right")) - 1
            if memory:
                held = memory[in_flight[s]]
                end = min(end, int(np.searchsorted(held, held[pos] + budget, side="right")) - 1)
            pos = max(pos, end)
            if pos >= len(t):
                return True
        return False

    largest = float(t.max(initial=0.0))
    lo = max(cum[-1] / stages, largest)
    hi = lo + largest  # without memory, greedy packing always fits under T/k + the largest op
    if not fits(hi):
        hi = cum[-1] + largest
        if not fits(hi):
            return math.inf
    while hi - lo > rtol * lo:
        cap = (lo + hi) / 2
        lo, hi = (lo, cap) if fits(cap) else (cap, hi)
    return hi
