"""The tensor-parallel ops on real ranks: the vocabulary-parallel cross-entropy equals ``F.cross_entropy`` on
the whole logits (uneven vocabularies too) while moving O(tokens) bytes, and dropout follows Megatron's rule."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from partitioner.tp.collectives import TPComm, UnboundGroupError, shard_range, tp_dropout, vocab_cross_entropy
from smp.testing import run_ranks


class _Collectives(TorchDispatchMode):
    """Records the element count of every functional collective issued (DTensor's and funcol's)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and args and isinstance(args[0], torch.Tensor) \
                and "wait" not in func.__name__:
            self.sizes.append(args[0].numel())
        return func(*args, **(kwargs or {}))


def _cross_entropy(rank: int, world: int, vocab: int) -> dict:
    import torch.distributed as dist
    tokens = 12
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(tokens, vocab, generator=gen)
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    target[0] = -100  # ignored, as Hugging Face pads labels
    whole = logits.clone().requires_grad_()
    want = F.cross_entropy(whole, target)
    want.backward()
    a, b = shard_range(vocab, world, rank)
    mine = logits[:, a:b].clone().requires_grad_()
    comm = TPComm(world, rank)
    comm.bind(dist.group.WORLD)
    with _Collectives() as seen:
        got = vocab_cross_entropy(mine, target, a, 1, -100, comm)
    got.backward()
    err = float((mine.grad - whole.grad[:, a:b]).abs().max())
    return {"loss": float(got.detach()), "want": float(want), "grad": err,
            "moved": max(seen.sizes), "total": sum(seen.sizes)}


@pytest.mark.parametrize("vocab", [100, 101])
def test_vocab_parallel_cross_entropy_equals_the_whole_one_and_moves_per_token_statistics(vocab):
    for r in run_ranks(_cross_entropy, 2, vocab, timeout=120):
        assert abs(r["loss"] - r["want"]) <= 1e-6 * abs(r["want"]), r
        assert r["grad"] < 1e-6, r
        # Per token: the maximum, the sum of exponentials and the target's logit; never the 12 x vocab logits.
        assert r["moved"] <= 12 and r["total"] <= 6 * 12, r


def _dropout(rank: int, world: int) -> dict:
    import torch.distributed as dist
    comm = TPComm(world, rank)
    comm.bind(dist.group.WORLD, seed=7)
    x = torch.ones(1000)
    state = torch.get_rng_state()
    whole = tp_dropout(x, 0.5, True, False, comm)
    shard = tp_dropout(x, 0.5, True, True, comm)
    return {"whole": whole, "shard": shard, "untouched": torch.equal(state, torch.get_rng_state())}


def test_dropout_masks_agree_on_whole_activations_and_differ_on_shards():
    a, b = run_ranks(_dropout, 2, timeout=120)
    assert torch.equal(a["whole"], b["whole"])
    assert not torch.equal(a["shard"], b["shard"])
    assert set(a["whole"].unique().tolist()) == {0.0, 2.0}
    assert a["untouched"] and b["untouched"]  # the user's global stream is not consumed


def test_an_unbound_group_is_a_clear_error():
    with pytest.raises(UnboundGroupError, match="without its process group"):
        vocab_cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), 0, 1, -100, TPComm(2, 0))


def test_shard_range_is_torch_chunks_layout():
    assert [shard_range(101, 2, r) for r in range(2)] == [(0, 51), (51, 101)]
    assert [shard_range(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    with pytest.raises(ValueError, match="tp rank 2 is outside"):
        shard_range(8, 2, 2)
