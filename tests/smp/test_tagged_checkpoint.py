"""``smp.save_checkpoint`` / ``smp.resume_from_checkpoint`` on spawned ranks: the tag folders and the
``newest`` file, keeping the last N, a save that a rank fails commits nothing and leaves the older checkpoints
intact, corrupt files are named, full checkpoints are plain state dicts; and a run resumed in new processes
before its first step reproduces the uninterrupted run's losses bit for bit (pp=2 and pp=2 x dp=2, partial
and full checkpoints, and SMP v1's smp.save files)."""
from __future__ import annotations

import os

import pytest
import torch

from smp.testing import run_ranks
from tests.smp.scripts import _shard
from tests.smp.test_checkpoint import CFG, Tied, _error, damage, local_params, same, tied_training


def _tree(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files)


def _opt_state(opt) -> dict[int, torch.Tensor]:
    return {k: v["momentum_buffer"].clone() for k, v in opt.local_state_dict()["state"].items()}


def _tagged(rank: int, world: int, tmp: str):
    import smp
    import smp.checkpoint.tagged as tagged

    model, opt, step = tied_training(CFG)
    out: dict = {}
    params, momenta = {}, {}
    if rank == 0:  # what a save cut off by a crash leaves: removed by the next save
        os.makedirs(os.path.join(tmp, ".step9_partial.staging"))
        os.makedirs(os.path.join(tmp, ".step8_partial.old"))
    smp.barrier()
    for k in range(3):
        step(k)
        smp.save_checkpoint(tmp, f"step{k}", model=model, optimizer=opt, user_content={"step": k},
                            num_kept_partial_checkpoints=2)
        params[k], momenta[k] = local_params(model), _opt_state(opt)
    out["tree"] = _tree(tmp)
    with open(os.path.join(tmp, "newest")) as fh:
        out["newest"] = fh.read()

    # Rank 1 runs out of disk halfway through its file, in a save under a new tag and in one over the newest.
    step(3)
    write_file = tagged.write_file

    def disk_full(obj, path, **kwargs):
        with open(path, "wb") as fh:
            fh.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")
    if rank == 1:
        tagged.write_file = disk_full
    out["fail_new"] = _error(lambda: smp.save_checkpoint(tmp, "step3", model=model, optimizer=opt))
    out["fail_over"] = _error(lambda: smp.save_checkpoint(tmp, "step2", model=model, optimizer=opt))
    tagged.write_file = write_file
    smp.barrier()
    out["tree_after_failure"] = _tree(tmp)
    out["hidden_after_failure"] = sorted(e for e in os.listdir(tmp) if e.startswith("."))

    # The newest committed checkpoint is step2, intact; step3 was never committed.
    out["user_content"] = smp.resume_from_checkpoint(tmp)
    out["restored"] = same(local_params(model), params[2]) and same(_opt_state(opt), momenta[2])
    out["uncommitted"] = _error(lambda: smp.resume_from_checkpoint(tmp, tag="step3"))
    out["older"] = smp.resume_from_checkpoint(tmp, tag="step1") == {"step": 1} and same(local_params(model), params[1])

    # A full checkpoint: gathered, written by rank 0, a plain state dict with its tied weights stored once.
    smp.save_checkpoint(tmp, "full.pt", partial=False, model=model, optimizer=opt, user_content={"full": True})
    at_full = local_params(model), _opt_state(opt)
    if rank == 0:
        sd = torch.load(os.path.join(tmp, "full.pt"))
        out["plain_load"] = str(Tied().load_state_dict(sd))
        out["tied_in_file"] = sd["embed.weight"].data_ptr() == sd["head.weight"].data_ptr()
        out["full_files"] = sorted(f for f in os.listdir(tmp) if "full" in f)
    step(4)
    out["full_user_content"] = smp.resume_from_checkpoint(tmp, tag="full.pt", partial=False)
    out["full_restored"] = same(local_params(model), at_full[0]) and same(_opt_state(opt), at_full[1])
    out["no_tag"] = _error(lambda: smp.resume_from_checkpoint(tmp, partial=False))

    # Corruption, last (from here on the ranks fail independently): rank 1's file of step2 gets a flipped
    # byte, rank 0's file of step1 is cut short.
    smp.barrier()
    if rank == 0:
        damage(os.path.join(tmp, "step2_partial", "model_1.pt"), truncate=False)
        damage(os.path.join(tmp, "step1_partial", "model_0.pt"), truncate=True)
    smp.barrier()
    out["flipped"] = _error(lambda: smp.resume_from_checkpoint(tmp, tag="step2"))
    out["cut"] = _error(lambda: smp.resume_from_checkpoint(tmp, tag="step1"))
    return out


