"""How the return values of an ``@smp.step`` function reach every rank of the pipeline.

They exist on the last stage's rank only (the loss is computed there), and every rank gets them back as
StepOutput. The first step of a step function sends them pickled; once a step function is known to return
values of one structure, dtype and shape (the usual case: a loss per microbatch), they travel as the raw
bytes of one tensor: one collective, no pickling (see :func:`broadcast_results`).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from . import state

__all__ = ["broadcast_results", "detach"]


def detach(value: Any) -> Any:
    """``value`` with every tensor in it detached: only values leave the step, never autograd graphs."""
    return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, value)


def _signature(results: Any) -> tuple | None:
    """Structure, and kind/dtype/shape of every leaf, of a step's return values; None when a leaf is not a
    dense tensor or a Python bool/int/float (those always travel pickled)."""
    leaves, spec = pytree.tree_flatten(results)
    kinds = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if x.layout != torch.strided:
                return None
            kinds.append((x.dtype, tuple(x.shape)))
        elif type(x) in (bool, float) or (type(x) is int and -2 ** 63 <= x < 2 ** 63):
            kinds.append(type(x))
        else:
            return None
    return spec, tuple(kinds)


def _nbytes(kinds: tuple) -> int:
    return sum(k[0].itemsize * math.prod(k[1]) if isinstance(k, tuple) else 8 for k in kinds)


def broadcast_results(results: list[Any] | None, src: int, group: Any, memo: dict,
                      flag: bool = False) -> tuple[list[Any], bool]:
    """The last stage's per-microbatch return values and one flag (``flag`` there: a step that never called
    ``model.backward``), to every rank of the model-parallel group.

    The first step of a step function sends them pickled (two collectives). When a step returns values of
    the same structure, dtypes and shapes as the step before (the usual case: a loss per microbatch), they
    travel as the raw bytes of one tensor behind a flag byte instead: one collective, no pickling. Bit 0 of
    the flag byte says the structure is the known one (0: the pickled path follows), bit 1 carries ``flag``.
    ``memo`` keeps the known structure, per step function.
    """
    if dist.get_world_size(group) == 1:
        return results, flag
    st = state.get()
    known = memo.get("signature")
    if known is not None:
        spec, kinds = known
        buf = torch.zeros(1 + _nbytes(kinds), dtype=torch.uint8, device=st.device)
        if results is not None and _signature(results) == known:
            buf[0] = 1 | (2 if flag else 0)
            parts = []
            for x in pytree.tree_leaves(results):
                if isinstance(x, torch.Tensor):
                    parts.append(x.detach().to(st.device).contiguous().reshape(-1).view(torch.uint8))
                else:
                    t = torch.tensor([x], dtype=torch.float64 if type(x) is float else torch.int64, device=st.device)
                    parts.append(t.view(torch.uint8))
            if parts:
                buf[1:].copy_(torch.cat(parts))
        dist.broadcast(buf, src=src, group=group)
        head = int(buf[0])
        if head & 1:
            if results is not None:
                return results, flag
            leaves, offset = [], 1
            for kind in kinds:
                if isinstance(kind, tuple):
                    dtype, shape = kind
                    n = dtype.itemsize * math.prod(shape)
                    leaves.append(buf[offset:offset + n].clone().view(dtype).reshape(shape))
                else:
                    n = 8
                    raw = buf[offset:offset + n].clone()
                    leaves.append(kind(raw.view(torch.float64 if kind is float else torch.int64).item()))
                offset += n
            return pytree.tree_unflatten(leaves, spec), bool(head & 2)
    # Only values travel: autograd graphs (and the hooks on the model outputs) stay on the last stage's rank.
    box = [None if results is None else (detach(results), flag)]
    dist.broadcast_object_list(box, src=src, group=group)
    got, flag = (results, flag) if results is not None else box[0]
    memo["signature"] = _signature(got)
    return got, flag
