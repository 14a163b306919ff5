"""How one op carries a tensor-parallel shard from its inputs to its output (see :mod:`partitioner.tp.sharding`).

Between a column- and a row-parallel matmul every op must work on a slice of the features: a view that keeps,
splits or merges the sharded dimension (splitting it into heads requires the head count to divide), transposes
and permutes, slices and reductions along other dimensions, and elementwise ops, batched matmuls and attention
whose sharded inputs agree and whose whole inputs broadcast along the sharded dimension (an attention mask of
one head, rotary tables). :func:`carry` answers for one op; None means it cannot run on shards.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from ..capture.flops import op_name

__all__ = ["Shard", "carry", "ELEMENTWISE", "VIEWS", "node_args", "node_inputs", "value_of", "shard_of"]

ELEMENTWISE = {"add", "sub", "mul", "div", "rsub", "where", "masked_fill", "maximum", "minimum", "pow", "neg",
               "exp", "log", "tanh", "sigmoid", "silu", "gelu", "relu", "dropout", "clone", "contiguous", "alias",
               "detach", "to", "_to_copy", "type_as", "sqrt", "rsqrt", "abs", "erf", "softplus", "leaky_relu",
               "hardtanh", "clamp", "mish", "lift_fresh_copy", "square", "reciprocal"}
VIEWS = {"view", "reshape", "_unsafe_view"}
_REDUCE_KEEP = {"softmax", "_softmax", "log_softmax", "_log_softmax"}
_REDUCE = {"mean", "sum", "amax", "amin"}


@dataclass(frozen=True)
class Shard:
    """How a tensor is split across the tp ranks: along ``dim`` (global length ``size``), or, with ``groups``
    > 1, that dimension is ``groups`` equal blocks each split across the ranks (fused q|k|v)."""

    dim: int
    size: int
    groups: int = 1


def node_args(node: torch.fx.Node) -> Any:
    """``node.args``, typed loosely: the analysis reads ops whose argument types it checks itself."""
    return node.args

def value_of(n: Any) -> Any:
    """The traced example value (``meta['val']``) of a node, None for a constant."""
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def node_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes ``node`` reads, in argument order."""
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node_args(node), node.kwargs), found.append)
    return found


def _view_dim(ishape: list[int], oshape: list[int], d: int) -> tuple[int, str] | None:
    """Where input dim ``d`` of a view lands: (output dim, "same" | "split" | "merge"), or None."""
    before, acc, j = math.prod(ishape[:d]), 1, 0
    while j < len(oshape) and acc < before:
        acc, j = acc * oshape[j], j + 1
    while j < len(oshape) and oshape[j] == 1 and ishape[d] != 1:
        j += 1
    if acc != before or j == len(oshape):
        return None
    if oshape[j] == ishape[d]:
        return j, "same"
    if oshape[j] < ishape[d]:
        return (j, "split") if ishape[d] % oshape[j] == 0 else None
    return (j, "merge") if oshape[j] % ishape[d] == 0 and d + 1 < len(ishape) else None



def shard_of(x: Any, values: dict[str, Shard]) -> Shard | None:
    """The shard of the value ``x`` (None: whole, or a constant)."""
    return values.get(x.name) if isinstance(x, torch.fx.Node) else None