def test_save_and_resume_tagged_pp2(tmp_path):
    r0, r1 = run_ranks(_tagged, 2, str(tmp_path), timeout=300)
    files = ["manifest.json", "model_0.pt", "model_1.pt", "optimizer_0.pt", "optimizer_1.pt", "user_content.pt"]
    want = ["newest"] + [f"step{k}_partial/{f}" for k in (1, 2) for f in files]
    assert r0["tree"] == want, r0["tree"]  # num_kept_partial_checkpoints=2 deleted step0
    assert r0["newest"] == "step1_partial\nstep2_partial\n", r0["newest"]  # SMP's newest file
    for r in (r0, r1):
        for key in ("fail_new", "fail_over"):
            assert "CheckpointError" in r[key] and "rank 1: OSError" in r[key] and "No space left" in r[key], r[key]
        assert r["tree_after_failure"] == want and r["hidden_after_failure"] == [], r  # nothing new, nothing left over
        assert r["user_content"] == {"step": 2} and r["restored"], r
        assert "no committed partial checkpoint 'step3'" in r["uncommitted"], r["uncommitted"]
        assert r["older"]
        assert r["full_user_content"] == {"full": True} and r["full_restored"], r
        assert "needs its tag" in r["no_tag"] or "loaded by its tag" in r["no_tag"], r["no_tag"]
    assert r0["plain_load"] == "<All keys matched successfully>" and r0["tied_in_file"], r0
    assert r0["full_files"] == ["full.pt", "full.pt.manifest.json", "optimizer_full.pt", "user_content_full.pt"]
    assert r0["flipped"] == "no error" and "truncated or corrupt checkpoint" in r1["flipped"], (r0, r1)
    assert "step2_partial/model_1.pt" in r1["flipped"], r1["flipped"]
    assert r1["cut"] == "no error" and "truncated or corrupt checkpoint" in r0["cut"], (r0, r1)
    assert "step1_partial/model_0.pt" in r0["cut"], r0["cut"]


# --- exact resume in new processes, before the first step ----------------------------------------------------


def _gpt2(rank: int, world: int, config: dict, tmp: str, resume: str | None, steps: int = 4, at: int = 2):
    """Train GPT-2 for ``steps`` steps. The uninterrupted run (``resume=None``) saves a partial and a full
    checkpoint after step ``at``, and the same state with SMP v1's ``smp.save``; ``resume="partial"``,
    ``"full"`` or ``"v1"`` resumes from one of them before its first step."""
    import smp
    from smp import zoo

    smp.init(config)
    zm = zoo.build("gpt2", batch=8, seed=0)
    model = smp.DistributedModel(zm.model)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.8 ** s)

    @smp.step
    def train_step(model, args, kwargs, target):
        loss = zm.loss_fn(model(*args, **kwargs), target)
        model.backward(loss)
        return loss

    first = 0
    v1 = os.path.join(tmp, "v1")
    if resume == "v1":
        model.load_state_dict(smp.load(v1 + ".model", partial=True))
        opt.load_state_dict(smp.load(v1 + ".opt", partial=True))
        content = smp.load(v1 + ".content", partial=False)
    elif resume is not None:
        content = smp.resume_from_checkpoint(tmp, tag="full.pt" if resume == "full" else None,
                                             partial=resume == "partial")
    if resume is not None:
        sched.load_state_dict(content["lr_scheduler"])
        first = content["step"]
    losses = []
    d, n = smp.dp_rank(), smp.dp_size()
    for k in range(first, steps):
        args, kwargs, target = zoo.make_batch("gpt2", 8, seed=1000 + k)
        loss = float(train_step(model, _shard(args, d, n), _shard(kwargs, d, n), _shard(target, d, n)).reduce_mean())
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(smp.allgather(loss, smp.CommGroup.DP_GROUP))
        if resume is None and k + 1 == at:
            content = {"lr_scheduler": sched.state_dict(), "step": at}
            smp.save_checkpoint(tmp, f"step{at}", model=model, optimizer=opt, user_content=content)
            smp.save_checkpoint(tmp, "full.pt", partial=False, model=model, optimizer=opt, user_content=content)
            if smp.rdp_rank() == 0:
                smp.save(model.local_state_dict(), v1 + ".model", partial=True)
            smp.save(opt.local_state_dict(), v1 + ".opt", partial=True)
            smp.save(content, v1 + ".content", partial=False)
    return {"losses": losses, "first": first}


def _exact_resume(tmp_path, world: int, config: dict) -> None:
    whole = run_ranks(_gpt2, world, config, str(tmp_path), None, timeout=400)
    for kind in ("partial", "full", "v1"):
        resumed = run_ranks(_gpt2, world, config, str(tmp_path), kind, timeout=400)
        for w, r in zip(whole, resumed):
            assert r["first"] == 2 and r["losses"] == w["losses"][2:], (kind, r["losses"], w["losses"])


@pytest.mark.slow
def test_exact_resume_pp2(tmp_path):
    _exact_resume(tmp_path, 2, CFG)


@pytest.mark.slow
def test_exact_resume_pp2_dp2_sharded(tmp_path):
    _exact_resume(tmp_path, 4, {**CFG, "ddp": True, "shard_optimizer_state": True})


@pytest.mark.slow
def test_exact_resume_pp2_dp2(tmp_path):
    _exact_resume(tmp_path, 4, {**CFG, "ddp": True})
