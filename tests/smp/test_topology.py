"""Ranks, groups and placements (``placement_strategy``): the topology of 8 ranks, and the rank helpers on
pp2 x dp2."""
from __future__ import annotations

import pytest

from smp.runtime.topology import Topology
from smp.testing import run_ranks

# --- rank helpers and placement ---------------------------------------------------------------------------------


@pytest.mark.parametrize("placement,mp,dp", [
    ("cluster", [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("spread", [[0, 4], [1, 5], [2, 6], [3, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]]),
])
def test_topology_8_ranks(placement, mp, dp):
    t = Topology(8, 2, placement)
    assert t.dp == 4 and t.mp_groups() == mp and t.dp_groups() == dp
    for r in range(8):
        assert t.pp_rank(r) == next(g.index(r) for g in mp if r in g)
        assert t.dp_rank(r) == next(g.index(r) for g in dp if r in g)
    with pytest.raises(ValueError, match="multiple of pipeline_parallel_degree"):
        Topology(6, 4)


def _ranks(rank: int, world: int, placement: str):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "ddp": True, "placement_strategy": placement})
    me = {"rank": smp.rank(), "size": smp.size(), "local_rank": smp.local_rank(), "local_size": smp.local_size(),
          "pp_rank": smp.pp_rank(), "pp_size": smp.pp_size(), "mp_rank": smp.mp_rank(), "mp_size": smp.mp_size(),
          "dp_rank": smp.dp_rank(), "dp_size": smp.dp_size(), "rdp_rank": smp.rdp_rank(),
          "mp_group": smp.get_mp_group(), "dp_group": smp.get_dp_group()}
    # broadcast / recv_from in each numbering: the group's rank 0 sends, the others receive
    if smp.rank() == 0:
        me["world_msg"] = smp.broadcast("from world rank 0", smp.CommGroup.WORLD)
    else:
        me["world_msg"] = smp.recv_from(0, smp.RankType.WORLD_RANK)
    if smp.mp_rank() == 0:
        me["mp_msg"] = smp.broadcast(f"stage 0 of replica {smp.dp_rank()}", smp.CommGroup.MP_GROUP)
    else:
        me["mp_msg"] = smp.recv_from(0, smp.RankType.MP_RANK)
    if smp.dp_rank() == 0:
        me["dp_msg"] = smp.broadcast(f"replica 0 of stage {smp.pp_rank()}", smp.CommGroup.DP_GROUP)
    else:
        me["dp_msg"] = smp.recv_from(0, smp.RankType.DP_RANK)
    smp.barrier()
    smp.barrier(smp.CommGroup.MP_GROUP)
    me["gather_world"] = smp.allgather(smp.rank())
    me["gather_mp"] = smp.allgather(smp.rank(), smp.CommGroup.MP_GROUP)
    me["gather_dp"] = smp.allgather(smp.rank(), smp.CommGroup.DP_GROUP)
    return me


@pytest.mark.parametrize("placement,mp,dp", [
    pytest.param("cluster", [[0, 1], [2, 3]], [[0, 2], [1, 3]], marks=pytest.mark.slow),  # 4 ranks: test_comm's getters
    pytest.param("spread", [[0, 2], [1, 3]], [[0, 1], [2, 3]], marks=pytest.mark.slow),
])
def test_rank_helpers_pp2_dp2(placement, mp, dp):
    results = run_ranks(_ranks, 4, placement, timeout=240)
    for r, me in enumerate(results):
        mine_mp = next(g for g in mp if r in g)
        mine_dp = next(g for g in dp if r in g)
        assert (me["rank"], me["size"], me["local_rank"], me["local_size"]) == (r, 4, r, 4)
        assert me["mp_group"] == mine_mp and me["dp_group"] == mine_dp
        assert me["pp_rank"] == me["mp_rank"] == mine_mp.index(r) and me["pp_size"] == me["mp_size"] == 2
        assert me["dp_rank"] == me["rdp_rank"] == mine_dp.index(r) and me["dp_size"] == 2
        assert me["world_msg"] == "from world rank 0"
        assert me["mp_msg"] == f"stage 0 of replica {me['dp_rank']}"
        assert me["dp_msg"] == f"replica 0 of stage {me['pp_rank']}"
        assert me["gather_world"] == [0, 1, 2, 3]
        assert me["gather_mp"] == mine_mp and me["gather_dp"] == mine_dp