def carry(node: torch.fx.Node, name: str, values: dict[str, Shard], tp: int,
          scatters: dict[str, list[tuple[str, int, int]]] | None = None) -> Shard | None:
    """The shard of ``node``'s output (an op named ``name``) from its inputs' shards in ``values``. A whole input
    that an elementwise op, batched matmul or attention must read in slices (grouped-query attention's kv heads
    repeated for more q heads than kv heads divide among the ranks, a per-head mask) is recorded in ``scatters``:
    consumer -> [(input, its sharded dim, global size)]."""
    a = node_args(node)
    x = a[0]
    s = values.get(x.name) if isinstance(x, torch.fx.Node) else None
    ishape, oshape = list(value_of(x).shape) if s else [], list(value_of(node).shape) if isinstance(
        value_of(node), torch.Tensor) else []
    if name in VIEWS and s:
        found = _view_dim(ishape, oshape, s.dim)
        if found is None:
            return None
        j, how = found
        if how == "same":
            return Shard(j, s.size, s.groups)
        if s.groups > 1:
            return Shard(j + 1, oshape[j + 1], 1) if how == "split" and oshape[j] == s.groups else None
        even = (oshape[j] if how == "split" else ishape[s.dim]) % tp == 0
        return Shard(j, oshape[j], 1) if even else None
    if name in ("transpose",) and s:
        d0, d1 = (d % len(ishape) for d in a[1:3])
        return Shard({d0: d1, d1: d0}.get(s.dim, s.dim), s.size, s.groups)
    if name == "permute" and s:
        return Shard([d % len(ishape) for d in a[1]].index(s.dim), s.size, s.groups)
    if name == "unsqueeze" and s:
        d = a[1] % len(oshape)
        return Shard(s.dim + (d <= s.dim), s.size, s.groups)
    if name == "expand" and s:
        return Shard(s.dim + len(oshape) - len(ishape), s.size, s.groups)
    if name in ("slice", "select", "narrow") and s:
        d = a[1] % len(ishape)
        if d == s.dim:
            return None
        return Shard(s.dim - (name == "select" and d < s.dim), s.size, s.groups)
    if name in _REDUCE_KEEP and s:
        return s if a[1] % len(ishape) != s.dim else None
    if name in _REDUCE and s:
        dims = [d % len(ishape) for d in (a[1] if len(a) > 1 and a[1] is not None else range(len(ishape)))]
        keep = len(a) > 2 and bool(a[2]) or bool(node.kwargs.get("keepdim"))
        return None if s.dim in dims else Shard(s.dim - (0 if keep else sum(d < s.dim for d in dims)),
                                                s.size, s.groups)
    if name == "flatten" and s:
        start, end = (int(x) % len(ishape) for x in (list(a[1:3]) + [0, -1][len(a) - 1:])[:2])
        if s.dim < start:
            return s
        if s.dim > end:
            return Shard(s.dim - (end - start), s.size, s.groups)
        return Shard(start, oshape[start], 1) if s.dim == start and s.groups == 1 and s.size % tp == 0 else None
    if name in ("cat", "stack"):
        return _cat(node, values, stack=name == "stack")
    if name in ("matmul", "bmm", "scaled_dot_product_attention") or name in ELEMENTWISE:
        return _broadcast(node, values, scatters)
    return None


def _cat(node: torch.fx.Node, values: dict[str, Shard], stack: bool) -> Shard | None:
    """Concatenating or stacking shards that agree, along another dimension (rotary embeddings' halves)."""
    parts, d = node_args(node)[0], node_args(node)[1] if len(node_args(node)) > 1 else 0
    shards = {values.get(p.name) for p in parts}
    if len(shards) != 1 or None in shards:
        return None
    s = shards.pop()
    d %= value_of(node).dim()
    if s is None or (not stack and d == s.dim):
        return None
    return Shard(s.dim + (stack and d <= s.dim), s.size, s.groups)


def _broadcast(node: torch.fx.Node, values: dict[str, Shard],
               scatters: dict[str, list[tuple[str, int, int]]] | None) -> Shard | None:
    """Elementwise ops, batched matmuls and attention: sharded inputs agree, whole ones broadcast there or are
    read in this rank's slice (``scatters``)."""
    out = value_of(node)
    if not isinstance(out, torch.Tensor):
        return None
    found: set[tuple[int, int, int]] = set()
    whole = []
    for n in node_inputs(node):
        s, v = values.get(n.name), value_of(n)
        if not isinstance(v, torch.Tensor):
            continue
        if s is None:
            whole.append((n.name, v))
        else:
            found.add((s.dim + out.dim() - v.dim(), s.size, s.groups))
    if len(found) != 1:
        return None
    d, size, groups = found.pop()
    last = out.dim() - 2 if op_name(node) in ("matmul", "bmm", "scaled_dot_product_attention") else out.dim()
    if d >= last:
        return None
    sliced = []
    for name, v in whole:
        j = d - (out.dim() - v.dim())
        if j >= 0 and v.shape[j] == size and groups == 1 and scatters is not None:
            sliced.append((name, j, size))
        elif j >= 0 and v.shape[j] != 1:
            return None
    if sliced and scatters is not None:
        scatters[node.name] = sliced
    return Shard(d, size, groups)
