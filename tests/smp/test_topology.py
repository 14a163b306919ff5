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
    t = Topology(8, 2, placement=placement)
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


# --- the grid pp x tp x rdp (tensor parallelism carved out of the data-parallel ranks) ---------------------------

# 8 ranks, pp = tp = rdp = 2. Each placement's right-most letter varies fastest: the groups along the axis of stride
# 1 are pairs of neighbours (A), of stride 2 pairs two apart (B), of stride 4 pairs four apart (C); two axes make
# quads.
_A, _B, _C = [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]]
_Q12, _Q14, _Q24 = [[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 1, 4, 5], [2, 3, 6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]
GRIDS = {  # placement: pipelines (P), tp (T), rdp (D), dp (D, T), mp (P, T)
    "DPT": (_B, _A, _C, _Q14, _Q12),
    "DTP": (_A, _B, _C, _Q24, _Q12),
    "PDT": (_C, _A, _B, _Q12, _Q14),
    "PTD": (_C, _B, _A, _Q12, _Q24),
    "TDP": (_A, _C, _B, _Q24, _Q14),
    "TPD": (_B, _C, _A, _Q14, _Q24),
}
GRIDS["cluster"], GRIDS["spread"] = GRIDS["DPT"], GRIDS["TPD"]


@pytest.mark.parametrize("placement", sorted(GRIDS))
def test_grid_pp2_tp2_rdp2(placement):
    pipes, tp, rdp, dp, mp = GRIDS[placement]
    t = Topology(8, 2, 2, placement=placement)
    assert (t.pp, t.tp, t.rdp, t.dp, t.mp) == (2, 2, 2, 4, 4)
    assert (t.pipelines(), t.tp_groups(), t.rdp_groups(), t.dp_groups(), t.mp_groups()) == (pipes, tp, rdp, dp, mp)
    assert t.pp_groups() == pipes
    for r in range(8):
        mine = {name: next(g for g in groups if r in g) for name, groups in
                zip(("P", "T", "D", "DT", "PT"), (pipes, tp, rdp, dp, mp))}
        assert (t.pp_rank(r), t.tp_rank(r), t.rdp_rank(r)) == (mine["P"].index(r), mine["T"].index(r),
                                                                mine["D"].index(r))
        assert (t.dp_rank(r), t.mp_rank(r)) == (mine["DT"].index(r), mine["PT"].index(r))
        assert t.rank_at(t.pp_rank(r), t.tp_rank(r), t.rdp_rank(r)) == r
        assert all(t.group_of(r, axes) == g for axes, g in mine.items())


def test_grid_tables_of_smp_v1_docs():
    """SMP v1's placement table ("DPT", "PTD": rank -> rdp_rank, pp_rank, tp_rank), and the table of AWS's
    "Ranking Mechanism" page (placement "DTP": pp_rank, tp_rank, rdp_rank, dp_rank, mp_rank)."""
    dpt = Topology(8, 2, 2, placement="DPT")
    assert [(dpt.rdp_rank(r), dpt.pp_rank(r), dpt.tp_rank(r)) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    ptd = Topology(8, 2, 2, placement="PTD")
    assert [(ptd.rdp_rank(r), ptd.pp_rank(r), ptd.tp_rank(r)) for r in range(8)] == [
        (0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1), (0, 1, 0), (1, 1, 0), (0, 1, 1), (1, 1, 1)]
    dtp = Topology(8, 2, 2, placement="DTP")
    assert [(dtp.pp_rank(r), dtp.tp_rank(r), dtp.rdp_rank(r), dtp.dp_rank(r), dtp.mp_rank(r)) for r in range(8)] == [
        (0, 0, 0, 0, 0), (1, 0, 0, 0, 1), (0, 1, 0, 1, 2), (1, 1, 0, 1, 3),
        (0, 0, 1, 2, 0), (1, 0, 1, 2, 1), (0, 1, 1, 3, 2), (1, 1, 1, 3, 3)]
    # under "cluster" mp_rank = pp_rank * tp + tp_rank and dp_rank = rdp_rank * tp + tp_rank
    assert all(dpt.mp_rank(r) == dpt.pp_rank(r) * 2 + dpt.tp_rank(r) for r in range(8))
    assert all(dpt.dp_rank(r) == dpt.rdp_rank(r) * 2 + dpt.tp_rank(r) for r in range(8))


def test_grid_without_tensor_parallelism_is_the_old_one():
    for placement in ("cluster", "spread", "DPT", "TPD", "PDT"):
        t = Topology(12, 3, placement=placement)
        assert t.mp_groups() == t.pipelines() and t.dp_groups() == t.rdp_groups() and t.dp == t.rdp == 4
        assert all(t.mp_rank(r) == t.pp_rank(r) and t.dp_rank(r) == t.rdp_rank(r) and t.tp_rank(r) == 0
                   for r in range(12))
        assert t.tp_groups() == [[r] for r in range(12)]


@pytest.mark.parametrize("args,kwargs,needle", [
    ((6, 2, 2), {}, "6 processes cannot form a grid of pipeline_parallel_degree=2 x tensor_parallel_degree=2: launch "
                    "a multiple of pipeline_parallel_degree x tensor_parallel_degree = 4 processes"),
    ((8, 2, 2), {"placement": "DPX"}, "placement_strategy='DPX' is not valid: 'cluster' (= 'DPT'), 'spread'"),
    ((8, 2, 2), {"placement": "DDPT"}, "placement_strategy='DDPT' is not valid"),
    ((8, 2, 2), {"placement": "dpt"}, "placement_strategy='dpt' is not valid"),
    ((8, 2, "spread"), {}, "tp='spread' is not valid: a positive integer; pass placement by keyword"),
    ((8, 0), {}, "pp=0 is not valid"),
])
def test_grid_errors_name_the_numbers(args, kwargs, needle):
    with pytest.raises(ValueError) as err:
        Topology(*args, **kwargs)
    assert needle in str(err.value)
    with pytest.raises(ValueError, match="rank 8 is not in this grid of 8 ranks: use 0 .. 7"):
        Topology(8, 2, 2).pp_rank(8)


def _tp_ranks(rank: int, world: int, pp: int, placement: str):
    import torch
    import torch.distributed as dist

    import smp
    from smp.engine.tp_batch import regroup_batch

    smp.init({"pipeline_parallel_degree": pp, "tensor_parallel_degree": 2, "ddp": True,
              "placement_strategy": placement})
    me = {"ranks": (smp.pp_rank(), smp.tp_rank(), smp.rdp_rank(), smp.dp_rank(), smp.mp_rank()),
          "sizes": (smp.pp_size(), smp.tp_size(), smp.rdp_size(), smp.dp_size(), smp.mp_size()),
          "groups": (smp.get_pp_group(), smp.get_tp_group(), smp.get_rdp_group(), smp.get_dp_group(),
                     smp.get_mp_group())}
    pgs = (smp.get_pp_process_group(), smp.get_tp_process_group(), smp.get_rdp_process_group(),
           smp.get_dp_process_group(), smp.get_mp_process_group())
    sums = []
    for pg in pgs:  # each process group holds the ranks its list says
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=pg)
        sums.append(float(t))
    me["sums"], me["pg_sizes"] = sums, [dist.get_world_size(pg) for pg in pgs]
    if smp.tp_rank() == 0:
        me["tp_msg"] = smp.broadcast(f"tp_rank 0 of {smp.get_tp_group()}", smp.TP_GROUP)
    else:
        me["tp_msg"] = smp.recv_from(0, smp.RankType.TP_RANK)
    smp.barrier(smp.TP_GROUP)
    me["gather_tp"] = smp.allgather(smp.rank(), smp.CommGroup.TP_GROUP)
    me["gather_rdp"] = smp.allgather(smp.rank(), smp.RDP_GROUP)
    me["gather_mp"] = smp.allgather(smp.rank(), smp.MP_GROUP)
    # each tp rank reads its own batch (rank + 1 rows); the group runs on their concatenation, in tp_rank order
    (x,), kw = regroup_batch((torch.full((rank + 1, 2), float(rank)),), {"n": 3}, smp.get_tp_process_group(),
                             smp.tp_size(), prescaled=False)
    me["regrouped"] = (x[:, 0].tolist(), kw)
    return me


def _check_tp_ranks(results, pipes, tp, rdp, dp, mp):
    for r, me in enumerate(results):
        mine = [next(g for g in groups if r in g) for groups in (pipes, tp, rdp, dp, mp)]
        assert me["groups"] == tuple(mine), (r, me)
        assert me["ranks"] == tuple(g.index(r) for g in mine), (r, me)
        assert me["sizes"] == tuple(len(g) for g in mine), (r, me)
        assert me["pg_sizes"] == [len(g) for g in mine] and me["sums"] == [float(sum(g)) for g in mine], (r, me)
        assert me["tp_msg"] == f"tp_rank 0 of {mine[1]}"
        assert (me["gather_tp"], me["gather_rdp"], me["gather_mp"]) == (mine[1], mine[2], mine[4])
        assert me["regrouped"] == ([float(q) for q in mine[1] for _ in range(q + 1)], {"n": 3}), (r, me)


def test_rank_helpers_tp2():
    """2 ranks, tp = 2, pp = 1: the tensor-parallel group is the model-parallel and the data-parallel group."""
    results = run_ranks(_tp_ranks, 2, 1, "cluster", timeout=120)
    _check_tp_ranks(results, pipes=[[0], [1]], tp=[[0, 1]], rdp=[[0], [1]], dp=[[0, 1]], mp=[[0, 1]])


@pytest.mark.slow
def test_rank_helpers_pp2_tp2():
    """4 ranks, "cluster": a tp group on neighbours, a pipeline's stages two apart, one replica."""
    results = run_ranks(_tp_ranks, 4, 2, "cluster", timeout=180)
    _check_tp_ranks(results, pipes=[[0, 2], [1, 3]], tp=[[0, 1], [2, 3]], rdp=[[0], [1], [2], [3]],
                    dp=[[0, 1], [2, 3]], mp=[[0, 1, 2, 3]])


@pytest.mark.slow
def test_rank_helpers_tp2_rdp2_spread():
    """4 ranks, "spread" (= "TPD"): the replicas of a shard on neighbours, a tp group two apart."""
    results = run_ranks(_tp_ranks, 4, 1, "spread", timeout=180)
    _check_tp_ranks(results, pipes=[[0], [1], [2], [3]], tp=[[0, 2], [1, 3]], rdp=[[0, 1], [2, 3]],
                    dp=[[0, 1, 2, 3]], mp=[[0, 2], [1, 3]])


def test_init_without_enough_processes_names_both_degrees(monkeypatch):
    import torch.distributed as dist

    from smp.runtime import state

    if dist.is_initialized() or state.is_initialized():
        pytest.skip("this process already has a process group")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match=r"pipeline_parallel_degree=1 x tensor_parallel_degree=2 needs 2 processes: "
                                           r"launch with `smp launch -n 2 script.py`"):
        state.init({"pipeline_parallel_degree": 1, "tensor_parallel_degree": 2, "ddp": True})
    assert not dist.is_initialized() and not state.is_initialized()


