"""The estimate's time per stage: the least bottleneck of a model's ops cut, in order, into contiguous stages that
each fit the memory budget (:func:`chain_bottleneck`), what :meth:`partitioner.layout.score.LayoutScorer.bound`
orders candidates by.

A search at scale asks for many chains (a 1T-parameter GPT on 3,072 devices some 10^4, of up to a hundred stages,
each a bisection of a dozen greedy packings), so a packing step is kept to a few Python operations: the running sums
are a Python list searched with :func:`bisect.bisect_right` (the same comparisons of the same doubles as
``np.searchsorted(side="right")``, without numpy's per-call overhead on one scalar: several times faster), and how
far a stage starting at each op can reach within the memory budget with f microbatches in flight, which does not
depend on the cap, is computed once, vectorised, and kept (up to a memory limit, :class:`ReachCache`) for every chain
of the same ops (:class:`Chain`).
"""
from __future__ import annotations

import math
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

__all__ = ["Chain", "ReachCache", "chain_bottleneck"]


class ReachCache:
    """The reach arrays of :meth:`Chain.reach`, least recently used dropped past ``limit`` bytes: a search over
    thousands of microbatch counts would keep a gigabyte of them, most never asked for again. Keys hold the
    chain's id: give one cache only to chains that live as long as it does."""

    def __init__(self, limit: int = 256 << 20) -> None:
        self.limit, self.size = limit, 0
        self._arrays: OrderedDict[tuple[int, int], array] = OrderedDict()

    def get(self, key: tuple[int, int]) -> array | None:
        """The array kept under ``key`` (now the most recently used), or None."""
        found = self._arrays.get(key)
        if found is not None:
            self._arrays.move_to_end(key)
        return found

    def put(self, key: tuple[int, int], reach: array) -> None:
        """Keep ``reach`` under ``key``, dropping the least recently used past the limit."""
        self._arrays[key] = reach
        self.size += reach.itemsize * len(reach)
        while self.size > self.limit and len(self._arrays) > 1:
            _, old = self._arrays.popitem(last=False)
            self.size -= old.itemsize * len(old)


class Chain:
    """A sequence of ops (``seconds`` each, in order) to cut into contiguous stages; with a ``budget``, stage s must
    also hold its ops' ``fixed`` bytes and ``in_flight[s]`` times their ``acts``. Its running sums, and per count
    of microbatches in flight the farthest op each op's stage can reach within the budget, are computed once."""

    def __init__(self, seconds: np.ndarray, *, fixed: np.ndarray | None = None, acts: np.ndarray | None = None,
                 budget: float | None = None, kept: ReachCache | None = None) -> None:
        t = np.asarray(seconds, np.float64)
        self.ops = len(t)
        self.cum: list[float] = np.concatenate([[0.0], np.cumsum(t)]).tolist()
        self.largest = float(t.max(initial=0.0))
        self.budget = budget if budget is not None and fixed is not None and acts is not None else None
        self._held: tuple[np.ndarray, np.ndarray] | None = None
        if self.budget is not None:
            cf, ca = (np.concatenate([[0.0], np.cumsum(np.asarray(x, np.float64))]) for x in (fixed, acts))
            self._held = (cf, ca)
        self._kept = kept if kept is not None else ReachCache()

    def reach(self, flight: int) -> array:
        """Per start position (0 .. ops), the last position a stage starting there reaches within the budget with
        ``flight`` microbatches in flight."""
        found = self._kept.get((id(self), flight))
        if found is None:
            assert self._held is not None and self.budget is not None
            held = self._held[0] + flight * self._held[1]
            # An array of C ints, not a list: indexed as fast, at a seventh of the memory
            found = array("i", (np.searchsorted(held, held + self.budget, side="right") - 1).astype(np.intc).tobytes())
            self._kept.put((id(self), flight), found)
        return found

    def fits(self, cap: float, stages: int, in_flight: Sequence[int] = ()) -> bool:
        """Whether greedy packing (each stage takes ops while their seconds stay within ``cap`` and, with a budget,
        their memory within it) covers every op in at most ``stages`` stages."""
        return self._packs(cap, stages, self._reaches(stages, in_flight))

    def _reaches(self, stages: int, in_flight: Sequence[int]) -> list[array]:
        """Per stage, :meth:`reach` of its microbatches in flight (none without a budget)."""
        return [self.reach(f) for f in in_flight[:stages]] if self.budget is not None else []

    def _packs(self, cap: float, stages: int, reaches: list[array]) -> bool:
        cum, ops, pos = self.cum, self.ops, 0
        for s in range(stages):
            end = bisect_right(cum, cum[pos] + cap) - 1
            if reaches and reaches[s][pos] < end:
                end = reaches[s][pos]
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
        reaches = self._reaches(stages, in_flight)
        lo = max(total / stages, largest)
        hi = lo + largest  # without memory, greedy packing always fits under T/k + the largest op
        if not self._packs(hi, stages, reaches):
            hi = total + largest
            if not self._packs(hi, stages, reaches):
                return math.inf
        while hi - lo > rtol * lo:
            cap = (lo + hi) / 2
            lo, hi = (lo, cap) if self._packs(cap, stages, reaches) else (cap, hi)
        return hi


def chain_bottleneck(seconds: np.ndarray, stages: int, *, fixed: np.ndarray | None = None,
                     acts: np.ndarray | None = None, in_flight: Sequence[int] = (), budget: float | None = None,
                     rtol: float = 1e-3) -> float:
    """The least bottleneck of ``seconds`` (per op, in order) cut into at most ``stages`` contiguous runs, to
    ``rtol`` (:meth:`Chain.bottleneck`). With a ``budget``, stage s must also hold its ops' ``fixed`` bytes and
    ``in_flight[s]`` times their ``acts``: infinity when no contiguous cut fits. (:class:`Chain` keeps what every
    cut of the same ops shares.)"""
    return Chain(seconds, fixed=fixed, acts=acts, budget=budget).bottleneck(stages, in_flight, rtol)
