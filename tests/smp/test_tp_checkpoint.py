"""Checkpoints of a tensor-parallel run on spawned ranks (a tiny GPT-2: an uneven vocabulary, the fused ``c_attn``
split block by block, tied embedding and head): the full state dicts hold whole tensors under the model's own keys
and load under another tp degree (tp=2 -> tp=1 and back); partial checkpoints hold each tp rank's shards in files
named ``..._<pp_rank>_<tp_rank>``, resume bit for bit and are refused under another tp degree."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from smp.testing import run_ranks
from tests.smp.test_checkpoint import _error
from tests.smp.test_tp_training import VOCAB, build

AT = 2  # the straight run checkpoints after this many steps


def _setup(tp: int, extra: dict | None = None):
    """smp.init for ``tp`` (every tp rank reads the same batch), the tiny GPT-2 with Adam, and ``step(k)``."""
    import smp

    smp.init({"pipeline_parallel_degree": 1, "tensor_parallel_degree": tp, "ddp": True, "microbatches": 2,
              **({"prescaled_batch": True} if tp > 1 else {}), **(extra or {})})
    model = smp.DistributedModel(build("gpt2"))
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))

    @smp.step
    def train_step(model, x):
        loss = model(x, labels=x).loss
        model.backward(loss)
        return loss

    def step(k: int) -> list[float]:
        """Step ``k``; the loss of every replica."""
        ids = torch.randint(0, VOCAB, (4 * smp.rdp_size(), 8), generator=torch.Generator().manual_seed(100 + k))
        mine = ids[4 * smp.rdp_rank():4 * smp.rdp_rank() + 4]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = float(train_step(model, mine).reduce_mean())
        opt.step()
        opt.zero_grad()
        return smp.allgather(loss, smp.CommGroup.RDP_GROUP)
    return model, opt, step


def _straight(rank: int, world: int, tp: int, tmp: str, extra: dict | None = None) -> dict:
    """Train AT + 1 steps; after AT, save a partial and a full tagged checkpoint and SMP v1's smp.save files."""
    import smp

    model, opt, step = _setup(tp, extra)
    out: dict = {"losses": [step(k) for k in range(AT)]}
    full, full_opt = model.state_dict(), opt.state_dict()
    whole = build("gpt2").state_dict()
    out["full_keys"] = list(full) == list(whole)
    out["full_shapes"] = all(full[k].shape == whole[k].shape for k in whole)
    out["tied"] = full["transformer.wte.weight"] is full["lm_head.weight"]
    params = list(dict.fromkeys(build("gpt2").parameters()))
    out["opt_shapes"] = all(full_opt["state"][i]["exp_avg"].shape == p.shape for i, p in enumerate(params))
    out["local_shape"] = tuple(model.module.transformer.h[0].attn.c_attn.weight.shape)
    content = {"step": AT}
    smp.save_checkpoint(tmp, f"step{AT}", model=model, optimizer=opt, user_content=content)
    smp.save_checkpoint(tmp, "full.pt", partial=False, model=model, optimizer=opt, user_content=content)
    v1 = os.path.join(tmp, "v1")
    smp.save(model.local_state_dict(), v1 + ".model", partial=True)
    smp.save(opt.local_state_dict(), v1 + ".opt", partial=True)
    smp.barrier()
    out["tree"] = sorted(os.listdir(os.path.join(tmp, f"step{AT}_partial")))
    out["v1"] = sorted(f for f in os.listdir(tmp) if f.startswith("v1"))
    out["losses"].append(step(AT))
    return out


def _resumed(rank: int, world: int, tp: int, tmp: str, how: str, extra: dict | None = None) -> dict:
    """A fresh run that resumes before its first step (``how``: partial, full or v1) and trains step AT."""
    import smp

    model, opt, step = _setup(tp, extra)
    if how == "v1":
        v1 = os.path.join(tmp, "v1")
        model.load_state_dict(smp.load(v1 + ".model", partial=True))
        opt.load_state_dict(smp.load(v1 + ".opt", partial=True))
    else:
        assert smp.resume_from_checkpoint(tmp, tag=None if how == "partial" else "full.pt",
                                          partial=how == "partial") == {"step": AT}
    return {"loss": step(AT)}


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    """The straight tp=2 run and the folder of its checkpoints."""
    tmp = str(tmp_path_factory.mktemp("tp2"))
    return tmp, run_ranks(_straight, 2, 2, tmp, timeout=240)


def test_tp2_state_dicts_are_whole_and_partial_files_carry_the_tp_rank(tp2_run):
    _, got = tp2_run
    for r in got:
        assert r["full_keys"] and r["full_shapes"] and r["tied"] and r["opt_shapes"], r
        assert r["local_shape"] == (64, 96), r  # this rank held its shard: 4 of GPT-2's 8 heads of q, k and v
        assert r["losses"] == got[0]["losses"], r
    assert got[0]["tree"] == ["manifest.json", "model_0_0.pt", "model_0_1.pt", "optimizer_0_0.pt",
                              "optimizer_0_1.pt", "user_content.pt"], got[0]["tree"]
    assert got[0]["v1"] == ["v1.model.manifest.json", "v1.model_0_0", "v1.model_0_1", "v1.opt.manifest.json",
                            "v1.opt_0_0", "v1.opt_0_1"], got[0]["v1"]


def test_tp2_resumes_bit_identical_from_a_partial_checkpoint(tp2_run):
    tmp, straight = tp2_run
    for r in run_ranks(_resumed, 2, 2, tmp, "partial", timeout=240):
        assert r["loss"] == straight[0]["losses"][AT], (r, straight[0]["losses"])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["full", "v1"])
