"""Boundary refinement: greedy moves off the worst stage that keep the stages acyclic.

In the spirit of Fiduccia–Mattheyses boundary refinement (Fiduccia & Mattheyses, DAC 1982): ops on the
bottleneck stage move to a neighbouring stage when all their producers (consumers) already sit at or before
(after) it, a prefix at a time, and a move is kept only when the exact objective
(:func:`partitioner.cut.objective.evaluate`) improves. Both the DP's and METIS's plans go through it.
"""
from __future__ import annotations

import numpy as np

from .objective import Evaluation, Problem, evaluate

__all__ = ["refine"]



def refine(p: Problem, stage: np.ndarray, max_rounds: int | None = None) -> Evaluation:
    """Greedy moves off the worst stage that keep every edge pointing forward; exact objective decides."""
    g, k = p.graph, p.num_stages
    best = evaluate(p, stage)
    if k == 1:
        return best
    fixed = np.array([kind == "output" for kind in g.kinds])
    node_w = ((1 - p.options.memory_weight) * p.time / p.norm_time
              + p.options.memory_weight * p.act_bytes / p.norm_mem)
    rounds = max_rounds if max_rounds is not None else (8 * k if g.num_nodes <= 100_000 else 2 * k)
    budget = p.budget
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
