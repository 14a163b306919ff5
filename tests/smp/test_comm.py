"""The SMP rank helpers' point-to-point calls pair up in every numbering (``smp.send`` / ``smp.broadcast``
with ``smp.recv_from``), the group and rank-type names of SMP v1 exist, and a receive that gets nothing
ends within ``timeout_s`` naming the silent rank."""
from __future__ import annotations

import time

import pytest
import torch

from smp.testing import run_ranks


def _p2p(rank: int, world: int):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "timeout_s": 2})
    got = {}
    if smp.pp_rank() == 0:
        # The GPT-2 example's pattern: the first stage reads the data and tells the others how many batches.
        smp.broadcast(17, smp.PP_GROUP)
        smp.send({"step": 3}, 1, smp.RankType.PP_RANK)
        smp.send(torch.arange(4), 1)  # world numbering by default
        got["reply"] = smp.recv_from(1, smp.RankType.MP_RANK)
    else:
        got["batches"] = smp.recv_from(0, smp.RankType.PP_RANK)
        got["dict"] = smp.recv_from(0, smp.RankType.PP_RANK)
        got["tensor"] = smp.recv_from(0, smp.RankType.WORLD_RANK).tolist()  # tensors do not leave a rank well
        time.sleep(0.5)  # a sender never waits for its receiver
        smp.send("thanks", 0, smp.RankType.PP_RANK)
    # SMP v1's names, and no tensor parallelism.
    got["names"] = (smp.PP_GROUP is smp.CommGroup.PP_GROUP, smp.MP_GROUP is smp.CommGroup.MP_GROUP,
                    smp.DP_GROUP is smp.CommGroup.DP_GROUP, smp.RDP_GROUP is smp.CommGroup.RDP_GROUP,
                    smp.WORLD is smp.CommGroup.WORLD, smp.tp_rank(), smp.tp_size())
    got["gather_pp"] = smp.allgather(smp.pp_rank(), smp.PP_GROUP)
    got["gather_rdp"] = smp.allgather(smp.rank(), smp.RDP_GROUP)  # one replica: a group of one
    smp.barrier(smp.MP_GROUP)
    smp.barrier(smp.PP_GROUP)  # the same group under SMP's two names
    try:
        smp.send("x", 2, smp.RankType.PP_RANK)
    except ValueError as exc:
        got["bad_rank"] = str(exc)
    t0 = time.monotonic()
    if rank == 0:
        try:
            smp.recv_from(1, smp.RankType.RDP_RANK)  # nobody sends it
        except ValueError as exc:
            got["bad_rdp"] = str(exc)
        try:
            smp.recv_from(1, smp.RankType.PP_RANK)
        except Exception as exc:
            got["silent"] = (type(exc).__name__, str(exc), time.monotonic() - t0)
    else:
        time.sleep(4)
    return got


def test_send_broadcast_and_recv_from_pair_in_every_numbering():
    r0, r1 = run_ranks(_p2p, 2, timeout=120)
    assert r1["batches"] == 17 and r1["dict"] == {"step": 3}, r1
    assert r1["tensor"] == [0, 1, 2, 3] and r0["reply"] == "thanks", (r0, r1)
    assert r0["names"] == r1["names"] == (True, True, True, True, True, 0, 1)
    assert r0["gather_pp"] == r1["gather_pp"] == [0, 1] and (r0["gather_rdp"], r1["gather_rdp"]) == ([0], [1])
    assert "rank 2 is not a PP_RANK of rank 0: use 0 .. 1" in r0["bad_rank"], r0
    assert "rank 1 is not a RDP_RANK of rank 0: use 0 .. 0" in r0["bad_rdp"], r0
    kind, msg, elapsed = r0["silent"]
    assert kind == "PeerError" and "received nothing from rank 1 within 2 s" in msg and "smp.send" in msg, msg
    assert elapsed < 6, elapsed


def test_unknown_group_is_an_error():
    import smp.ranks as comm

    with pytest.raises(ValueError, match="unknown group 'pp'; use one of smp.WORLD"):
        comm._kind("pp")


def _groups(rank: int, world: int):
    import torch.distributed as dist

    import smp

    smp.init({"pipeline_parallel_degree": 2, "ddp": True, "placement_strategy": "spread"})
    if rank % 2:  # the tensor-parallel group is made by its one member alone: other ranks never ask
        time.sleep(0.5)
    tp = smp.get_tp_process_group()
    one = torch.ones(1) * (rank + 1)
    dist.all_reduce(one, group=tp)  # a group of this rank alone: nothing added
    world_sum = torch.ones(1)
    dist.all_reduce(world_sum, group=smp.get_world_process_group())
    pp_sum = torch.tensor([float(rank)])
    dist.all_reduce(pp_sum, group=smp.get_mp_process_group())
    return {"lists": (smp.get_pp_group(), smp.get_mp_group(), smp.get_tp_group(), smp.get_rdp_group(),
                      smp.get_dp_group()),
            "sizes": [dist.get_world_size(g) for g in (tp, smp.get_world_process_group(), smp.get_mp_process_group(),
                                                          smp.get_pp_process_group(), smp.get_rdp_process_group(),
                                                          smp.get_dp_process_group())],
            "same": (smp.get_tp_process_group() is tp, smp.get_rdp_process_group() is smp.get_dp_process_group()),
            "sums": (float(one), float(world_sum), float(pp_sum))}


def test_group_getters_of_smp_v1_return_real_groups():
    results = run_ranks(_groups, 4, timeout=120)
    for rank, r in enumerate(results):
        pipeline = [0, 2] if rank % 2 == 0 else [1, 3]  # spread: the replicas of a stage are neighbours
        replicas = [0, 1] if rank < 2 else [2, 3]
        assert r["lists"] == (pipeline, pipeline, [rank], replicas, replicas), r
        assert r["sizes"] == [1, 4, 2, 2, 2, 2] and r["same"] == (True, True), r
        assert r["sums"] == (rank + 1, 4, sum(pipeline)), r
