"""The estimate's time per stage: the least bottleneck of a model's ops cut, in order, into contiguous stages that
each fit the memory budget (:func:`chain_bottleneck`), what :meth:`partitioner.layout.score.LayoutScorer.bound`
orders candidates by.

A search at scale asks for many chains (a 1T-parameter GPT on 3,072 devices some 10^4, of up to a hundred stages,
each a bisection of a dozen greedy packings), so a packing step is kept to a few Python operations: the running sums
are searched with :func:`bisect.bisect_right` (the same comparisons of the same doubles as
``np.searchsorted(side="right")``, without numpy's per-call overhead on one scalar: several times faster). How far a
stage may reach within the memory budget is asked only where a packing step would go past it: the memory held from
the stage's first op to the step's last is one sum of the same doubles, and only a step the budget stops is searched
again, within itself, its reach kept for the bisection's other probes (it does not depend on the cap). Computing
every op's reach for every count of microbatches in flight up front took most of the estimate's time: a chain is
packed a few dozen times, a reach array is 10^4 ops long.
"""
from __future__ import annotations

import math
from array import array
from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

__all__ = ["Chain", "chain_bottleneck"]


class Chain:
    """A sequence of ops (``seconds`` each, in order) to cut into contiguous stages; with a ``budget``, stage s must
    also hold its ops' ``fixed`` bytes and ``in_flight[s]`` times their ``acts``. Its running sums are computed
    once."""

    def __init__(self, seconds: np.ndarray, *, fixed: np.ndarray | None = None, acts: np.ndarray | None = None,
                 budget: float | None = None) -> None:
        t = np.asarray(seconds, np.float64)
        self.ops = len(t)
        self.cum: list[float] = np.concatenate([[0.0], np.cumsum(t)]).tolist()
        self.largest = float(t.max(initial=0.0))
        self.budget = budget if budget is not None and fixed is not None and acts is not None else None
        # Running sums of the memory: arrays of doubles, read as fast as lists at a quarter of the memory (a search
        # keeps a chain per tp degree, microbatch size, checkpointing and state sharding: a thousand at scale)
        self._fixed, self._acts = array("d"), array("d")
        if self.budget is not None:
            for held, x in ((self._fixed, fixed), (self._acts, acts)):
                held.frombytes(np.concatenate([[0.0], np.cumsum(np.asarray(x, np.float64))]).tobytes())

    def fits(self, cap: float, stages: int, in_flight: Sequence[int] = ()) -> bool:
        """Whether greedy packing (each stage takes ops while their seconds stay within ``cap`` and, with a budget,
        their memory within it) covers every op in at most ``stages`` stages."""
        return self._packs(cap, stages, in_flight, {})

    def _packs(self, cap: float, stages: int, in_flight: Sequence[int], reached: dict[tuple[int, int], int]) -> bool:
        """Greedy packing (:meth:`fits`); ``reached``: the memory reaches found so far, by (start, microbatches in
        flight), which do not depend on ``cap`` (a bisection's probes share them)."""
        cum, ops, pos = self.cum, self.ops, 0
        fixed, acts, budget = self._fixed, self._acts, self.budget if in_flight else None
        for s in range(stages):
            end = bisect_right(cum, cum[pos] + cap) - 1
            if budget is not None and end > pos:
                # Held memory never falls along the ops: the stage's reach is the last op whose memory stays within
                # its first's plus the budget (np.searchsorted(held, held[pos] + budget, side="right") - 1, held =
                # fixed + f acts), looked for only when the step's last op is past it.
                f = in_flight[s]
                limit = (fixed[pos] + f * acts[pos]) + budget
                if fixed[end] + f * acts[end] > limit:
                    if (pos, f) not in reached:
                        reached[(pos, f)] = pos + bisect_right(range(pos, end), limit,
                                                               key=lambda j: fixed[j] + f * acts[j]) - 1
                    end = reached[(pos, f)]
            if end > pos:
                pos = end
            if pos >= ops:
                return True
        return False

    def bottleneck(self, stages: int, in_flight: Sequence[int] = (), rtol: float = 1e-3) -> float:
        """The least bottleneck of the ops cut into at most ``stages`` contiguous stages, to ``rtol``: bisection on
        the bottleneck, each probe packed greedily (the classic linear-partition bound; greedy packing is optimal
        for contiguous runs); infinity when, with a budget, no contiguous cut fits it."""
        largest, total = self.largest, self.cum[-1]
        reached: dict[tuple[int, int], int] = {}
        lo = max(total / stages, largest)
        hi = lo + largest  # without memory, greedy packing always fits under T/k + the largest op
        if not self._packs(hi, stages, in_flight, reached):
            hi = total + largest
            if not self._packs(hi, stages, in_flight, reached):
                return math.inf
        while hi - lo > rtol * lo:
            cap = (lo + hi) / 2
            lo, hi = (lo, cap) if self._packs(cap, stages, in_flight, reached) else (cap, hi)
        return hi


def chain_bottleneck(seconds: np.ndarray, stages: int, *, fixed: np.ndarray | None = None,
                     acts: np.ndarray | None = None, in_flight: Sequence[int] = (), budget: float | None = None,
                     rtol: float = 1e-3) -> float:
    """The least bottleneck of ``seconds`` (per op, in order) cut into at most ``stages`` contiguous runs, to
    ``rtol`` (:meth:`Chain.bottleneck`). With a ``budget``, stage s must also hold its ops' ``fixed`` bytes and
    ``in_flight[s]`` times their ``acts``: infinity when no contiguous cut fits. (:class:`Chain` keeps what every
    cut of the same ops shares.)"""
    return Chain(seconds, fixed=fixed, acts=acts, budget=budget).bottleneck(stages, in_flight, rtol)
