"""The units sharded data parallelism gathers and reduces by one collective each, and what they hold at once.

PyTorch FSDP (Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", arXiv:2304.11277,
sections 3.2.1 and 3.4) communicates a unit at a time: torchtitan and the transformer auto-wrap policy wrap each
block of the model's layer list (:func:`fsdp_unit`). The runtime (:mod:`pipeline.gather_units`) groups a stage's
sharded parameters so, in the order its graph first reads them, and :func:`group_units` is that grouping, shared by the
runtime and the planner so that both count the same units: consecutive parameters of one block (and one ``key``, the
runtime's dtype and mesh) share a unit; runs of parameters outside any block are cut into units as soon as one
reaches the largest block's bytes (the whole run is one unit when there is no block).

What the runtime holds whole at once (:func:`gathered_peak`; :mod:`pipeline.param_gather`): a unit's all-gather
output (its whole bytes) and input (its shard) live from its launch until its parameters are copied out, each into a
whole tensor that lives until the parameter's last read of the pass; the next unit's all-gather is launched once the
current one is copied out (forward and backward prefetch), so a unit computes beside the next one's buffers, and is
copied out beside whatever of the earlier units' parameters is still read. The backward gathers the units again in
reverse, each held until the one before it is gathered. A stage's last unit (of two or more) is gathered once a
step and kept whole until the step ends: the backward starts with it (FSDP keeps its root unit so), and a later
microbatch's forward reads it again.
"""
from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..capture.graph import OpGraph

__all__ = ["fsdp_unit", "group_units", "keeps_last", "StageUnits", "parameters", "padded", "stage_units",
           "gathered_peak"]


@functools.lru_cache(maxsize=1 << 16)  # the same names, stage after stage of every layout the search prices
def fsdp_unit(name: str) -> str:
    """The FSDP unit of the parameter ``name``: its path up to the first numeric component (``model.layers.3`` of
    ``model.layers.3.mlp.up_proj.weight``: a block of a ``ModuleList``), else the root unit ``""``."""
    parts = name.split(".")
    cut = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return "" if cut is None else ".".join(parts[:cut + 1])


def group_units(names: Sequence[str], nbytes: Sequence[float],
                keys: Sequence[Hashable] | None = None) -> list[list[int]]:
    """The units of parameters ``names`` (of ``nbytes`` each, in the order a stage first reads them; ``keys``: what
    else two parameters of a unit share, default nothing) as lists of their indices (see the module docstring)."""
    key = [(fsdp_unit(n), None if keys is None else keys[i]) for i, n in enumerate(names)]
    runs: list[list[int]] = []
    for i in range(len(names)):
        if runs and key[runs[-1][-1]] == key[i]:
            runs[-1].append(i)
        else:
            runs.append([i])
    cap = max((sum(nbytes[i] for i in run) for run in runs if key[run[0]][0]), default=0.0)
    units: list[list[int]] = []
    for run in runs:
        piece: list[int] = []
        for i in run:
            if piece and cap and not key[i][0] and sum(nbytes[j] for j in piece) >= cap:
                units.append(piece)
                piece = []
            piece.append(i)
        units.append(piece)
    return units


def keeps_last(units: int) -> bool:
    """Does a stage of ``units`` units keep its last one whole from its first gather to the step's end (see the module
    docstring)? Only with two or more: a stage of one unit would hold all its parameters whole all step."""
    return units > 1


@dataclass(frozen=True)
class StageUnits:
    """A stage's units in the order it first reads them: each one's ``params`` (graph parameter indices), ``weights``
    and ``gradients`` bytes as its flat buffers hold them whole (padded), and ``first`` read (a position in the
    stage's ops)."""

    params: tuple[tuple[int, ...], ...]
    weights: tuple[float, ...]
    gradients: tuple[float, ...]
    first: tuple[int, ...]


