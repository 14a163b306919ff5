"""Rank helpers and small collectives of the SMP API, on the process groups ``smp.init`` made.

``smp.barrier`` and ``smp.allgather`` are collective: they first check that every rank of the group is in
the same call (:mod:`smp.runtime.call_log`), then run on smp's own process groups, bounded by ``timeout_s``.
``smp.send``, ``smp.broadcast`` and ``smp.recv_from`` are point to point, as in SMP v1: ``broadcast`` sends
to every other rank of a group, and each receives with ``recv_from`` — from either a ``send`` or a
``broadcast``. Objects travel pickled through the default store (one key per message, deleted by the
receiver), so a sender never waits for its receiver, and a receiver waits at most ``timeout_s``.
"""
from __future__ import annotations

import datetime
import enum
import os
import pickle
from contextlib import contextmanager
from typing import Any, Iterator

import torch.distributed as dist

from pipeline.p2p import PeerError, default_store, failure_note, named_failures
from smp.runtime import state

__all__ = ["CommGroup", "RankType", "WORLD", "MP_GROUP", "PP_GROUP", "DP_GROUP", "RDP_GROUP", "TP_GROUP", "rank",
           "size", "local_rank", "local_size", "pp_rank", "pp_size", "mp_rank", "mp_size", "dp_rank", "dp_size",
           "rdp_rank", "rdp_size", "tp_rank", "tp_size", "get_mp_group", "get_dp_group", "get_pp_group",
           "get_rdp_group", "get_tp_group", "get_pp_process_group", "get_dp_process_group", "get_mp_process_group",
           "get_rdp_process_group", "get_tp_process_group", "get_world_process_group", "barrier", "broadcast",
           "allgather", "send", "recv_from"]


class CommGroup(enum.Enum):
    """SMP's groups of ranks on the grid pp x tp x rdp (:mod:`smp.runtime.topology`): ``PP_GROUP`` this rank's
    pipeline, ``TP_GROUP`` its tensor-parallel group, ``RDP_GROUP`` the replicas of its shard of its stage,
    ``DP_GROUP`` = tp x rdp ranks holding its stage, ``MP_GROUP`` = pp x tp ranks holding one model replica.
    Without tensor parallelism ``MP_GROUP`` = ``PP_GROUP`` and ``RDP_GROUP`` = ``DP_GROUP``."""
    WORLD = 0
    MP_GROUP = 1
    DP_GROUP = 2
    PP_GROUP = 3
    RDP_GROUP = 4
    TP_GROUP = 5


class RankType(enum.Enum):
    """How a rank number passed to ``smp.send`` / ``smp.recv_from`` counts: in the world, or within this
    rank's group of that kind (``PP_RANK`` 0 is the first stage of this rank's pipeline, ``TP_RANK`` 1 the
    second rank of its tensor-parallel group)."""
    WORLD_RANK = 0
    MP_RANK = 1
    DP_RANK = 2
    PP_RANK = 3
    RDP_RANK = 4
    TP_RANK = 5


# SMP v1 exposes the groups at module level too: smp.barrier(smp.PP_GROUP)
WORLD, MP_GROUP, DP_GROUP = CommGroup.WORLD, CommGroup.MP_GROUP, CommGroup.DP_GROUP
PP_GROUP, RDP_GROUP, TP_GROUP = CommGroup.PP_GROUP, CommGroup.RDP_GROUP, CommGroup.TP_GROUP

# smp.runtime.state's kind of each group (with tp = 1 "model-parallel" is the "pipeline", and so on: State.aliases)
_GROUP_KIND = {CommGroup.WORLD: "world", CommGroup.MP_GROUP: "model-parallel", CommGroup.PP_GROUP: "pipeline",
               CommGroup.DP_GROUP: "data-parallel", CommGroup.RDP_GROUP: "reduced-data-parallel",
               CommGroup.TP_GROUP: "tensor-parallel"}
_RANK_KIND = {RankType.WORLD_RANK: "world", RankType.MP_RANK: "model-parallel", RankType.PP_RANK: "pipeline",
              RankType.DP_RANK: "data-parallel", RankType.RDP_RANK: "reduced-data-parallel",
              RankType.TP_RANK: "tensor-parallel"}


def rank() -> int:
    """This process's global rank."""
    return state.get().rank


