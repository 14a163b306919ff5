"""The ops a context-parallel program calls: this rank's tokens of a whole value, the whole sequence from every
rank's tokens, the causal mask of this rank's queries and the cross-entropy over the group's tokens.

A context-parallel group of ``size`` ranks splits every sequence into ``2 x size`` chunks and gives rank ``r``
chunks ``r`` and ``2 x size - 1 - r`` (:meth:`CPComm.positions`): under a causal mask the early chunks' queries
see few keys and the late ones' many, so pairing them balances the attention work (Megatron-Core's and
torchtitan's load balancing; Brandon et al. 2023, "Striped Attention", arXiv:2311.09431, for the imbalance). A
sequence that does not split into ``2 x size`` chunks is split into ``size`` consecutive ones.

Gradients follow torch's own functional collectives (``torch.distributed._functional_collectives``): the
all-gather's backward is a reduce-scatter and the all-reduce's an all-reduce, so each rank's parameters' gradients
come out as it would see them as one data-parallel replica of the group's batch, and the runtime averages them over
the data-parallel ranks of which the group is part, as Megatron-Core does. The ops take a :class:`CPComm` that the
program holds as an attribute; the runtime binds it to the process group (:meth:`CPComm.bind`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from ..capture.group_handle import GroupHandle, UnboundHandleError
from ..tp.collectives import Tokens

__all__ = ["CPComm", "UnboundContextGroupError", "cp_scatter", "cp_gather", "cp_causal_mask", "cp_cross_entropy",
           "cp_group_loss", "CONTEXT_OPS"]


class UnboundContextGroupError(UnboundHandleError):
    """A context-parallel program ran before its :class:`CPComm` was bound to a process group."""


@dataclass(eq=False)
class CPComm(GroupHandle):
    """The context-parallel group a program's collectives run on: ``size`` and ``rank`` are fixed when the program
    is written for one cp rank, :meth:`bind` gives it the process group at run time."""

    axis: ClassVar[str] = "context"
    short: ClassVar[str] = "cp"
    unbound: ClassVar[type[UnboundHandleError]] = UnboundContextGroupError

    def positions(self, seq: int, device: Any = "cpu", rank: int | None = None) -> torch.Tensor:
        """The positions of a sequence of ``seq`` tokens that cp rank ``rank`` (default: this one) holds, in the
        order it holds them (see the module docstring)."""
        r = self.rank if rank is None else rank
        if seq % self.size:
            raise ValueError(f"a sequence of {seq} tokens does not split over context_parallel_degree={self.size}: "
                             "pad the sequence to a multiple of the degree (twice it balances causal attention)")
        if seq % (2 * self.size):
            chunk = seq // self.size
            return torch.arange(r * chunk, (r + 1) * chunk, device=device)
        chunk = seq // (2 * self.size)
        late = 2 * self.size - 1 - r
        return torch.cat([torch.arange(r * chunk, (r + 1) * chunk, device=device),
                          torch.arange(late * chunk, (late + 1) * chunk, device=device)])


def _split(x: torch.Tensor, tokens: Tokens, seq: int) -> tuple[torch.Tensor, int, list[int]]:
    """``x`` viewed with its ``seq`` positions on an axis of their own, that axis, and ``x``'s shape."""
    dim, outer, inner = tokens
    shape = list(x.shape)
    return x.reshape(shape[:dim] + [outer, seq, inner] + shape[dim + 1:]), dim + 1, shape


def cp_scatter(x: torch.Tensor, tokens: Tokens, comm: CPComm) -> torch.Tensor:
    """This rank's tokens of ``x``, a value every rank holds whole (positions, their rotary angles, a mask's rows,
    the labels): no communication; backward, the gradient of the whole value is this rank's share (zero elsewhere)."""
    seq = x.shape[tokens[0]] // (tokens[1] * tokens[2])
    view, axis, shape = _split(x, tokens, seq)
    shape[tokens[0]] //= comm.size
    return view.index_select(axis, comm.positions(seq, x.device)).reshape(shape)


def cp_gather(x: torch.Tensor, tokens: Tokens, comm: CPComm) -> torch.Tensor:
    """The whole sequence of ``x`` from every rank's tokens, in position order (keys and values for attention, an
    output, an op that mixes positions); backward, the gradients of each rank's tokens summed over the group
    (a reduce-scatter)."""
    local = x.shape[tokens[0]] // (tokens[1] * tokens[2])
    view, axis, shape = _split(x, tokens, local)
    seq = local * comm.size
    shape[tokens[0]] *= comm.size
    if isinstance(x, FakeTensor):  # shapes only: no group to gather from
        return torch.cat([view] * comm.size, axis).reshape(shape)
    # torch's autograd-aware all-gather stacks along dim 0: the positions' axis goes there and back
    stacked = funcol.all_gather_single(view.movedim(axis, 0).contiguous(), 0, comm.bound_group()).movedim(0, axis)
    held = torch.cat([comm.positions(seq, x.device, r) for r in range(comm.size)])
    return stacked.index_select(axis, torch.argsort(held)).reshape(shape)


def cp_causal_mask(query: torch.Tensor, keys: int, comm: CPComm) -> torch.Tensor:
    """The causal mask (True: attend) of this rank's queries (``query``: its tokens on the second-last dimension)
    over all ``keys`` tokens: what ``is_causal=True`` means for the whole sequence, restricted to this rank's rows."""
    seq = query.shape[-2] * comm.size
    # top-left aligned, as scaled_dot_product_attention's is_causal: query i attends keys 0..i
    return comm.positions(seq, query.device)[:, None] >= torch.arange(keys, device=query.device)[None, :]


def cp_cross_entropy(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                     reduction: int = 1, ignore_index: int = -100, label_smoothing: float = 0.0, *,
                     comm: CPComm) -> torch.Tensor:
    """``aten.cross_entropy_loss`` over the tokens of the whole group, from this rank's (``reduction``: 0 none,
    1 mean, 2 sum): as :func:`cp_group_loss` makes of this rank's tokens' losses, the mean divided by the group's
    weight of targets that are not ignored, as one process's mean over the whole sequence divides it."""
    losses = F.cross_entropy(logits, target, weight, ignore_index=ignore_index, reduction="none",
                             label_smoothing=label_smoothing)
    kept = target != ignore_index
    return cp_group_loss(losses, weight[target.clamp(min=0)] * kept if weight is not None else kept, reduction,
                         comm=comm)


def cp_group_loss(losses: torch.Tensor, kept: torch.Tensor, reduction: int = 1, *, comm: CPComm) -> torch.Tensor:
    """The group's loss from this rank's tokens' ``losses`` (``reduction``: 0 none: those; 2 sum: their sum over the
    group; 1 mean: that sum over the group's sum of ``kept``, each token's weight, 0 where its target is ignored).
    The sum is all-reduced with autograd (its gradient all-reduced back), the weights without."""
    if reduction == 0:
        return losses
    total = losses.sum()
    if isinstance(losses, FakeTensor):
        return total
    group = comm.bound_group()
    total = funcol.all_reduce(total, "sum", group)
    if reduction == 2:
        return total
    count = kept.sum().to(total.dtype)
    dist.all_reduce(count, group=group)
    return total / count


# The context-parallel ops (partitioner.cp.context_program), priced by partitioner.cp.pricing.
CONTEXT_OPS = frozenset({cp_scatter, cp_gather, cp_causal_mask, cp_cross_entropy, cp_group_loss})
