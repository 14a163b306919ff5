"""Split step inputs into microbatches and merge per-microbatch outputs back, following the
SageMaker model-parallel ``@smp.step`` rules.

Splitting: every tensor, also inside nested lists, tuples, dicts and other pytrees, is cut along
its batch axis (0 unless ``input_split_axes`` says otherwise) into ``num_microbatches`` equal
pieces; the size along that axis must be divisible. Objects with a method
``smp_slice(num_mb, mb, axis)`` slice themselves. Arguments named in ``non_split_inputs``,
non-tensor leaves and 0-dim tensors go whole to every microbatch. Tensors need not agree on their
batch size; each only has to divide evenly.

Merging concatenates tensors along ``axis`` through the same nested structures, so
``merge(per-microbatch pieces of x) == x``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from partitioner.errors import EngineError

__all__ = ["BatchSplitError", "split", "merge"]


class BatchSplitError(EngineError, ValueError):
    """An input cannot be cut into equal microbatches."""


def _slices_itself(value: Any) -> bool:
    # Looked up on the type so a class passed as an argument is not mistaken for an instance.
    return callable(getattr(type(value), "smp_slice", None))


def _fix_hint(name: str | None, num_microbatches: int) -> str:
    if name is None:
        return (
            f"Use a batch size divisible by {num_microbatches} or another num_microbatches; "
            "to split it along another axis or pass it whole, give the positional argument names "
            "(arg_names) and use input_split_axes / non_split_inputs."
        )
    return (
        f"Use a batch size divisible by {num_microbatches} or another num_microbatches, split along "
        f"another axis with input_split_axes={{{name!r}: AXIS}}, or pass it whole with "
        f"non_split_inputs=[{name!r}]."
    )


def _split_leaf(leaf: Any, path: str, name: str | None, num_microbatches: int, axis: int) -> list[Any]:
    if _slices_itself(leaf):
        return [leaf.smp_slice(num_microbatches, mb, axis) for mb in range(num_microbatches)]
    if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
        return [leaf] * num_microbatches
    if not -leaf.dim() <= axis < leaf.dim():
        raise BatchSplitError(
            f"cannot split {path} of shape {tuple(leaf.shape)} along axis {axis}: it has only "
            f"{leaf.dim()} dimension(s). {_fix_hint(name, num_microbatches)}"
        )
    size = leaf.shape[axis]
    if size % num_microbatches:
        raise BatchSplitError(
            f"cannot split {path} of shape {tuple(leaf.shape)} into {num_microbatches} microbatches: "
            f"its size {size} along axis {axis} is not divisible by {num_microbatches}. "
            f"{_fix_hint(name, num_microbatches)}"
        )
    # tensor_split returns views; contiguous() copies only the pieces that are not already
    # contiguous (splits along a non-leading axis), which sending needs.
    return [piece.contiguous() for piece in leaf.tensor_split(num_microbatches, dim=axis)]


def _split_value(value: Any, path: str, name: str | None, num_microbatches: int, axis: int) -> list[Any]:
    leaves, spec = pytree.tree_flatten_with_path(value, is_leaf=_slices_itself)
    columns = [
        _split_leaf(leaf, path + pytree.keystr(key), name, num_microbatches, axis) for key, leaf in leaves
    ]
    return [pytree.tree_unflatten([column[mb] for column in columns], spec) for mb in range(num_microbatches)]


def split(
    args: tuple,
    kwargs: dict,
    num_microbatches: int,
    *,
    non_split_inputs: Collection[str] = (),
    input_split_axes: Mapping[str, int] | None = None,
    arg_names: Sequence[str] | None = None,
) -> list[tuple[tuple, dict]]:
    """Cut a call's ``(args, kwargs)`` into ``num_microbatches`` ``(args, kwargs)`` pairs.

    Names in ``non_split_inputs`` and ``input_split_axes`` are the step function's parameter
    names: ``arg_names[i]`` names ``args[i]``, keyword arguments go by key. An argument in
    ``non_split_inputs`` is passed whole even if it also has an axis in ``input_split_axes``.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    axes = dict(input_split_axes or {})
    arg_names = list(arg_names or ())
    # A name matching no argument is almost always a typo that would silently split a tensor
    # meant to stay whole, so refuse it.
    known = set(arg_names) | set(kwargs)
    unknown = sorted((set(non_split_inputs) | set(axes)) - known)
    if unknown:
        hint = "" if arg_names else " Pass arg_names to refer to positional arguments by name."
        raise ValueError(
            f"non_split_inputs / input_split_axes name {unknown}, which match no argument; "
            f"arguments are {sorted(known)}.{hint}"
        )

    def pieces(value: Any, name: str | None, path: str) -> list[Any]:
        if name in non_split_inputs:
            return [value] * num_microbatches
        return _split_value(value, path, name, num_microbatches, 0 if name is None else axes.get(name, 0))

    names = [arg_names[i] if i < len(arg_names) else None for i in range(len(args))]  # *args may be unnamed
    positional = [pieces(value, name, name or f"args[{i}]") for i, (value, name) in enumerate(zip(args, names))]
    keyword = {key: pieces(value, key, key) for key, value in kwargs.items()}
    return [
        (tuple(p[mb] for p in positional), {key: p[mb] for key, p in keyword.items()})
        for mb in range(num_microbatches)
    ]


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # e.g. arrays, whose == is elementwise
        return False


def _merge_leaf(values: list[Any], path: str, axis: int) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        if all(v is first for v in values):
            return first  # one object shared by all microbatches (e.g. an input passed whole)
        if first.dim() == 0:
            return torch.stack(values)  # per-microbatch scalars such as losses
        return torch.cat(values, dim=axis)
    if all(_same(v, first) for v in values):
        return first
    raise ValueError(
        f"cannot merge output{path}: microbatches returned different non-tensor values {values!r}; "
        "return tensors for per-microbatch results."
    )


def merge(values: Sequence[Any], *, axis: int = 0) -> Any:
    """Combine per-microbatch outputs of the same structure into one.

    Tensors are concatenated along ``axis``; 0-dim tensors are stacked into shape
    ``(num_microbatches,)``. A leaf that is the same object in every microbatch, and non-tensor
    leaves that are equal everywhere, are returned once.
    """
    if not values:
        raise ValueError("merge needs at least one microbatch output, got none")
    flat = [pytree.tree_flatten_with_path(value) for value in values]
    spec = flat[0][1]
    for mb, (_, other) in enumerate(flat[1:], start=1):
        if other != spec:
            raise ValueError(f"microbatch {mb} output structure {other} differs from microbatch 0's {spec}")
    paths = [pytree.keystr(key) for key, _ in flat[0][0]]
    columns = zip(*([leaf for _, leaf in leaves] for leaves, _ in flat))
    return pytree.tree_unflatten([_merge_leaf(list(column), path, axis) for column, path in zip(columns, paths)], spec)