def test_ep_groups_are_consecutive_replicas_of_a_stage():
    t = Topology(8, 2)  # 4 replicas of each of 2 stages
    assert t.ep_grid(2) == [[g[:2], g[2:]] for g in t.rdp_groups()]  # two ep groups per stage, experts split in each
    with pytest.raises(ValueError, match=r"expert_parallel_degree=3 must divide the 4 data-parallel replicas"):
        t.ep_grid(3)


def test_cp_groups_are_consecutive_replicas_of_a_stage():
    t = Topology(8, 1, 2)  # 4 replicas of each tp rank
    assert t.cp_grid(2) == [[g[:2], g[2:]] for g in t.rdp_groups()]
    with pytest.raises(ValueError, match=r"context_parallel_degree=3 must divide the 4 data-parallel replicas of each "
                                         r"stage and tensor-parallel shard"):
        t.cp_grid(3)


def test_sdp_grid_rows_replicate_and_columns_shard():
    t = Topology(8, 2)  # 4 replicas of each of 2 stages
    assert t.sdp_grid(4) == [[g] for g in t.rdp_groups()] and len(t.rdp_groups()[0]) == 4  # one sharding group
    assert t.sdp_grid(2) == [[g[:2], g[2:]] for g in t.rdp_groups()]  # hybrid: two sharding groups per stage
    with pytest.raises(ValueError, match=r"sharded_data_parallel_degree=3 must divide the 4 data-parallel replicas of "
                                         r"each stage"):
        t.sdp_grid(3)
