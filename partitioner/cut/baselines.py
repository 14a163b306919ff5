"""Baseline partitions, scored by the same cost model as ours (:mod:`partitioner.cut.objective`).

* ``uniform``: equal op counts along the topological order.
* ``params``: equal parameter bytes along the topological order (DeepSpeed's default
  ``partition_method="parameters"``).
* ``layers``: equal numbers of repeated blocks (the ``nn.ModuleList`` children such as ``transformer.h.3``),
  as hand-placed split points do in torch.distributed.pipelining examples; ops outside the blocks stay with
  the block next to them.
"""
from __future__ import annotations

import re
from collections import Counter

import numpy as np

from .objective import Problem, evaluate
from .plan import PartitionPlan, make_plan

__all__ = ["BASELINES", "baseline", "baseline_stage", "all_baselines", "block_index"]

BASELINES = ("uniform", "params", "layers")
_BLOCK = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def _by_weight(weight: np.ndarray, k: int) -> np.ndarray:
    """Contiguous stages of (nearly) equal total weight along index order, none of them empty."""
    n = len(weight)
    cum = np.cumsum(weight, dtype=np.float64)
    total = cum[-1] if n else 0.0
    if total <= 0:
        return np.minimum(np.arange(n) * k // max(n, 1), k - 1)
    stage = np.minimum(((cum - weight / 2) * k / total).astype(np.int64), k - 1)
    return _non_empty(np.maximum.accumulate(stage), k)


def _non_empty(stage: np.ndarray, k: int) -> np.ndarray:
    """Shift boundaries so every stage keeps at least one op (needs n >= k)."""
    n = len(stage)
    starts = np.searchsorted(stage, np.arange(k), side="left")
    starts = np.maximum(starts, np.arange(k))  # stage s starts no earlier than op s
    for s in range(k - 2, -1, -1):             # and leaves room for the stages after it
        starts[s] = min(starts[s], starts[s + 1] - 1)
    starts = np.minimum(starts, n - (k - np.arange(k)))
    return np.searchsorted(starts, np.arange(n), side="right") - 1


def block_index(modules: list[str]) -> tuple[str, np.ndarray]:
    """The most common repeated-block container and, per op, its block number (-1 outside blocks)."""
    prefixes: Counter[str] = Counter()
    parsed = []
    for m in modules:
        hit = _BLOCK.match(m)
        parsed.append((hit.group(1), int(hit.group(2))) if hit else None)
        if hit:
            prefixes[hit.group(1)] += 1
    if not prefixes:
        return "", np.full(len(modules), -1)
    container = prefixes.most_common(1)[0][0]
    return container, np.array([b[1] if b and b[0] == container else -1 for b in parsed])


def _layers(p: Problem) -> np.ndarray:
    k = p.num_stages
    _, block = block_index(p.graph.modules)
    seen = np.maximum.accumulate(np.where(block >= 0, block, -1))  # ops after a block stay with it
    if seen.max() < 0:
        return _by_weight(np.ones(p.graph.num_nodes), k)
    blocks = np.unique(block[block >= 0])
    pos = np.searchsorted(blocks, np.maximum(seen, blocks[0]))
    stage = np.minimum(pos * k // len(blocks), k - 1)
    return _non_empty(np.maximum.accumulate(stage), k)


def baseline_stage(p: Problem, name: str) -> np.ndarray:
    """The named baseline's stage of every op of ``p``."""
    if name == "uniform":
        return _by_weight(np.ones(p.graph.num_nodes), p.num_stages)
    if name == "params":
        return _by_weight(p.graph.node_param_bytes().astype(np.float64), p.num_stages)
    if name == "layers":
        return _layers(p)
    raise ValueError(f"unknown baseline {name!r}; use one of {BASELINES}")


def baseline(p: Problem, name: str) -> PartitionPlan:
    """The named baseline's plan for ``p``, scored by the same objective as ours."""
    return make_plan(p, evaluate(p, baseline_stage(p, name)), name)


def all_baselines(p: Problem) -> dict[str, PartitionPlan]:
    """Every baseline's plan, by name."""
    return {name: baseline(p, name) for name in BASELINES}