def size() -> int:
    """The number of processes (pipeline stages x tensor-parallel degree x reduced-data-parallel replicas)."""
    return state.get().topology.world


def local_rank() -> int:
    """This process's rank on its node (torchrun's ``LOCAL_RANK``)."""
    return int(os.environ.get("LOCAL_RANK", state.get().rank))


def local_size() -> int:
    """The number of processes on this node (torchrun's ``LOCAL_WORLD_SIZE``)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", state.get().topology.world))


def pp_rank() -> int:
    """This rank's stage in its pipeline."""
    s = state.get()
    return s.topology.pp_rank(s.rank)


def pp_size() -> int:
    """The number of pipeline stages, ``pipeline_parallel_degree``."""
    return state.get().topology.pp


def mp_rank() -> int:
    """This rank's index in its model-parallel group (``smp.get_mp_group()``): ``pp_rank()`` without tensor
    parallelism; ``pp_rank() * tp_size() + tp_rank()`` under the "cluster" placement."""
    s = state.get()
    return s.topology.mp_rank(s.rank)


def mp_size() -> int:
    """The number of ranks holding one model replica: pp x tp."""
    return state.get().topology.mp


def dp_rank() -> int:
    """This rank's index in its data-parallel group (``smp.get_dp_group()``): ``rdp_rank()`` without tensor
    parallelism; ``rdp_rank() * tp_size() + tp_rank()`` under the "cluster" placement."""
    s = state.get()
    return s.topology.dp_rank(s.rank)


def dp_size() -> int:
    """The data-parallel degree: tp x rdp (tensor parallelism is carved out of the data-parallel ranks)."""
    return state.get().topology.dp


def rdp_rank() -> int:
    """Which replica of its stage (and tensor-parallel shard) this rank is (``smp.dp_rank()`` when tp = 1)."""
    s = state.get()
    return s.topology.rdp_rank(s.rank)


def rdp_size() -> int:
    """The number of replicas of each stage and shard: dp / tp (``smp.dp_size()`` when tp = 1)."""
    return state.get().topology.rdp


def tp_rank() -> int:
    """This rank's index in its tensor-parallel group (0 when ``tensor_parallel_degree`` is 1)."""
    s = state.get()
    return s.topology.tp_rank(s.rank)


def tp_size() -> int:
    """The tensor-parallel degree, ``tensor_parallel_degree``."""
    return state.get().topology.tp


def get_mp_group() -> list[int]:
    """Global ranks holding this rank's model replica (pp x tp), in ``mp_rank`` order: without tensor parallelism
    this rank's pipeline, in stage order."""
    return state.get().ranks("model-parallel")


def get_pp_group() -> list[int]:
    """Global ranks of this rank's pipeline, in stage order."""
    return state.get().ranks("pipeline")


def get_dp_group() -> list[int]:
    """Global ranks holding this rank's stage (tp x rdp), in ``dp_rank`` order."""
    return state.get().ranks("data-parallel")


def get_rdp_group() -> list[int]:
    """Global ranks holding this rank's shard of its stage in every replica, in ``rdp_rank`` order."""
    return state.get().ranks("reduced-data-parallel")


def get_tp_group() -> list[int]:
    """Global ranks of this rank's tensor-parallel group, in ``tp_rank`` order (``[smp.rank()]`` when tp = 1)."""
    return state.get().ranks("tensor-parallel")


def get_pp_process_group() -> Any:
    """The torch process group of this rank's pipeline (created with ``timeout_s``)."""
    return state.get().group("pipeline")


def get_mp_process_group() -> Any:
    """The torch process group of ``smp.get_mp_group()`` (the pipeline's when tp = 1)."""
    return state.get().group("model-parallel")


def get_dp_process_group() -> Any:
    """The torch process group of ``smp.get_dp_group()`` (created with ``timeout_s``)."""
    return state.get().group("data-parallel")


def get_rdp_process_group() -> Any:
    """The torch process group of ``smp.get_rdp_group()`` (the data-parallel one when tp = 1)."""
    return state.get().group("reduced-data-parallel")


def get_world_process_group() -> Any:
    """The torch process group of every rank, with smp's ``timeout_s``."""
    return state.get().group("world")


def get_tp_process_group() -> Any:
    """The torch process group of ``smp.get_tp_group()``. With tp = 1 it is this rank alone, made on first use by
    its one member, so ranks may ask for it at different times."""
    return state.get().group("tensor-parallel")


