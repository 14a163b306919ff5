"""The op an expert-parallel program calls: rows to the rank holding their expert and back, by all-to-all.

GShard's dispatch and combine (Lepikhin et al. 2020, arXiv:2006.16668), dropless as the traced model is (every
routed row is computed; a model that drops rows over a capacity leaves them out of its offsets, and they stay
zero here too). Each rank of an ep group holds ``experts / ep`` consecutive experts. A layer's rows arrive sorted
by expert, so the rows bound for each rank are one contiguous run: one ``all_to_all_single`` of the per-expert
counts tells every rank what it will receive, a second sends the rows (torch's autograd-aware functional
collective, whose backward is the all-to-all the other way), the receiver orders them by its local expert, runs
the experts' region (:mod:`partitioner.ep.experts`) with its own weights and offsets, restores the arrival order,
and a third all-to-all sends the results home. Gradients of the weights stay on the rank that holds them; the rows'
gradients travel back the way the rows came.

The op takes an :class:`EPComm` that the program holds as an attribute (``get_attr``): the partitioner writes
programs without any process, and the runtime binds it to this rank's ep process group (:meth:`EPComm.bind`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from ..capture.group_handle import GroupHandle, UnboundHandleError

__all__ = ["EPComm", "UnboundExpertGroupError", "expert_parallel", "expert_range"]


class UnboundExpertGroupError(UnboundHandleError):
    """An expert-parallel program ran before its :class:`EPComm` was bound to a process group."""


def expert_range(experts: int, ep: int, rank: int) -> tuple[int, int]:
    """The ``[start, stop)`` of the experts ep rank ``rank`` of ``ep`` holds (``experts`` divisible by ``ep``)."""
    if experts % ep:
        raise ValueError(f"{experts} experts do not split evenly over expert_parallel_degree={ep}")
    if not 0 <= rank < ep:
        raise ValueError(f"ep rank {rank} is outside an expert-parallel group of {ep}")
    per = experts // ep
    return rank * per, (rank + 1) * per


@dataclass(eq=False)
class EPComm(GroupHandle):
    """The expert-parallel group an expert-parallel program's all-to-alls run on: ``size`` and ``rank`` are fixed
    when the program is written for one ep rank, :meth:`bind` gives it the process group at run time."""

    axis: ClassVar[str] = "expert"
    short: ClassVar[str] = "ep"
    unbound: ClassVar[type[UnboundHandleError]] = UnboundExpertGroupError


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
    return wait_tensor(all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group))


def expert_parallel(comm: EPComm, body: torch.nn.Module, rows: torch.Tensor, offsets: torch.Tensor,
                    *weights: torch.Tensor) -> torch.Tensor:
    """The experts' results for ``rows`` (sorted by expert; ``offsets``: cumulative rows per expert, over every
    expert of the layer), computed by the ranks holding the experts: ``body(rows, offsets, *weights)`` runs on each
    rank over the rows of its experts, ``weights`` being its slices of the stacked weights (and, when the body reads
    them, each row's expert among this rank's)."""
    experts = offsets.shape[0]
    ids = _takes_ids(body, len(weights))
    if isinstance(rows, FakeTensor):  # shapes only (which values carry gradients): what this rank's experts make
        local_ids = (torch.zeros(rows.shape[0], dtype=torch.long, device=rows.device),) if ids else ()
        return body(rows, offsets[:experts // comm.size], *weights, *local_ids)
    group = comm.bound_group()
    counts = torch.diff(offsets.to(torch.int64), prepend=offsets.new_zeros(1, dtype=torch.int64))
    send = counts.reshape(comm.size, experts // comm.size).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    routed = int(send.sum())  # rows past the last offset (dropped over a capacity) are computed by nobody
    in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
    arrived = _all_to_all(rows[:routed], out_splits, in_splits, group)
    # arrival order is (source rank, local expert); the experts' grouped matmuls want (local expert, source rank)
    local = torch.arange(send.shape[1], device=recv.device).repeat(comm.size)
    expert_of = torch.repeat_interleave(local, recv.reshape(-1))
    source_of = torch.repeat_interleave(torch.arange(comm.size, device=recv.device), recv.sum(1))
    order = torch.argsort(expert_of * comm.size + source_of, stable=True).to(rows.device)
    local_offsets = torch.cumsum(recv.sum(0), 0).to(offsets.dtype)
    extra = (expert_of.index_select(0, order.to(expert_of.device)).to(rows.device),) if ids else ()
    done = body(arrived.index_select(0, order), local_offsets, *weights, *extra)
    back = done.index_select(0, torch.argsort(order))
    home = _all_to_all(back, in_splits, out_splits, group)
    if routed == rows.shape[0]:
        return home
    return torch.cat([home, home.new_zeros((rows.shape[0] - routed, *home.shape[1:]))])


def _takes_ids(body: torch.nn.Module, weights: int) -> bool:
    """Whether the region's body reads the rows' expert ids (a placeholder after rows, offsets and the weights)."""
    graph = getattr(body, "graph", None)
    return graph is not None and sum(n.op == "placeholder" for n in graph.nodes) > weights + 2


expert_parallel.smp_region = 1  # type: ignore[attr-defined]  # args[1] is a region's body (capture.autograd_saves)
