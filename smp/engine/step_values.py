"""How the values of an ``@smp.step`` call travel through its pipeline: its arguments from pp_rank 0 to the
other stages, its return values from the last stage to every rank.

Arguments: as in SMP v1, pp_rank 0's arguments are the truth (:func:`share_inputs`). Its tensors and
Python scalars replace the other ranks' (which may be placeholders of any shape, such as ``torch.empty(0)``),
so every stage traces, feeds and computes its loss on the same samples; other objects (the model, an
optimizer) are each rank's own and never travel.

Return values exist on the last stage's rank only (the loss is computed there), and every rank gets them back.

Both go through :func:`broadcast_values`: the first call of a step function sends them pickled; once a step
function is known to pass values of one structure, dtype and shape (the usual case: a batch of one shape, a
loss per microbatch), they travel as the raw bytes of one tensor: one collective, no pickling.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from partitioner.errors import EngineError

__all__ = ["broadcast_values", "share_inputs", "detach", "InputsError"]

_SCALARS = (bool, int, float, complex, str, bytes, type(None))  # arguments that travel from pp_rank 0 with tensors


class InputsError(EngineError, ValueError):
    """A rank's step arguments cannot be matched with pp_rank 0's."""


class _Own:
    """Stands, in the arguments pp_rank 0 sends, for an object each rank keeps its own of (the model)."""

    def __reduce__(self) -> str:
        return "OWN"  # unpickles to the one instance

    def __repr__(self) -> str:
        return "OWN"


OWN = _Own()


def detach(value: Any) -> Any:
    """``value`` with every tensor in it detached: only values leave the step, never autograd graphs."""
    return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, value)


def _signature(values: Any) -> tuple | None:
    """Structure, and kind/dtype/shape of every leaf, of some values; None when a leaf is not a dense tensor,
    a Python bool/int/float, None or OWN (those always travel pickled)."""
    leaves, spec = pytree.tree_flatten(values)
    kinds: list[Any] = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if x.layout != torch.strided:
                return None
            kinds.append((x.dtype, tuple(x.shape)))
        elif type(x) in (bool, float, type(None), _Own) or (type(x) is int and -2 ** 63 <= x < 2 ** 63):
            kinds.append(type(x))
        else:
            return None
    return spec, tuple(kinds)


def _nbytes(kind: Any) -> int:
    if isinstance(kind, tuple):
        return kind[0].itemsize * math.prod(kind[1])
    return 0 if kind in (type(None), _Own) else 8


def _pack(values: Any, kinds: tuple, device: torch.device) -> list[torch.Tensor]:
    parts = []
    for x in pytree.tree_leaves(values):
        if isinstance(x, torch.Tensor):
            parts.append(x.detach().to(device).contiguous().reshape(-1).view(torch.uint8))
        elif type(x) in (bool, int, float):
            t = torch.tensor([x], dtype=torch.float64 if type(x) is float else torch.int64, device=device)
            parts.append(t.view(torch.uint8))
    return parts


def _unpack(buf: torch.Tensor, spec: Any, kinds: tuple) -> Any:
    leaves: list[Any] = []
    offset = 1
    for kind in kinds:
        n = _nbytes(kind)
        raw = buf[offset:offset + n].clone()
        if isinstance(kind, tuple):
            leaves.append(raw.view(kind[0]).reshape(kind[1]))
        elif kind in (type(None), _Own):
            leaves.append(None if kind is type(None) else OWN)
        else:
            leaves.append(kind(raw.view(torch.float64 if kind is float else torch.int64).item()))
        offset += n
    return pytree.tree_unflatten(leaves, spec)


def broadcast_values(values: Any, src: int, group: Any, memo: dict, device: torch.device,
                     flag: bool = False) -> tuple[Any, bool]:
    """``values`` and one flag, from global rank ``src`` (where ``values`` is not None) to every rank of
    ``group``.

    The first call sends them pickled (two collectives). When a call sends values of the same structure,
    dtypes and shapes as the call before, they travel as the raw bytes of one tensor behind a flag byte
    instead: one collective, no pickling. Bit 0 of the flag byte says the structure is the known one (0: the
    pickled path follows), bit 1 carries ``flag``. ``memo`` keeps the known structure (one per kind of values
    of a step function); ``device`` is where this rank's collectives run.
    """
    if dist.get_world_size(group) == 1:
        return values, flag
    known = memo.get("signature")
    if known is not None:
        spec, kinds = known
        buf = torch.zeros(1 + sum(_nbytes(k) for k in kinds), dtype=torch.uint8, device=device)
        if values is not None and _signature(values) == known:
            buf[0] = 1 | (2 if flag else 0)
            parts = _pack(values, kinds, device)
            if parts:
                buf[1:].copy_(torch.cat(parts))
        dist.broadcast(buf, src=src, group=group)
        head = int(buf[0])
        if head & 1:
            return (values, flag) if values is not None else (_unpack(buf, spec, kinds), bool(head & 2))
    # Only values travel: autograd graphs (and the hooks on the model outputs) stay on the sender.
    box: list[Any] = [None if values is None else (detach(values), flag)]
    dist.broadcast_object_list(box, src=src, group=group)
    got, flag = (values, flag) if values is not None else box[0]
    memo["signature"] = _signature(got)
    return got, flag


def _travels(x: Any) -> bool:
    return isinstance(x, torch.Tensor) or type(x) in _SCALARS


def share_inputs(inputs: tuple[tuple, dict], src: int, group: Any, memo: dict, rank: int,
                 device: torch.device) -> tuple[tuple, dict]:
    """The step arguments ``(args, kwargs)`` of global rank ``src`` (pp_rank 0 of this rank's pipeline
    ``group``), on every rank of the pipeline.

    Tensors and Python scalars (bool, int, float, complex, str, bytes, None) come from ``src`` whatever this
    rank passed in their place; every other object (the model, an optimizer, a tokenizer) is this rank's
    own: the n-th such object of ``src``'s arguments is the n-th of this rank's.
        ``rank`` is this rank, ``device`` where its collectives run.
    """
    me = rank
    leaves, spec = pytree.tree_flatten(inputs)
    if me == src:
        broadcast_values(pytree.tree_unflatten([x if _travels(x) else OWN for x in leaves], spec), src, group, memo,
                         device)
        return inputs
    sent, _ = broadcast_values(None, src, group, memo, device)
    sent_leaves, sent_spec = pytree.tree_flatten(sent)
    own = [x for x in leaves if not _travels(x)]
    wanted = sum(x is OWN for x in sent_leaves)
    if wanted != len(own):
        raise InputsError(
            f"rank {me}: the step's arguments on pp_rank 0 hold {wanted} object(s) that are neither tensors nor "
            f"Python scalars (such as the model), this rank's hold {len(own)}: "
            f"pp_rank 0's tensors and scalars replace this rank's, but other objects stay each rank's own, so "
            "pass the same objects (e.g. the model) in the same order on every rank")
    mine = iter(own)
    return pytree.tree_unflatten([next(mine) if x is OWN else x for x in sent_leaves], sent_spec)