def _kind(group: CommGroup) -> str:
    if group not in _GROUP_KIND:
        raise ValueError(f"unknown group {group!r}; use one of smp.{', smp.'.join(g.name for g in CommGroup)}")
    return _GROUP_KIND[group]


@contextmanager
def _collective(group: CommGroup, call: str) -> Iterator[Any]:
    """Check that every rank of ``group`` makes this call, run it on smp's group (bounded by timeout_s), and
    report any failure so that the peers stop too."""
    st = state.get()
    kind = _kind(group)
    pg = st.enter(kind, call)
    peers = [r for r in st.ranks(kind) if r != st.rank]
    try:
        with named_failures(call, peers, st.rank, st.config.timeout_s):
            yield pg
    except BaseException as exc:
        st.report_failure(exc)
        raise


def barrier(group: CommGroup = CommGroup.WORLD) -> None:
    """Wait until every rank of ``group`` gets here (at most ``timeout_s``)."""
    with _collective(group, "smp.barrier()") as pg:
        dist.barrier(group=pg)


def allgather(obj: Any, group: CommGroup = CommGroup.WORLD) -> list[Any]:
    """Every rank of ``group`` contributes ``obj``; all get the list, in group order."""
    with _collective(group, "smp.allgather()") as pg:
        out: list[Any] = [None] * len(state.get().ranks(_kind(group)))
        dist.all_gather_object(out, obj, group=pg)
    return out


def _key(src: int, dst: int, n: int) -> str:
    return f"smp/messages/{src}/{dst}/{n}"


def _to_world(r: int, rank_type: RankType) -> int:
    if rank_type not in _RANK_KIND:
        raise ValueError(f"unknown rank type {rank_type!r}; use one of smp.RankType."
                         f"{', smp.RankType.'.join(t.name for t in RankType)}")
    ranks = state.get().ranks(_RANK_KIND[rank_type])
    if not isinstance(r, int) or not 0 <= r < len(ranks):
        raise ValueError(f"rank {r!r} is not a {rank_type.name} of rank {state.get().rank}: use 0 .. {len(ranks) - 1}")
    return ranks[r]


def _post(dst: int, data: bytes) -> None:
    st = state.get()
    n = st.messages.get((st.rank, dst), 0)
    st.messages[(st.rank, dst)] = n + 1
    default_store().set(_key(st.rank, dst, n), data)


def send(obj: Any, dest: int, rank_type: RankType = RankType.WORLD_RANK) -> None:
    """Send ``obj`` to rank ``dest`` (counted as ``rank_type`` says), which receives it with ``recv_from``.
    Returns at once: the object waits in the store for its receiver."""
    _post(_to_world(dest, rank_type), pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def broadcast(obj: Any, group: CommGroup = CommGroup.WORLD) -> Any:
    """Send ``obj`` from this rank to every other rank of ``group``; each receives it with ``recv_from``."""
    st = state.get()
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    for r in st.ranks(_kind(group)):
        if r != st.rank:
            _post(r, data)
    return obj


def recv_from(src: int, rank_type: RankType = RankType.WORLD_RANK) -> Any:
    """Receive the next object rank ``src`` (counted as ``rank_type`` says) sent to this rank with ``send``
    or ``broadcast``; waits at most ``timeout_s``."""
    st = state.get()
    world_src = _to_world(src, rank_type)
    n = st.messages.get((world_src, st.rank), 0)
    key, store = _key(world_src, st.rank, n), default_store()
    try:
        store.wait([key], datetime.timedelta(seconds=st.config.timeout_s))
    except RuntimeError:
        note = failure_note(store)
        exc = PeerError(f"rank {st.rank}: smp.recv_from({src}, {rank_type}) failed: {note}" if note else
                        f"rank {st.rank}: smp.recv_from({src}, {rank_type}) received nothing from rank {world_src} "
                        f"within {st.config.timeout_s:g} s: that rank must send it with smp.send(obj, ...) or "
                        "smp.broadcast(obj, group); if it is only busy for longer, raise timeout_s",
                        culprit=None if note else world_src)
        st.report_failure(exc)
        raise exc from None
    data = store.get(key)
    store.delete_key(key)
    st.messages[(world_src, st.rank)] = n + 1
    return pickle.loads(data)