def _reads(graph: OpGraph, ops: np.ndarray, params: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per parameter of ``graph``: its first and last read, positions in ``ops`` (the stage's ops in forward order;
    ``len(ops)`` and -1 for a parameter ``ops`` do not read)."""
    chosen, in_ops = np.zeros(len(graph.param_names), bool), np.zeros(graph.num_nodes, bool)
    chosen[params], in_ops[ops] = True, True  # masks, not np.isin: asked per stage of every layout priced
    users = chosen[graph.use_param] & in_ops[graph.use_node]
    first = np.full(len(graph.param_names), len(ops), np.int64)
    last = np.full(len(graph.param_names), -1, np.int64)
    at = np.searchsorted(ops, graph.use_node[users])
    np.minimum.at(first, graph.use_param[users], at)
    np.maximum.at(last, graph.use_param[users], at)
    return first, last


def parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``dict(module.named_parameters(remove_duplicate=False))``, by a plain walk of the module tree: torch's nested
    generators take three times as long, and the layout search prices sharded data parallelism (which reads every
    parameter's shape) hundreds of times over a program of thousands of parameters."""
    found: dict[str, torch.Tensor] = {}
    stack = [("", module)]
    while stack:
        prefix, at = stack.pop()
        found.update((prefix + name, p) for name, p in at._parameters.items() if p is not None)
        stack.extend((f"{prefix}{name}.", sub) for name, sub in reversed(at._modules.items()) if sub is not None)
    return found


def padded(graph: OpGraph, degree: int) -> np.ndarray:
    """Per parameter of ``graph``, what its flat buffers hold over ``degree`` ranks for each byte of it: each rank's
    dim-0 shard padded to ``ceil(rows / degree)`` rows, as FSDP2 and :mod:`pipeline.gather_units` pad (1 where the
    graph knows no shapes)."""
    if graph.fx is None:
        return np.ones(len(graph.param_names))
    named = parameters(graph.fx.module)
    rows = [named[n].shape[0] if n in named and named[n].dim() else 0 for n in graph.param_names]
    return np.array([-(-r // degree) * degree / r if r else 1.0 for r in rows])


def stage_units(graph: OpGraph, ops: np.ndarray, params: np.ndarray, weights: np.ndarray, gradients: np.ndarray,
                pad: np.ndarray) -> StageUnits:
    """The units (:func:`group_units`) of the sharded ``params`` of the stage whose ops are ``ops`` (sorted, forward
    order), of ``weights`` and ``gradients`` bytes (per graph parameter) as their flat buffers hold them: times
    ``pad``, :func:`padded` over the sharding degree (the caller's, once for all of a graph's stages: reading the
    shapes walks the whole program's modules)."""
    weights, gradients = weights * pad, gradients * pad
    first, _ = _reads(graph, ops, params)
    order = sorted((int(p) for p in params), key=lambda p: (first[p], p))
    groups = [[order[i] for i in unit] for unit in group_units([graph.param_names[p] for p in order],
                                                               [float(weights[p]) for p in order])]
    return StageUnits(tuple(tuple(g) for g in groups), tuple(float(weights[g].sum()) for g in groups),
                      tuple(float(gradients[g].sum()) for g in groups), tuple(int(first[g].min()) for g in groups))


def gathered_peak(graph: OpGraph, ops: np.ndarray, units: StageUnits, weights: np.ndarray,
                  degree: int) -> tuple[float, list[int]]:
    """The most bytes the gathering holds at once over a stage's passes (whole parameters and the all-gathers'
    buffers, see the module docstring), with ``units`` of the stage whose ops are ``ops`` sharded over ``degree``
    ranks, each parameter of ``weights`` bytes whole; and the parameters whole or being gathered then."""
    if not units.params:
        return 0.0, []
    n = len(units.params)
    buffers = [w * (1 + 1 / degree) for w in units.weights]  # an all-gather's output (whole) and input (the shard)
    _, last = _reads(graph, ops, np.array([p for u in units.params for p in u], np.int64))
    live = np.zeros(len(ops) + 1)  # forward: each parameter whole from its unit's first read to its own last
    for u, start in zip(units.params, units.first):
        for p in u:
            live[start] += weights[p]
            live[max(int(last[p]), start) + 1] -= weights[p]
    whole = np.cumsum(live)[:-1]
    kept = units.weights[-1] if keeps_last(n) else 0.0  # whole from its first gather to the step's end
    best, at = 0.0, (0, 0, 0)
    for i, start in enumerate(units.first):
        stop = units.first[i + 1] if i + 1 < n else len(ops)
        after = (float(whole[start:max(stop, start + 1)].max()) + buffers[i + 1], i + 1) if i + 1 < n else (0.0, i)
        before = (units.weights[i] + buffers[i - 1], i - 1) if i else (0.0, i)
        # forward: copied out beside its own buffers, then computing beside the next unit's; backward (in
        # reverse): copied out beside its own buffers, then computing beside the previous unit's; beside the
        # last unit, kept (a later microbatch's forward, or the backward)
        extra = kept if i < n - 1 else 0.0
        for held, other in ((float(whole[start]) + buffers[i], i), after, before):
            if held + extra > best:
                best, at = held + extra, (i, other, n - 1 if extra else i)
    return best, sorted({p for u in set(at) for p in units.params[u]})
