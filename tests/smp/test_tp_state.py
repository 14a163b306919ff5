"""State dicts across tensor-parallel degrees, in one process: shards put back together into whole tensors
(uneven shards, fused weights split block by block, tied keys), whole tensors cut to a rank's shards, optimizer
state likewise, and partial state refused under another degree or tp rank."""
from __future__ import annotations

import pytest
import torch

from partitioner.tp.shard_program import shard_ranges, shard_tensor, unshard_tensor
from partitioner.tp.sharding import Shard
from smp.checkpoint.commit import CheckpointError
from smp.checkpoint.tp_state import (
    ShardedParam,
    TPLayout,
    check_partial,
    cut_model_state,
    cut_optimizer_state,
    whole_model_state,
    whole_optimizer_state,
)

CASES = [  # (shape, shard, tp): even, uneven (a vocabulary of 101), along dim 1, GPT-2's fused q|k|v, uneven blocks
    ((8, 4), Shard(0, 8), 2), ((101, 4), Shard(0, 101), 2), ((4, 7), Shard(1, 7), 3), ((4, 12), Shard(1, 12, 3), 2),
    ((15, 2), Shard(0, 15, 3), 2), ((12,), Shard(0, 12, 3), 2),
]


@pytest.mark.parametrize("shape,shard,tp", CASES)
def test_unshard_inverts_shard_and_ranges_name_the_slices(shape, shard, tp):
    whole = torch.randn(shape)
    pieces = [shard_tensor(whole, shard, tp, r) for r in range(tp)]
    assert torch.equal(unshard_tensor(pieces, shard, tp), whole)
    for r, piece in enumerate(pieces):
        ranges = shard_ranges(shard, tp, r)
        assert len(ranges) == shard.groups
        assert torch.equal(torch.cat([whole.narrow(shard.dim, a, b - a) for a, b in ranges], shard.dim), piece)


def test_unshard_names_shards_that_do_not_fit():
    pieces = [torch.zeros(3, 4), torch.zeros(3, 4)]
    with pytest.raises(ValueError, match=r"lengths \[3, 3\] along dim 0 .* length 7 .* expected lengths \[4, 3\]"):
        unshard_tensor(pieces, Shard(0, 7), 2)
    with pytest.raises(ValueError, match="all 2 tp ranks, got 1"):
        unshard_tensor(pieces[:1], Shard(0, 7), 2)


def _parts(whole: dict[str, torch.Tensor], shards: dict[str, Shard], tp: int) -> list[tuple[int, dict]]:
    """Each tp rank's local state as a tp run holds it: sharded keys cut, tied keys sharing one tensor."""
    parts = []
    for r in range(tp):
        made: dict[int, torch.Tensor] = {}
        part = {}
        for k, v in whole.items():
            if id(v) not in made:
                made[id(v)] = shard_tensor(v, shards[k], tp, r) if k in shards else v.clone()
            part[k] = made[id(v)]
        parts.append((r, part))
    return parts


def test_model_state_gathers_and_cuts_back():
    embed = torch.randn(101, 8)
    whole = {"wte.weight": embed, "lm_head.weight": embed, "attn.c_attn.weight": torch.randn(8, 24),
             "ln.weight": torch.randn(8)}
    shards = {"wte.weight": Shard(0, 101), "lm_head.weight": Shard(0, 101), "attn.c_attn.weight": Shard(1, 24, 3)}
    parts = _parts(whole, shards, 2)
    got = whole_model_state(parts, TPLayout(2, 0, shards))
    assert got.keys() == whole.keys() and all(torch.equal(got[k], whole[k]) for k in whole)
    assert got["wte.weight"] is got["lm_head.weight"]  # tied keys stay one tensor
    for r, part in parts:
        cut = cut_model_state(got, TPLayout(2, r, shards))
        assert all(torch.equal(cut[k], part[k]) for k in whole)
        assert cut["wte.weight"] is cut["lm_head.weight"]
        assert cut_model_state(part, TPLayout(2, r, shards))["wte.weight"] is part["wte.weight"]  # already a shard
    with pytest.raises(CheckpointError, match=r"wte.weight has length 60 along dim 0, neither the whole 101 nor tp "
                                              r"rank 1's shard of 50"):
        cut_model_state({"wte.weight": torch.zeros(60, 8)}, TPLayout(2, 1, shards))
    with pytest.raises(CheckpointError, match=r"the shards of tp ranks \[0\] arrived"):
        whole_model_state(parts[:1], TPLayout(2, 0, shards))
    assert cut_model_state(whole, TPLayout())["wte.weight"] is embed  # tp = 1: nothing to cut


def test_optimizer_state_gathers_and_cuts_back():
    shard = Shard(1, 24, 3)
    whole = {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(8, 24), "exp_avg_sq": torch.rand(8, 24)},
             1: {"step": torch.tensor(3.0), "exp_avg": torch.randn(8)}}
    parts = [(r, {0: {k: (shard_tensor(v, shard, 2, r) if v.dim() else v) for k, v in whole[0].items()},
                  1: whole[1]}) for r in range(2)]
    params = {0: ShardedParam(shard, (8, 12))}
    got = whole_optimizer_state(parts, params, 2)
    for i in whole:
        assert got[i].keys() == whole[i].keys() and all(torch.equal(got[i][k], whole[i][k]) for k in whole[i])
    for r, part in parts:
        cut = cut_optimizer_state(got, params, TPLayout(2, r))
        assert all(torch.equal(cut[i][k], part[i][k]) for i in whole for k in whole[i])
        assert cut_optimizer_state(part, params, TPLayout(2, r))[0]["exp_avg"] is part[0]["exp_avg"]


def test_partial_state_loads_only_into_its_degree_and_tp_rank():
    check_partial(2, 1, TPLayout(2, 1), "x")
    with pytest.raises(CheckpointError, match=r"x was saved with tensor_parallel_degree=2, this run has "
                                              r"tensor_parallel_degree=1: .* full checkpoint"):
        check_partial(2, 0, TPLayout(1, 0), "x")
    with pytest.raises(CheckpointError, match=r"holds the shards of tp rank 0, but this is tp rank 1"):
        check_partial(2, 0, TPLayout(2, 1), "x")
