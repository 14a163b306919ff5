"""``prescaled_batch`` (:mod:`smp.engine.tp_batch`): without it each tp rank reads its own batch and the group runs
on their concatenation in tp_rank order; with it (or at tp = 1) nothing moves; arguments that cannot be
concatenated are an error on every rank of the group, which stays usable."""
from __future__ import annotations

import pytest
import torch

from smp.engine.tp_batch import regroup_batch
from smp.testing import run_ranks


def test_prescaled_or_tp1_returns_the_arguments_untouched():
    args, kwargs = (torch.ones(2, 3), 5), {"mask": torch.zeros(2, dtype=torch.bool)}
    for tp_size, prescaled in ((2, True), (1, False), (1, True)):  # no process group needed: nothing is sent
        got_args, got_kwargs = regroup_batch(args, kwargs, None, tp_size, prescaled)
        assert got_args is args and got_kwargs is kwargs


def _errors(rank: int, case: str):
    x = torch.zeros(2, 3)
    if case == "scalar":
        return (x, 3 + rank), {}
    if case == "dtype":
        return (x.double() if rank else x,), {}
    if case == "shape":
        return (torch.zeros(2, 3 + rank),), {}
    if case == "structure":
        return (x,), ({"extra": 1} if rank else {})
    if case == "grad":
        return (x.requires_grad_(rank == 1),), {}
    return (torch.zeros(2, 3).to_sparse() if rank else x,), {}


ERRORS = {
    "scalar": "step argument args[1] on tp_rank 1 is 4, on tp_rank 0 3: arguments that are not batched tensors must "
              "be equal",
    "dtype": "step argument args[0] on tp_rank 1 is a torch.float64 tensor, on tp_rank 0 a torch.float32 tensor",
    "shape": "step argument args[0] on tp_rank 1 has shape [2, 4], on tp_rank 0 [2, 3]: tensors are concatenated "
             "along dim 0",
    "structure": "the step's arguments have another structure on tp_rank 1",
    "grad": "step argument args[0] on tp_rank 1 requires grad",
    "sparse": "step argument args[0] on tp_rank 1 is a torch.sparse_coo tensor",
}


def _regroup(rank: int, world: int):
    from smp.engine.tp_batch import BatchMismatchError

    torch.manual_seed(rank)
    own = torch.nn.Linear(2, 2)  # each rank's own object (a model): never sent, never compared
    x = torch.full((rank + 2, 3), float(rank))  # uneven batches: 2 rows on tp_rank 0, 3 on tp_rank 1
    mask = torch.arange(rank + 2) % 2 == rank
    args, kwargs = regroup_batch((own, x, torch.tensor(0.5)), {"mask": mask, "cfg": {"scale": 2.0, "name": "a"},
                                                               "labels": (torch.arange(rank + 2) + 10 * rank,)},
                                 None, world, prescaled=False)
    out = {"own_is_mine": args[0] is own, "x": args[1].tolist(), "scalar": args[2].item(),
           "mask": (kwargs["mask"].dtype, kwargs["mask"].tolist()), "cfg": kwargs["cfg"],
           "labels": kwargs["labels"][0].tolist()}
    unchanged = regroup_batch((x,), {}, None, world, prescaled=True)  # the tp group read one batch already
    out["prescaled"] = unchanged[0][0] is x
    out["errors"] = {}
    for case in ERRORS:
        try:
            regroup_batch(*_errors(rank, case), None, world, prescaled=False)
        except BatchMismatchError as exc:
            out["errors"][case] = str(exc)
    try:
        regroup_batch((x,), {}, None, 4, prescaled=False)
    except ValueError as exc:
        out["errors"]["size"] = str(exc)
    out["after"] = regroup_batch((torch.tensor([rank]),), {}, None, world, prescaled=False)[0][0].tolist()
    return out


def test_regroup_concatenates_the_tp_groups_batches_in_tp_rank_order():
    results = run_ranks(_regroup, 2, timeout=120)
    for r in results:
        assert r["own_is_mine"] and r["prescaled"] and r["scalar"] == 0.5, r
        assert r["x"] == [[0.0] * 3] * 2 + [[1.0] * 3] * 3, r
        assert r["mask"] == (torch.bool, [True, False, False, True, False]), r
        assert r["cfg"] == {"scale": 2.0, "name": "a"} and r["labels"] == [0, 1, 10, 11, 12], r
        assert r["after"] == [0, 1], r  # the group is still in step after the errors
        assert set(r["errors"]) == set(ERRORS) | {"size"}, r["errors"]
        for case, needle in ERRORS.items():
            assert needle in r["errors"][case], (case, r["errors"][case])
        assert "the group has 2 ranks, tp_size=4" in r["errors"]["size"]


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_tp_size(bad):
    with pytest.raises(ValueError, match=f"tp_size={bad} is not a positive integer"):
        regroup_batch((), {}, None, bad, prescaled=False)


def _one_batch(rank: int, world: int, same: bool) -> dict:
    """A tiny Llama on tp2 with ``prescaled_batch`` True, fed one batch (``same``) or one per tp rank; the
    single-process loss and gradients of rank 0's batch. With ``same`` the user ran the plain model on the batch
    before wrapping it and keeps that output, so a live autograd graph holds the weights tensor parallelism shards."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    import smp
    from tests.smp.features import shard_grad_error

    smp.init({"pipeline_parallel_degree": 1, "tensor_parallel_degree": 2, "ddp": True, "microbatches": 1,
              "prescaled_batch": True})
    torch.manual_seed(0)
    plain = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                         use_cache=False))
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1 if same else 1 + smp.tp_rank()))
    reference = copy.deepcopy(plain)
    want = reference(ids, labels=ids).loss
    want.backward()
    checked = plain(ids, labels=ids).loss if same else None
    model = smp.DistributedModel(plain)

    @smp.step
    def train_step(model, x):
        loss = model(x, labels=x).loss
        model.backward(loss)
        return loss

    try:
        loss = float(train_step(model, ids).reduce_mean())
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    worst, split = shard_grad_error(model, {n: p.grad for n, p in reference.named_parameters()})
    return {"loss": loss, "want": float(want), "worst": worst, "split": split, "checked": checked is not None}


def test_prescaled_batch_refuses_different_batches_on_a_tp_group_and_trains_exactly_on_one():
    for r in run_ranks(_one_batch, 2, False, timeout=120):
        assert r["error"].startswith(
            "BatchDiffersError: prescaled_batch is True, so the ranks of a tensor-parallel group must pass one batch, "
            "but rank(s) 1 (tp_rank 1) passed another batch than rank 0 (tp_rank 0): rank 1's step argument args[1] "
            "differs from rank 0's (sum "), r
        assert "Pass the same batch on every rank of a tensor-parallel group when prescaled_batch is True" in r["error"]
        assert "or set prescaled_batch False" in r["error"]
    for r in run_ranks(_one_batch, 2, True, timeout=120):
        assert "error" not in r, r
        assert abs(r["loss"] - r["want"]) < 1e-5 and r["worst"] < 1e-5 and r["split"] > 0, r
