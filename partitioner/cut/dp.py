"""The chain DP: the best partition among those contiguous in the op graph's topological order.

Dynamic programming over cut positions, ``best[s][j] = min_i max(best[s-1][i], time(s, i, j))`` (the
classic chain-partitioning DP; Bokhari 1988 for chains-on-chains, cf. PipeDream, Narayanan et al.
SOSP'19). A segment's time is its stage's compute plus communication exactly as
:func:`partitioner.cut.objective.evaluate` prices it: every value a segment receives or sends is counted once
per (value, consumer stage), so a skip connection costs only the stages that produce and read it
(:func:`partitioner.cut.segments.grid_comm`).

The objective blends the bottleneck with the largest stage's memory (:mod:`partitioner.cut.objective`), which
a min-max DP cannot score directly; but for a cap on every stage's memory the DP gives the least
bottleneck, so the best blend lies on that Pareto front: the DP runs for a few caps between the least
memory any plan needs and the memory of the fastest plan, and keeps the best. A second pass keeps every
stage within 1% (:data:`partitioner.cut.objective.NEAR`) of that plan's bottleneck and memory and, among
those plans, cuts the fewest bytes, then holds the fewest activation bytes in flight. Both plans go to the
portfolio, which picks between them (:func:`partitioner.cut.objective.choose`).

Graphs with more than :data:`partitioner.cut.segments.MAX_POSITIONS` ops are solved on a subset of the cut
positions: the cheapest cut in each of many windows of equal compute, plus the cheapest cuts overall (in a
transformer, the residual stream between blocks); the best plan's boundaries are then also re-placed at full
resolution, a third candidate.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np

from .objective import NEAR, Problem
from .segments import candidate_positions, grid_comm, live_values, prefix_sums

__all__ = ["dp_partition"]

CAP_GRID = 9             # memory caps tried between the least and the fastest plan's memory ...
CAP_REFINE = 6           # ... then golden-section steps around the best of them
BAND_START = 1.05        # the min-max DP's first bound on the bottleneck: this times the mean stage ...
BAND_GROWTH = 1.5        # ... grown by this factor until a partition is found under it
BAND_SLACK = 1e-6        # a band's width is widened this much, so rounding in segment costs never narrows it


class _Grid:
    """Every segment between two candidate positions: its time (a matrix), the bytes it receives (a
    matrix) and, per stage, its memory (from prefix sums, on demand)."""

    def __init__(self, p: Problem):
        self.p = p
        self.T, self.P, self.A, self.cut = prefix_sums(p)
        n = p.graph.num_nodes
        cand = candidate_positions(self.T, self.cut)
        if n > 1 and not p.placeable[n - 1]:  # no stage of the output node alone: it would do no work
            cand = cand[cand != n - 1]
        self.cand = cand
        comm, self.recv = grid_comm(p, cand)
        starts, ends = cand[:, None], cand[None, :]
        self.time = np.where(starts < ends, self.T[ends] - self.T[starts] + comm, np.inf)
        self.budget = np.inf if p.budget is None else p.budget
        self._firsts: dict[tuple[float, float], np.ndarray] = {}  # by (microbatches in flight, cap): asked again
        self._flights = list({float(f): s for s, f in enumerate(p.inflight)}.values())  # a stage of each count

    def level(self, s: int) -> np.ndarray:
        """Stage ``s``'s memory of the segment [cand[0], cand[b]) for every b (nondecreasing)."""
        return self.P[self.cand] + self.p.inflight[s] * self.A[self.cand]

    def first_start(self, s: int, cap: float) -> np.ndarray:
        """Per segment end, the first start whose segment fits ``cap`` bytes on stage ``s`` (memory grows
        with the segment, so the starts that fit are a suffix)."""
        key = (float(self.p.inflight[s]), float(cap))
        if key not in self._firsts:
            lv = self.level(s)
            self._firsts[key] = np.searchsorted(lv, lv - min(cap, self.budget) * (1 + 1e-12), side="left")
        return self._firsts[key]

    def starts_key(self, cap: float) -> bytes:
        """A digest of :meth:`first_start` on every stage under ``cap``: caps with the same one leave the DP the same
        segments to choose from, so the same partition (a golden section's caps often do)."""
        digest = hashlib.blake2b(digest_size=32)
        for s in self._flights:
            digest.update(self.first_start(s, cap).tobytes())
        return digest.digest()

    def floor(self) -> np.ndarray:
        """Memory levels whose rise over a segment is at most its memory on any stage (the fewest in flight)."""
        return self.P[self.cand] + min(self.p.inflight) * self.A[self.cand]

    def time_of(self, s: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Seconds of the segments [cand[a], cand[b]) (any stage)."""
        return self.time.ravel()[a * len(self.cand) + b]

    def memory_of(self, s: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Stage ``s``'s bytes of the segments [cand[a], cand[b]) (infinite unless a < b)."""
        lv = self.level(s)
        return np.where(a < b, lv[b] - lv[a], np.inf)

    def axes(self, bounds: list[int]) -> tuple[float, float]:
        """Bottleneck seconds and largest stage memory of the plan cut at candidates ``bounds``."""
        segs = list(zip(bounds[:-1], bounds[1:]))
        return (max(float(self.time[a, b]) for a, b in segs),
                max(float(self.level(s)[b] - self.level(s)[a]) for s, (a, b) in enumerate(segs)))

    def blend(self, bounds: list[int] | None) -> float:
        if bounds is None:
            return np.inf
        t, m = self.axes(bounds)
        w = self.p.options.memory_weight
        return (1 - w) * t / self.p.norm_time + w * m / self.p.norm_mem


def _cells(level: np.ndarray, width: float, first: np.ndarray, s: int, k: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stage ``s`` of ``k`` in a partition whose every segment costs at most ``width`` and at least the rise of
    ``level`` (nondecreasing) over it: the ends b it can reach and still leave the rest to the later stages
    (``cols``), and per end, as rows, the starts a of the band ``level[b] - level[a] <= width``, ``a >= first[b]``,
    with which are real (``a < b``). Both are widened a little (:data:`BAND_SLACK`) so rounding never narrows
    them."""
    N = len(level)
    if not np.isfinite(width):
        cols, lo = np.arange(N), np.asarray(first)
    else:
        w = width * (1 + BAND_SLACK)
        rise = level - level[0]
        cols = np.flatnonzero((rise <= (s + 1) * w) & (rise[-1] - rise <= (k - 1 - s) * w))
        lo = np.maximum(np.searchsorted(level, level[cols] - w, side="left"), first[cols])
    rows = int((cols - lo).max(initial=0))
    a = lo[None, :] + np.arange(max(rows, 0))[:, None]
    real = a < cols[None, :]
    return cols, np.where(real, a, 0), real


def _min_max(seg: Callable[[int, np.ndarray, np.ndarray], np.ndarray], k: int, N: int,
             level: np.ndarray, first: Callable[[int], np.ndarray] | None = None,
             at_least: float = 0.0) -> tuple[float, list[int] | None]:
    """The partition into k segments (from candidate 0 to N-1) with the least largest ``seg(s, a, b)`` (stage s's
    cost of the segment between candidates a and b, for index arrays); a segment of stage s must start at or
    after ``first(s)[b]`` when given; no partition's is below ``at_least`` (a looser problem's least).

    ``best[s][b] = min_a max(best[s-1][a], seg(s, a, b))``, the first such a on ties, evaluated only where both
    terms are at most a bound U: a path to the optimum B <= U passes only through such cells, so values at most
    U are exact and so is the argmin among them (the terms above U are never the minimum there). A segment's
    cost on every stage is at least ``level[b] - level[a]`` (nondecreasing), so its starts lie in a band of width
    U, and a stage's ends in a window that s + 1 segments reach and k - s - 1 complete (:func:`_cells`). U starts
    at the mean and grows until a partition is found; once U covers every level, nothing is cut off. A pass with U
    below ``at_least``, or once a stage ends nowhere, finds nothing: it is skipped, or left."""
    if at_least == np.inf:  # the looser problem has no partition: neither has this one
        return np.inf, None
    zero = np.zeros(N, np.int64)
    widest = float(level[-1] - level[0])
    bound = widest / k * BAND_START
    while True:
        full = not bound < widest
        U = np.inf if full else bound
        if U < at_least:
            bound = bound * BAND_GROWTH if bound > 0 else np.inf
            continue
        prev = seg(0, zero, np.arange(N))
        if first is not None:
            prev = np.where(first(0) <= 0, prev, np.inf)
        prev = np.where(prev <= U, prev, np.inf)
        parents = []
        for s in range(1, k):
            cols, a, real = _cells(level, U, zero if first is None else first(s), s, k)
            best, parent = np.full(N, np.inf), np.zeros(N, np.int64)
            if len(a):
                both = np.where(real, np.maximum(prev[a], seg(s, a, np.broadcast_to(cols, a.shape))), np.inf)
                off = both.argmin(axis=0)
                at = np.arange(len(cols))
                best[cols] = np.where(both[off, at] <= U, both[off, at], np.inf)
                parent[cols] = a[off, at]
            prev = best
            parents.append(parent)
            if not np.isfinite(prev).any():  # no later stage can end anywhere either
                break
        value = float(prev[N - 1])
        if np.isfinite(value) or full:
            return value, (_backtrack(parents, N) if np.isfinite(value) else None)
        bound = bound * BAND_GROWTH if bound > 0 else np.inf


def _best_blend(grid: _Grid, k: int) -> list[int] | None:
    """The partition with the best objective: the fastest one when memory does not count, else the best
    of the fastest ones under a range of memory caps (golden-section search around the best cap)."""
    seconds: dict[float, float] = {}  # cap -> the least bottleneck under it, which no smaller cap's is below
    known: dict[bytes, tuple[float, list[int] | None]] = {}  # by the stages' first starts (_Grid.starts_key)

    def fastest(cap: float) -> list[int] | None:  # the least-bottleneck partition whose stages fit cap bytes
        key = grid.starts_key(cap)
        if key not in known:
            at_least = max((t for c, t in seconds.items() if c >= cap), default=0.0)
            known[key] = _min_max(grid.time_of, k, len(grid.cand), grid.T[grid.cand],
                                  lambda s: grid.first_start(s, cap), at_least)
        seconds[cap], plan = known[key]
        return plan

    quickest = fastest(np.inf)
    if grid.p.options.memory_weight == 0 or quickest is None:
        return quickest
    least, _ = _min_max(grid.memory_of, k, len(grid.cand), grid.floor())
    most = grid.axes(quickest)[1]
    if most <= least * (1 + 1e-9):
        return quickest
    tried: dict[float, list[int] | None] = {most: quickest}  # cap -> fastest plan under it (None: none fits)
    # Larger caps first, each bounding the next; `tried` in increasing caps, the order the last min breaks ties by
    grid_caps = least * (most / least) ** np.linspace(0, 1, CAP_GRID)[:-1]
    found = {cap: fastest(cap) for cap in grid_caps[::-1]}
    tried.update((cap, found[cap]) for cap in grid_caps)
    caps = sorted(tried)
    i = min(range(len(caps)), key=lambda j: grid.blend(tried[caps[j]]))
    lo, hi = caps[max(i - 1, 0)], caps[min(i + 1, len(caps) - 1)]
    for _ in range(CAP_REFINE):  # golden section on log(cap)
        a = lo * (hi / lo) ** 0.382
        b = lo * (hi / lo) ** 0.618
        found = {cap: fastest(cap) for cap in (b, a) if cap not in tried}
        tried.update((cap, found[cap]) for cap in (a, b) if cap in found)
        lo, hi = (lo, b) if grid.blend(tried[a]) <= grid.blend(tried[b]) else (a, hi)
    return min(tried.values(), key=grid.blend)


def _fewest_cut_bytes(grid: _Grid, k: int, time_limit: float, mem_limit: float) -> list[int] | None:
    """Among partitions whose every stage takes <= ``time_limit`` and fits ``mem_limit``, the one that
    cuts the fewest bytes (the sum over stages of the bytes each receives), then holds the fewest
    activation bytes in flight. Only the cells of :func:`_cells` for ``time_limit`` are looked at: no other
    segment is fast enough, and no other end is on a partition whose every stage is."""
    N, A, T = len(grid.cand), grid.A[grid.cand], grid.T[grid.cand]

    def ok(s, a, b):
        return (grid.time[a, b] <= time_limit) & (a >= grid.first_start(s, mem_limit)[b])

    cut = np.where(ok(0, np.zeros(N, np.int64), np.arange(N)), grid.recv[0], np.inf)
    held = grid.p.inflight[0] * (A - A[0])
    parents = []
    for s in range(1, k):
        cols, a, real = _cells(T, time_limit, grid.first_start(s, mem_limit), s, k)
        parent = np.zeros(N, np.int64)
        new_cut, new_held = np.full(N, np.inf), np.full(N, np.inf)
        if len(a):
            b = np.broadcast_to(cols, a.shape)
            total = np.where(real & ok(s, a, b), cut[a] + grid.recv[a, b], np.inf)
            least = total.min(axis=0)
            held_all = np.where(total <= least[None, :], held[a] + grid.p.inflight[s] * (A[b] - A[a]), np.inf)
            off = held_all.argmin(axis=0)
            at = np.arange(len(cols))
            parent[cols], new_cut[cols], new_held[cols] = a[off, at], total[off, at], held_all[off, at]
        cut, held = new_cut, new_held
        parents.append(parent)
    return _backtrack(parents, N) if np.isfinite(cut[N - 1]) else None


def dp_partition(p: Problem) -> list[np.ndarray]:
    """Stage of every node under two contiguous partitions: the one with the best objective, then the one
    with the fewest bytes cut among those within 1% of it (see module docstring); when the DP ran on a
    subset of the cut positions, also the first with its boundaries re-placed at full resolution."""
    k, n = p.num_stages, p.graph.num_nodes
    grid = _Grid(p)
    N = len(grid.cand)
    best = _best_blend(grid, k)
    fits = best is not None
    if best is None:  # nothing fits the budget: the fastest plan, for the error's numbers
        best = _min_max(grid.time_of, k, N, grid.T[grid.cand])[1] or list(np.linspace(0, N - 1, k + 1).astype(int))
    found = [best]
    if k > 1 and fits:
        t, m = grid.axes(best)
        mem_limit = m * (1 + NEAR) if p.options.memory_weight > 0 else np.inf
        found.append(_fewest_cut_bytes(grid, k, t * (1 + NEAR), mem_limit) or best)
    positions = [grid.cand[b] for b in found]
    if N < n + 1:  # boundaries were placed on a subset of positions: re-place the best at full resolution
        positions.append(_reposition(p, grid, positions[0]))
    return [np.searchsorted(pos, np.arange(n), side="right") - 1 for pos in positions]


def _backtrack(parents: list[np.ndarray], N: int) -> list[int]:
    bounds = [N - 1]
    for par in reversed(parents):
        bounds.append(int(par[bounds[-1]]))
    bounds.append(0)
    return bounds[::-1]


def _reposition(p: Problem, grid: _Grid, pos: np.ndarray, sweeps: int = 3) -> np.ndarray:
    """Move each boundary to its best full-resolution position between its neighbours: the least
    objective, ties to the fewest live bytes, then the earliest position. Segment communication is
    estimated per cut (every value live across a boundary is sent once)."""
    r, w = p.rates, p.options.memory_weight
    T, P, A, cut = grid.T, grid.P, grid.A, grid.cut
    comm = 2.0 * (cut / r.link_bytes_per_s + live_values(p.graph) * r.link_latency_s)

    def time(i, j):
        return T[j] - T[i] + comm[i] + comm[j]

    def mem(s, i, j):
        return P[j] - P[i] + p.inflight[s] * (A[j] - A[i])

    pos = pos.copy()
    k = len(pos) - 1
    for _ in range(sweeps):
        before = pos.copy()
        for b in range(1, k):
            xs = np.arange(pos[b - 1] + 1, pos[b + 1])
            if len(xs) == 0:
                continue
            others = [s for s in range(k) if s not in (b - 1, b)]
            t_rest = max((time(pos[s], pos[s + 1]) for s in others), default=0.0)
            m_rest = max((mem(s, pos[s], pos[s + 1]) for s in others), default=0.0)
            left, right = np.full_like(xs, pos[b - 1]), np.full_like(xs, pos[b + 1])
            m = np.maximum(mem(b - 1, left, xs), mem(b, xs, right))
            t = np.maximum(time(left, xs), time(xs, right))
            score = (1 - w) * np.maximum(t, t_rest) / p.norm_time + w * np.maximum(m, m_rest) / p.norm_mem
            score = np.where(m <= grid.budget, score, np.inf)
            tied = np.flatnonzero(score == score.min())
            pos[b] = xs[tied[np.argmin(cut[xs[tied]])]]
        if np.array_equal(pos, before):  # a sweep that moves nothing would repeat itself
            break
    return pos
