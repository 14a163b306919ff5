"""The traced values of one tensor-parallel rank's graph (``meta["val"]``), as its run will have them.

:mod:`partitioner.tp.shard_program` gives every value that holds a shard its local shape. What the memory model
reads from those values (:mod:`partitioner.capture.autograd_saves`) is more than shapes: which values share a storage
(autograd keeps a storage once, however many views of it ops save) and the layout in memory (a ``reshape`` is a view
or a copy depending on its input's strides). So a value that was a view of an input in the trace is that view of the
input's value on this rank (:func:`view_value`), and any other is a new one laid out as the traced value was
(:func:`laid_out`): the CPU attention kernel's output is token-major under a head-major shape, and the reshape before
the out-projection a view of it, on rank 0's graph as in the trace and at run time.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["laid_out", "dense_stride", "storage_of", "view_value"]


def laid_out(like: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """A new value of ``shape`` with ``like``'s dtype and device (fake where ``like`` is), its dimensions in memory in
    the order of ``like``'s where ``like`` is dense (:func:`dense_stride`), else contiguous."""
    mode, stride = getattr(like, "fake_mode", None), dense_stride(like, shape)
    device = like.device if mode is None else "meta"
    made = torch.empty(tuple(shape), dtype=like.dtype, device=device) if stride is None else \
        torch.empty_strided(tuple(shape), stride, dtype=like.dtype, device=device)
    # What torch.empty under the mode makes, without its dispatch (a fifth of the time; a rank's graph has thousands)
    return made if mode is None else FakeTensor(mode, made, like.device)


def dense_stride(val: torch.Tensor, shape: list[int]) -> tuple[int, ...] | None:
    """The strides of a dense tensor of ``shape`` whose dimensions lie in memory in the order ``val``'s do (a CPU
    attention kernel writes its output token-major under a head-major shape, and the reshape that reads it is a view
    only on that layout); None where ``val`` is contiguous or not dense (then a contiguous one)."""
    if val.is_contiguous():
        return None
    traced = val.stride()
    order = sorted(range(val.dim()), key=lambda d: -traced[d])  # stable: ties keep their order
    expected = 1
    for d in reversed(order):
        if val.shape[d] > 1 and traced[d] != expected:
            return None
        expected *= val.shape[d]
    stride, step = [0] * len(shape), 1
    for d in reversed(order):
        stride[d], step = step, step * max(shape[d], 1)
    return tuple(stride)


def storage_of(val: Any) -> int | None:
    """The storage a traced fake value sees (None: not a fake tensor)."""
    return val.untyped_storage()._cdata if isinstance(val, FakeTensor) else None


def _on_meta(v: Any) -> Any:
    """A meta tensor laid out as ``v`` on a storage of its own as long as ``v``'s; anything else as it is."""
    if not isinstance(v, torch.Tensor):
        return v
    whole = torch.empty(v.untyped_storage().nbytes() // v.element_size(), dtype=v.dtype, device="meta")
    return whole.as_strided(v.shape, v.stride(), v.storage_offset())


def view_value(node: torch.fx.Node, source: torch.fx.Node, shape: list[int]) -> torch.Tensor | None:
    """``node``'s op run on meta copies of its inputs' values (a view's layout without the fake mode's dispatch, a
    sixth of the time), on the storage of ``source``'s value; None where it is no view of it of ``shape`` here (the
    traced op's arguments do not apply to this rank's values: a slice)."""
    src = source.meta["val"]
    if not isinstance(node.target, torch._ops.OpOverload) or not isinstance(src, FakeTensor):
        return None
    stand_in = _on_meta(src)
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs),
                                         lambda n: stand_in if n is source else _on_meta(n.meta.get("val")))
    try:
        out = node.target(*args, **kwargs)
    except (RuntimeError, IndexError):
        return None
    if not isinstance(out, torch.Tensor) or list(out.shape) != shape or \
            out.untyped_storage()._cdata != stand_in.untyped_storage()._cdata:
        return None
    made = torch.empty((0,), dtype=out.dtype, device="meta").set_(src.untyped_storage(), out.storage_offset(),
                                                                   out.shape, out.stride())
    return FakeTensor(src.fake_mode, made, src.device)
