"""Which batch a tensor-parallel group runs: SMP v1's ``prescaled_batch``.

With ``tensor_parallel_degree`` > 1 and ``prescaled_batch`` False (SMP's default) every rank reads its own batch
(data sharded by ``smp.dp_rank()``), and the ranks of a tp group must still compute on the same samples, since
each holds one shard of the same layers. So the step's arguments are regrouped: every tensor argument is
all-gathered along dim 0 over the tp group, and each rank of the group runs the step on the concatenation, in
``tp_rank`` order, of its group's batches (SMP's global batch is then ``dp_size`` x the per-rank batch). With
``prescaled_batch`` True the tp group already reads one batch (data sharded by ``smp.rdp_rank()``) and nothing
moves; a group that was handed different batches would train on a mixture of them, so on the first call of each
step function :func:`check_one_batch` compares a fingerprint of every rank's arguments
(:mod:`smp.engine.fingerprint`) and stops the step with :class:`BatchDiffersError`, naming the ranks. Nothing else
crosses the group before the forward, so the fingerprints travel in a collective of their own: one small
``all_gather_object`` on that first call, none after (a batch that drifts apart later is not seen). The pp ranks'
arguments are not compared (SMP v1: pp_rank 0's are the truth, the others may be placeholders), and the
data-parallel replicas' weights are, once (:mod:`smp.engine.replicas`).

:func:`regroup_batch` does it for one call's ``(args, kwargs)``, as :func:`smp.engine.step_values.share_inputs`
treats them: tensors travel; Python scalars (bool, int, float, complex, str, bytes, None) and 0-dim tensors must
be equal on every rank of the group; other objects (the model, an optimizer) are each rank's own and stay.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from partitioner.errors import EngineError
from smp.engine.fingerprint import difference, fingerprint

__all__ = ["regroup_batch", "check_one_batch", "BatchMismatchError", "BatchDiffersError", "AXES"]

_SCALARS = (bool, int, float, complex, str, bytes, type(None))
# The groups whose ranks run one batch, as the errors name them: (group, a rank's index in it, what to shard data by
# for one batch per group).
AXES = {"tp": ("tensor-parallel", "tp_rank", "smp.rdp_rank()"),
        "cp": ("context-parallel", "cp_rank", "smp.rdp_rank() // context_parallel_degree")}


class BatchMismatchError(EngineError, ValueError):
    """The ranks of a tensor-parallel group passed step arguments that cannot be concatenated into one batch."""


class BatchDiffersError(BatchMismatchError):
    """With ``prescaled_batch`` True the ranks of a tensor-parallel group passed different batches (the message names
    the ranks, the first argument that differs and how)."""


def _describe(x: Any) -> tuple:
    """What the other ranks of the group must know of one leaf: how it is regrouped and what must agree."""
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided:
            return ("unsupported", f"a {x.layout} tensor")
        if x.dim() == 0:
            return ("same", "tensor", str(x.dtype), x.item())
        return ("gather", str(x.dtype), tuple(x.shape), x.requires_grad)
    if isinstance(x, _SCALARS):
        return ("same", type(x).__name__, x)
    return ("own", type(x).__name__)


def _what(desc: tuple) -> str:
    if desc[0] == "gather":
        return f"a {desc[1]} tensor"
    if desc[0] == "same":
        return "a 0-dim tensor" if desc[1] == "tensor" else f"a Python {desc[1]}"
    return f"a {desc[1]} (each rank's own object)"


def _check(names: list[str], described: list[tuple], axis: str) -> None:
    """Raise unless every rank's (structure, leaf descriptions) can be regrouped with tp_rank 0's; every rank
    reads the same ``described`` (one entry per tp rank), so every rank raises the same error."""
    kind, rank, _ = AXES[axis]
    spec, ref = described[0]
    for r, (spec_r, leaves_r) in enumerate(described):
        if spec_r != spec:
            raise BatchMismatchError(f"the step's arguments have another structure on {rank} {r} ({spec_r}) than on "
                                     f"{rank} 0 ({spec}): every rank of a {kind} group must pass arguments "
                                     "of one structure, whose tensors are concatenated along dim 0")
        for name, a, b in zip(names, ref, leaves_r):
            where = f"step argument {name} on {rank} {r}"
            if b[0] == "unsupported":
                raise BatchMismatchError(f"{where} is {b[1]}: only dense (strided) tensors can be regrouped over a "
                                         f"{kind} group")
            if b[0] == "gather" and b[3]:
                raise BatchMismatchError(f"{where} requires grad: regrouping it over the {kind} group would "
                                         "cut its graph; pass data tensors, or set 'prescaled_batch': True and feed "
                                         "every rank of the group the same batch")
            if a[:2] != b[:2]:
                raise BatchMismatchError(f"{where} is {_what(b)}, on {rank} 0 {_what(a)}: the ranks of a "
                                         f"{kind} group must pass the same kinds and dtypes")
            if a[0] == "gather" and (len(a[2]) != len(b[2]) or a[2][1:] != b[2][1:]):
                raise BatchMismatchError(f"{where} has shape {list(b[2])}, on {rank} 0 {list(a[2])}: tensors are "
                                         "concatenated along dim 0, so all other dimensions must agree")
            if a[0] == "same" and not _equal(a[2], b[2]):
                raise BatchMismatchError(f"{where} is {b[2]!r}, on {rank} 0 {a[2]!r}: arguments that are not "
                                         f"batched tensors must be equal on every rank of a {kind} group "
                                         "(or set 'prescaled_batch': True)")


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) or (a != a and b != b)  # NaN equals NaN here: the same value was passed
    except Exception:
        return False


def _gather(x: torch.Tensor, rows: list[int], group: Any) -> torch.Tensor:
    """``x`` of every rank of ``group`` concatenated along dim 0 (ranks may hold different numbers of rows)."""
    wide = max(rows)
    send = x.detach().contiguous()
    if send.shape[0] < wide:
        send = torch.cat([send, send.new_zeros((wide - send.shape[0], *send.shape[1:]))])
    if send.dtype == torch.bool:  # not every backend reduces or gathers bool: move its bytes
        send = send.view(torch.uint8)
    parts = [torch.empty_like(send) for _ in rows]
    dist.all_gather(parts, send, group=group)
    out = torch.cat([p[:n] for p, n in zip(parts, rows)])
    return out.view(torch.bool) if x.dtype == torch.bool else out


def regroup_batch(args: tuple, kwargs: dict, group: Any, tp_size: int, prescaled: bool,
                  axis: str = "tp") -> tuple[tuple, dict]:
    """The step arguments ``(args, kwargs)`` this rank runs on, within its tensor-parallel ``group`` of
    ``tp_size`` ranks (a torch process group; None: the default group).

    ``prescaled`` (``prescaled_batch``) True, or ``tp_size`` 1: the arguments as they are, with no communication.
    Otherwise every tensor with a batch dimension becomes the concatenation along dim 0, in ``tp_rank`` order, of
    that tensor on every rank of the group (ranks may pass different numbers of rows); Python scalars and 0-dim
    tensors must be equal on every rank, other objects stay this rank's own. A mismatch (structure, dtype, trailing
    dimensions, a scalar, a tensor that requires grad) raises :class:`BatchMismatchError` on every rank.
    Every rank of the group must call it, in the same order as its other collectives on ``group``. ``axis``: the
    group is a tensor-parallel one (``"tp"``) or a context-parallel one (``"cp"``, whose ranks likewise run one
    batch), as the errors say.
    """
    if prescaled or tp_size == 1:
        return args, kwargs
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"regroup_batch: tp_size={tp_size!r} is not a positive integer")
    if dist.get_world_size(group) != tp_size:
        raise ValueError(f"regroup_batch: the group has {dist.get_world_size(group)} ranks, tp_size={tp_size}: "
                         f"pass this rank's {AXES[axis][0]} group")
    names, leaves, spec = _named_leaves(args, kwargs)
    theirs: list[Any] = [None] * tp_size
    dist.all_gather_object(theirs, (str(spec), [_describe(x) for x in leaves]), group=group)
    _check(names, theirs, axis)
    out = []
    for i, x in enumerate(leaves):
        if theirs[0][1][i][0] == "gather":
            x = _gather(x, [t[1][i][2][0] for t in theirs], group)
        out.append(x)
    new_args, new_kwargs = pytree.tree_unflatten(out, spec)
    return tuple(new_args), dict(new_kwargs)


def _named_leaves(args: tuple, kwargs: dict) -> tuple[list[str], list[Any], Any]:
    """The leaves of the step arguments, each named as the user wrote it (``args[0]``, ``kwargs['labels']``), and
    their structure."""
    paths, spec = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    names = [("args" if path[0] == pytree.SequenceKey(0) else "kwargs") + pytree.keystr(path[1:])
             for path, _ in paths]
    return names, [x for _, x in paths], spec


def _print(x: Any) -> tuple:
    if isinstance(x, torch.Tensor):
        return ("tensor", fingerprint(x))
    return ("value", x) if isinstance(x, _SCALARS) else ("own", type(x).__name__)  # the model: each rank's own


def _differs(names: list[str], mine: tuple, theirs: tuple) -> tuple[str, str] | None:
    """The first difference of ``theirs`` (structure, leaf prints) from ``mine``: (what differs, how, theirs first);
    None if none does."""
    if mine[0] != theirs[0]:
        return "arguments", f"another structure, {theirs[0]} against {mine[0]}"
    for name, a, b in zip(names, mine[1], theirs[1]):
        why = None
        if a[0] != b[0]:
            why = f"a {b[0]} against a {a[0]}"
        elif a[0] == "tensor":
            why = difference(b[1], a[1])
        elif a[0] == "value" and not _equal(a[1], b[1]):
            why = f"{b[1]!r} against {a[1]!r}"
        if why is not None:
            return f"step argument {name}", why
    return None


def check_one_batch(args: tuple, kwargs: dict, group: Any, ranks: list[int], axis: str = "tp") -> None:
    """Raise :class:`BatchDiffersError` on every rank of the tensor-parallel ``group`` (its global ``ranks``, in
    ``tp_rank`` order) unless every rank passed the same step arguments ``(args, kwargs)``: the same structure and
    Python scalars, tensors of the same :func:`~smp.engine.fingerprint.fingerprint` (other objects, such as the
    model, are each rank's own and not compared). The group runs one batch under ``prescaled_batch`` True and
    moves no data, so this is a collective of its own: one ``all_gather_object`` of a few dozen bytes per tensor,
    plus one pass over each tensor to fingerprint it; the caller runs it on the first call of each step function
    only. Every rank of the group must call it, in the same order as its other collectives on ``group``. ``axis``:
    as :func:`regroup_batch`'s."""
    kind, rank, shard_by = AXES[axis]
    names, leaves, spec = _named_leaves(args, kwargs)
    theirs: list[Any] = [None] * len(ranks)
    dist.all_gather_object(theirs, (str(spec), [_print(x) for x in leaves]), group=group)
    differ = {t: why for t in range(1, len(ranks)) if (why := _differs(names, theirs[0], theirs[t])) is not None}
    if not differ:
        return
    first = min(differ)
    what, how = differ[first]
    who = ", ".join(f"{ranks[t]} ({rank} {t})" for t in differ)
    raise BatchDiffersError(
        f"prescaled_batch is True, so the ranks of a {kind} group must pass one batch, but rank(s) {who} "
        f"passed another batch than rank {ranks[0]} ({rank} 0): rank {ranks[first]}'s {what} differs from rank "
        f"{ranks[0]}'s ({how}), and the group would train on a mixture of them. Pass the same batch on every rank of "
        f"a {kind} group when prescaled_batch is True (shard the data by {shard_by}, not smp.dp_rank()), "
        f"or set prescaled_batch False (each {rank} then reads its own batch and the group runs on their "
        "concatenation)")
