"""A mask's rows computed where the mask is made: each context-parallel rank builds only its queries' rows.

``transformers`` builds an attention mask from the positions (``sdpa_mask``: the query and key positions compared,
broadcast to ``(batch, 1, queries, keys)``), and under ``torch.export`` it always builds it (the shortcut to
``is_causal`` is off while exporting). Cut to a rank's rows where attention reads it, the mask would still be built
whole on every rank first: ``S x S`` booleans, 16 GiB at 128k tokens. :func:`mask_rows` pushes the cut up the ops
that made it instead: through elementwise ops and comparisons, casts, ``unsqueeze``, ``expand`` and advanced indexing
by broadcast index tensors, each copied with its inputs' rows (an input whose size along that dimension is 1
broadcasts and stays), down to the values the rows come from (the query positions, ``S`` numbers), which are cut
there (:func:`partitioner.cp.comm.cp_scatter`). An op it does not know is cut where it stands, whole before it.
The originals stay for any other reader; the copies are made once and shared by every attention that reads them.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx

from ..capture.flops import op_name
from ..tp.shard_rules import ELEMENTWISE, node_args, value_of
from ..tp.token_walk import TokenWalk, fake_like

__all__ = ["mask_rows"]

# Ops whose output broadcasts their tensor inputs elementwise (comparisons and logic besides arithmetic).
_BROADCAST = ELEMENTWISE | {"le", "lt", "ge", "gt", "eq", "ne", "__and__", "__or__", "bitwise_and", "bitwise_or",
                            "logical_and", "logical_or", "logical_not", "bitwise_not"}


def mask_rows(walk: TokenWalk, consumer: torch.fx.Node, mask: torch.fx.Node, dim: int) -> torch.fx.Node:
    """A node for this rank's rows (along ``dim``, the whole sequence long) of the whole value ``mask`` that
    ``consumer`` reads, computed from the rows of what made it where the ops allow (see the module docstring); each
    copy is made once in a rewrite (:meth:`TokenWalk.insert`), shared by every attention that reads it."""
    made = walk.made.get((mask.name, ("rows", dim)))
    return made if made is not None else _rows(walk, consumer, mask, dim)


def _rows(walk: TokenWalk, consumer: torch.fx.Node, n: torch.fx.Node, dim: int) -> torch.fx.Node:
    out = value_of(n)
    name = op_name(n) if n.op == "call_function" else ""
    args: list[Any] | None = None
    if name in _BROADCAST:
        args = [_broadcast_rows(walk, consumer, x, dim, out.dim()) for x in node_args(n)]
    elif name == "index":  # every dimension indexed by tensors: the output is their broadcast, the indexed one whole
        x, tensors = node_args(n)[:2]
        if len(tensors) == value_of(x).dim() and all(isinstance(t, torch.fx.Node) for t in tensors):
            args = [x, [_broadcast_rows(walk, consumer, t, dim, out.dim()) for t in tensors]]
    elif name == "unsqueeze":
        x, k = node_args(n)
        if k % out.dim() != dim:
            args = [mask_rows(walk, consumer, x, dim - (k % out.dim() < dim)), k]
    elif name == "expand":
        x, sizes = node_args(n)[:2]
        j = dim - (out.dim() - value_of(x).dim())
        rows = x if j < 0 or value_of(x).shape[j] == 1 else mask_rows(walk, consumer, x, j)
        sizes = list(sizes)
        sizes[dim] = -1 if sizes[dim] == -1 else sizes[dim] // walk.degree
        args = [rows, sizes, *node_args(n)[2:]]
    if args is None:
        return walk.scatter(consumer, n, (dim, 1, 1))
    shape = list(out.shape)
    shape[dim] //= walk.degree
    return walk.insert(n.target, tuple(args), lambda: walk.g.inserting_before(consumer), f"{n.name}_cp_rows",
                       fake_like(out, shape), n, ("rows", dim), dict(n.kwargs))


def _broadcast_rows(walk: TokenWalk, consumer: torch.fx.Node, x: Any, dim: int, ndim: int) -> Any:
    """Input ``x`` of a broadcasting op whose output (``ndim`` dimensions) is cut along ``dim``: its rows where it
    runs along that dimension, itself where it broadcasts (or is not a tensor)."""
    v = value_of(x)
    if not isinstance(x, torch.fx.Node) or not isinstance(v, torch.Tensor):
        return x
    j = dim - (ndim - v.dim())
    if j < 0 or v.shape[j] == 1:
        return x
    return mask_rows(walk, consumer, x, j)
