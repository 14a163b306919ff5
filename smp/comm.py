"""Rank helpers and small collectives of the SMP API, on the process groups ``smp.init`` made."""
from __future__ import annotations

import enum
import os
from typing import Any

import torch.distributed as dist

from . import state

__all__ = ["CommGroup", "RankType", "rank", "size", "local_rank", "local_size", "pp_rank", "pp_size", "mp_rank",
           "mp_size", "dp_rank", "dp_size", "rdp_rank", "rdp_size", "get_mp_group", "get_dp_group",
           "get_pp_process_group", "get_dp_process_group", "barrier", "broadcast", "allgather", "send", "recv_from"]


class CommGroup(enum.Enum):
    WORLD = 0
    MP_GROUP = 1
    DP_GROUP = 2


class RankType(enum.Enum):
    WORLD_RANK = 0
    MP_RANK = 1
    DP_RANK = 2


def rank() -> int:
    return state.get().rank


def size() -> int:
    return state.get().topology.world


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", state.get().rank))


def local_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", state.get().topology.world))


def pp_rank() -> int:
    s = state.get()
    return s.topology.pp_rank(s.rank)


def pp_size() -> int:
    return state.get().topology.pp


mp_rank, mp_size = pp_rank, pp_size  # without tensor parallelism the model-parallel group is the pipeline


def dp_rank() -> int:
    s = state.get()
    return s.topology.dp_rank(s.rank)


def dp_size() -> int:
    return state.get().topology.dp


rdp_rank, rdp_size = dp_rank, dp_size  # reduced-data-parallel = data-parallel without tensor parallelism


def get_mp_group() -> list[int]:
    s = state.get()
    return next(g for g in s.topology.mp_groups() if s.rank in g)


def get_dp_group() -> list[int]:
    s = state.get()
    return next(g for g in s.topology.dp_groups() if s.rank in g)


def get_pp_process_group() -> Any:
    return state.get().mp_group


def get_dp_process_group() -> Any:
    return state.get().dp_group


def _group(group: CommGroup) -> tuple[Any, list[int]]:
    if group == CommGroup.WORLD:
        return None, list(range(size()))
    if group == CommGroup.MP_GROUP:
        return state.get().mp_group, get_mp_group()
    if group == CommGroup.DP_GROUP:
        return state.get().dp_group, get_dp_group()
    raise ValueError(f"unknown group {group!r}; use smp.CommGroup.WORLD, MP_GROUP or DP_GROUP")


def barrier(group: CommGroup = CommGroup.WORLD) -> None:
    dist.barrier(group=_group(group)[0])


def broadcast(obj: Any, group: CommGroup = CommGroup.WORLD) -> Any:
    """Send ``obj`` from this rank to every other rank of ``group``; they receive it with ``recv_from``."""
    pg, members = _group(group)
    box = [obj]
    dist.broadcast_object_list(box, src=rank(), group=pg)
    return obj


def send(obj: Any, dest: int, rank_type: RankType = RankType.WORLD_RANK) -> None:
    dist.send_object_list([obj], dst=_to_world(dest, rank_type))


def recv_from(src: int, rank_type: RankType = RankType.WORLD_RANK) -> Any:
    """Receive an object a rank sent with ``smp.broadcast`` (src is in ``rank_type`` numbering)."""
    world_src = _to_world(src, rank_type)
    s = state.get()
    if rank_type == RankType.MP_RANK:
        pg = s.mp_group
    elif rank_type == RankType.DP_RANK:
        pg = s.dp_group
    else:
        pg = None
    box = [None]
    dist.broadcast_object_list(box, src=world_src, group=pg)
    return box[0]


def allgather(obj: Any, group: CommGroup = CommGroup.WORLD) -> list[Any]:
    pg, members = _group(group)
    out: list[Any] = [None] * len(members)
    dist.all_gather_object(out, obj, group=pg)
    return out


def _to_world(r: int, rank_type: RankType) -> int:
    if rank_type == RankType.MP_RANK:
        return get_mp_group()[r]
    if rank_type == RankType.DP_RANK:
        return get_dp_group()[r]
    return r