def test_tp2_resumes_bit_identical_from_full_and_v1_checkpoints(tp2_run, how):
    tmp, straight = tp2_run
    for r in run_ranks(_resumed, 2, 2, tmp, how, timeout=240):
        assert r["loss"] == straight[0]["losses"][AT], (how, r, straight[0]["losses"])


def _tp1(rank: int, world: int, tmp: str) -> dict:
    """tp=1: the tp=2 run's partial checkpoints are refused; its full checkpoint resumes; then a full checkpoint
    of this run (after step AT) for a tp=2 run to resume, and the loss of step AT + 1."""
    import smp

    model, opt, step = _setup(1)
    out = {"partial": _error(lambda: smp.resume_from_checkpoint(tmp)),
           "v1": _error(lambda: smp.load(os.path.join(tmp, "v1.model"), partial=True)),
           "dict": _error(lambda: model.load_state_dict(torch.load(os.path.join(tmp, f"step{AT}_partial",
                                                                                  "model_0_1.pt"))))}
    smp.resume_from_checkpoint(tmp, tag="full.pt", partial=False)
    out["loss"] = step(AT)
    smp.save_checkpoint(tmp, "tp1.pt", partial=False, model=model, optimizer=opt, user_content={"step": AT + 1})
    out["next"] = step(AT + 1)
    return out


def _from_tp1(rank: int, world: int, tmp: str) -> dict:
    import smp

    _, _, step = _setup(2)
    smp.resume_from_checkpoint(tmp, tag="tp1.pt", partial=False)
    return {"loss": step(AT + 1)}


@pytest.mark.slow
def test_full_checkpoints_load_across_tp_degrees(tp2_run):
    tmp, straight = tp2_run
    want = straight[0]["losses"][AT][0]
    (one,) = run_ranks(_tp1, 1, tmp, timeout=240)
    assert "tensor_parallel_degree=2" in one["partial"] and "this run has 1 x 1" in one["partial"], one["partial"]
    assert "CheckpointError" in one["v1"] and "tensor_parallel_degree=2" in one["v1"], one["v1"]
    assert "CheckpointError" in one["dict"] and "saved with tensor_parallel_degree=2, this run has " \
        "tensor_parallel_degree=1" in one["dict"], one["dict"]
    assert abs(one["loss"][0] - want) <= 1e-5 * abs(want), (one["loss"], want)  # tp=2 -> tp=1: the same model
    nxt = one["next"][0]
    for r in run_ranks(_from_tp1, 2, tmp, timeout=240):  # tp=1 -> tp=2
        assert abs(r["loss"][0] - nxt) <= 1e-5 * abs(nxt), (r, nxt)


@pytest.mark.slow
def test_tp2_rdp2_resumes_bit_identical_with_optimizer_state_sharded_over_the_replicas(tmp_path):
    """tp2 x rdp2 (4 ranks): replica 0 writes each tp rank's files; with shard_optimizer_state the state is
    sharded over each shard's replicas (the rdp group), trains like the replicated run, and every rank writes its
    part; both resume bit for bit from partial and full checkpoints."""
    runs = {}
    for name, extra in (("replicated", {}), ("sharded", {"shard_optimizer_state": True})):
        folder = str(tmp_path / name)
        straight = run_ranks(_straight, 4, 2, folder, extra, timeout=400)
        runs[name] = straight
        optimizer = [f"optimizer_0_{t}_{d}.pt" for t in (0, 1) for d in (0, 1)] if extra else \
            ["optimizer_0_0.pt", "optimizer_0_1.pt"]
        assert straight[0]["tree"] == sorted(["manifest.json", "model_0_0.pt", "model_0_1.pt", "user_content.pt",
                                              *optimizer]), straight[0]["tree"]
        for how in ("partial", "full"):
            for r, s in zip(run_ranks(_resumed, 4, 2, folder, how, extra, timeout=400), straight):
                assert r["loss"] == s["losses"][AT], (name, how, r, s["losses"])
    for a, b in zip(runs["replicated"], runs["sharded"]):
        flat = [[x for replicas in r["losses"] for x in replicas] for r in (a, b)]
        assert flat[0] == pytest.approx(flat[1], rel=1e-6), flat


@pytest.mark.slow
def test_pp2_tp2_checkpoints_resume_bit_identical_and_load_into_one_process(tmp_path):
    """pp2 x tp2 (4 ranks): each pipeline and tp rank writes its file, partial and full checkpoints resume bit for
    bit, and the full one loads into a single process (pp=1, tp=1)."""
    pp2 = {"pipeline_parallel_degree": 2}
    straight = run_ranks(_straight, 4, 2, str(tmp_path), pp2, timeout=400)
    for r in straight:
        assert r["full_keys"] and r["full_shapes"] and r["tied"] and r["opt_shapes"], r
    assert [f for f in straight[0]["tree"] if f.startswith("model")] == [
        f"model_{p}_{t}.pt" for p in (0, 1) for t in (0, 1)], straight[0]["tree"]
    for how in ("partial", "full"):
        for r, s in zip(run_ranks(_resumed, 4, 2, str(tmp_path), how, pp2, timeout=400), straight):
            assert r["loss"] == s["losses"][AT], (how, r, s["losses"])
    (one,) = run_ranks(_tp1, 1, str(tmp_path), timeout=240)
    assert "pipeline_parallel_degree=2 x tensor_parallel_degree=2" in one["partial"], one["partial"]
    want = straight[0]["losses"][AT][0]
    assert abs(one["loss"][0] - want) <= 1e-5 * abs(want), (one["loss"], want)
