"""``smp.save`` / ``smp.load`` and the state dicts they carry, on spawned ranks: SMP v1's file names, a save that
a rank fails leaves the older checkpoint intact, corrupt files are named, tied weights stay tied, partial
loads are strict about this rank's keys (exact resume from these files: test_tagged_checkpoint)."""
from __future__ import annotations

import os
import stat

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from smp.testing import run_ranks

CFG = {"pipeline_parallel_degree": 2, "microbatches": 2}


class Tied(nn.Module):
    """Embedding and output head share one weight (as GPT-2's do), so a pipeline holds it on both ends."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


def tied_training(config: dict, shard: bool = False):
    """smp.init(config), a Tied model (seed 0) with SGD or sharded Adam, and ``step(k)`` that trains one step
    on this replica's part of batch ``k``. Module level: the test modules' spawned ranks share it."""
    import smp

    smp.init(config)
    torch.manual_seed(0)
    model = smp.DistributedModel(Tied())
    inner = torch.optim.Adam(model.parameters(), lr=1e-2) if shard else \
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = smp.DistributedOptimizer(inner)

    @smp.step
    def train_step(model, ids, target):
        loss = F.cross_entropy(model(ids).flatten(0, 1), target.flatten())
        model.backward(loss)
        return loss

    def step(k: int) -> float:
        g = torch.Generator().manual_seed(100 + k)
        ids, target = torch.randint(32, (8, 6), generator=g), torch.randint(32, (8, 6), generator=g)
        d, n = smp.dp_rank(), smp.dp_size()
        loss = float(train_step(model, ids.chunk(n)[d], target.chunk(n)[d]).reduce_mean())
        opt.step()
        opt.zero_grad()
        return loss
    return model, opt, step


def local_params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.local_state_dict().items() if isinstance(v, torch.Tensor)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def damage(path: str, truncate: bool) -> None:
    """Flip one byte in the middle of the file (tensor data: torch.load alone would not notice), or cut it."""
    with open(path, "r+b") as fh:
        size = fh.seek(0, os.SEEK_END)
        if truncate:
            fh.truncate(size - 100)
        else:
            fh.seek(size // 2)
            byte = fh.read(1)
            fh.seek(size // 2)
            fh.write(bytes([byte[0] ^ 0xFF]))


def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# --- pp=2: names, a failed save, corruption, tied weights, strict partial loads --------------------------------


def _pp2(rank: int, world: int, tmp: str):
    import smp

    os.umask(0o022)
    model, opt, step = tied_training(CFG)
    step(0)
    out: dict = {}
    full = model.state_dict()
    out["tied"] = full["embed.weight"] is full["head.weight"]
    out["full_keys"] = sorted(full)
    path = os.path.join(tmp, "ckpt")
    smp.save(model.local_state_dict(), path, partial=True)
    saved = local_params(model)
    smp.barrier()
    out["files"] = sorted(os.listdir(tmp))
    out["modes"] = {f: stat.S_IMODE(os.stat(os.path.join(tmp, f)).st_mode) for f in os.listdir(tmp)}

    # A save over that checkpoint in which rank 1 fails halfway (its object cannot be pickled): nothing changes.
    step(1)
    newer = model.local_state_dict()
    if rank == 1:
        newer["hook"] = lambda: None
    out["failed_save"] = _error(lambda: smp.save(newer, path, partial=True))
    smp.barrier()
    out["after_failure"] = sorted(os.listdir(tmp))
    model.load_state_dict(smp.load(path, partial=True))
    out["restored"] = same(local_params(model), saved)

    # Strict partial loads: only this rank's keys count, and a mismatch names them.
    mine = model.local_state_dict()
    held = sorted(k for k in mine if not k.startswith("_smp"))
    out["held"] = held
    dropped = dict(mine)
    del dropped[held[0]]
    out["missing_error"] = _error(lambda: model.load_state_dict(dropped))
    result = model.load_state_dict(dropped, strict=False)
    out["missing"] = (result.missing_keys, result.unexpected_keys)
    renamed = {(k if k.startswith("_smp") else "module." + k): v for k, v in mine.items()}
    out["renamed_error"] = _error(lambda: model.load_state_dict(renamed))
    # A dict saved under another partition: rebuilt from every pipeline rank's part (a collective), or refused.
    other = dict(mine, _smp_plan=_other_plan(mine["_smp_plan"]))
    out["same_partition_error"] = _error(lambda: model.load_state_dict(other, same_partition_load=True))
    step(2)
    model.load_state_dict(other)
    out["rebuilt"] = same(local_params(model), {k: v for k, v in mine.items() if k in held})

    # Corruption: rank 0 damages rank 1's file (a flipped byte), then its own (cut short).
    smp.barrier()
    if rank == 0:
        damage(f"{path}_1", truncate=False)
        damage(f"{path}_0", truncate=True)
    smp.barrier()
    out["corrupt"] = _error(lambda: smp.load(path, partial=True))
    return out


def _other_plan(plan_json: str) -> str:
    from partitioner import PartitionPlan

    plan = PartitionPlan.from_json(plan_json)
    plan.assignment = {name: 0 for name in plan.assignment}
    return plan.to_json()


def test_save_load_pp2(tmp_path):
    results = run_ranks(_pp2, 2, str(tmp_path), timeout=240)
    r0, r1 = results
    assert r0["files"] == ["ckpt.manifest.json", "ckpt_0", "ckpt_1"], r0["files"]  # SMP v1: PATH_<mp_rank>
    assert set(r0["modes"].values()) == {0o644}, r0["modes"]  # the umask's permissions, not mkstemp's 0600
    for r in results:
        assert r["tied"], "state_dict() must keep tied weights one tensor"
        assert "embed.weight" in r["full_keys"] and "head.weight" in r["full_keys"]
        assert "smp.save of" in r["failed_save"] and "rank 1" in r["failed_save"], r["failed_save"]
        assert r["after_failure"] == r0["files"], r["after_failure"]  # no temporary files left
        assert r["restored"], "the older checkpoint must still load after a failed save over it"
        assert "are missing: [" + r["held"][0] in r["missing_error"], r["missing_error"]
        assert f"pp_rank {results.index(r)}" in r["missing_error"]
        assert r["missing"] == ([r["held"][0]], []), r["missing"]  # only this rank's own key, nothing of the other's
        assert "module." + r["held"][0] in r["renamed_error"] and "do not belong" in r["renamed_error"]
        assert "same_partition_load=True" in r["same_partition_error"], r["same_partition_error"]
        assert r["rebuilt"]
    assert set(r0["held"]) != set(r1["held"])
    assert "truncated or corrupt checkpoint" in r0["corrupt"] and "ckpt_0" in r0["corrupt"], r0["corrupt"]
    assert "truncated or corrupt checkpoint" in r1["corrupt"] and "ckpt_1" in r1["corrupt"], r1["corrupt"]


def _before_first_step(rank: int, world: int):
    """A partial dict loaded before the first step (a restart; here a second model after smp's state is reset):
    keys the model does not have fail at once, keys of this rank that are missing fail in the first step,
    and the other rank stops with an error naming this one instead of waiting."""
    from smp.runtime import state

    model, _, step = tied_training(CFG)
    step(0)
    saved = model.local_state_dict()
    state.reset()
    model, _, step = tied_training(CFG)
    renamed = {(k if k.startswith("_smp") else "module." + k): v for k, v in saved.items()}
    out = {"renamed": _error(lambda: model.load_state_dict(renamed))}
    dropped = dict(saved)
    if rank == 1:
        del dropped[sorted(k for k in saved if not k.startswith("_smp"))[0]]
    out["loaded"] = model.load_state_dict(dropped)  # applied right after partitioning
    out["first_step"] = _error(lambda: step(1))
    out["dropped"] = sorted(set(saved) - set(dropped))
    return out


def test_partial_load_before_first_step_is_strict():
    r0, r1 = run_ranks(_before_first_step, 2, timeout=240)
    for r in (r0, r1):
        assert "do not belong" in r["renamed"] and "module." in r["renamed"], r["renamed"]
        assert r["loaded"] is None
    assert r1["dropped"] and f"are missing: [{r1['dropped'][0]}]" in r1["first_step"], r1["first_step"]
    assert "PeerError" in r0["first_step"] and "rank 1" in r0["first_step"], r0["first_step"]


# --- pp=2 x dp=2: replica 0 saves, every replica loads; sharded optimizer state per replica ---------------------


def _replicas(rank: int, world: int, tmp: str):
    import smp

    cfg = {**CFG, "ddp": True, "shard_optimizer_state": True}
    model, opt, step = tied_training(cfg, shard=True)
    step(0)
    model_path, opt_path = os.path.join(tmp, "model"), os.path.join(tmp, "opt")
    if smp.rdp_rank() == 0:  # the usual SMP v1 script
        smp.save(model.local_state_dict(), model_path, partial=True)
    local_opt = opt.local_state_dict()
    smp.save(local_opt, opt_path, partial=True)  # differs between replicas: every rank saves its own file
    saved_params, saved_opt = local_params(model), {k: v["exp_avg"].clone() for k, v in local_opt["state"].items()}
    smp.barrier()
    files = sorted(os.listdir(tmp))
    step(1)
    model.load_state_dict(smp.load(model_path, partial=True))
    opt.load_state_dict(smp.load(opt_path, partial=True))
    reloaded = opt.local_state_dict()["state"]
    other = (smp.rdp_rank() + 1) % 2
    wrong_shard = torch.load(f"{opt_path}_{smp.mp_rank()}_{other}", weights_only=False)
    return {"files": files, "params": same(local_params(model), saved_params),
            "opt": same({k: v["exp_avg"] for k, v in reloaded.items()}, saved_opt),
            "state_key": "state" in local_opt and len(local_opt["state"]) > 0,
            "wrong_shard": _error(lambda: opt.load_state_dict(wrong_shard))}


@pytest.mark.slow  # 4 ranks; test_save_load_pp2 is the default run's
def test_save_load_pp2_dp2(tmp_path):
    results = run_ranks(_replicas, 4, str(tmp_path), timeout=300)
    assert results[0]["files"] == ["model.manifest.json", "model_0", "model_1", "opt.manifest.json",
                                   "opt_0_0", "opt_0_1", "opt_1_0", "opt_1_1"], results[0]["files"]
    for r in results:
        assert r["params"] and r["opt"] and r["state_key"], r
        assert "belongs to another shard" in r["wrong_shard"], r["wrong_shard"]


def test_load_without_manifest_is_not_committed(tmp_path):
    (out,) = run_ranks(_uncommitted, 1, str(tmp_path), timeout=120)
    assert "is not a committed checkpoint" in out["partial"] and "ckpt.manifest.json is missing" in out["partial"]
    assert out["plain"] == [1, 2], out  # a plain torch.save file still loads with partial=False


def _uncommitted(rank: int, world: int, tmp: str):
    import smp

    smp.init({"pipeline_parallel_degree": 1})
    path = os.path.join(tmp, "ckpt")
    torch.save({"w": torch.ones(2)}, path + "_0")  # what a rank that died before the commit leaves
    torch.save([1, 2], path)
    return {"partial": _error(lambda: smp.load(path, partial=True)), "plain": smp.load(path, partial=False)}


@pytest.mark.parametrize("truncate", [False, True])
def test_corrupt_single_file_is_named(tmp_path, truncate):
    (out,) = run_ranks(_corrupt_full, 1, str(tmp_path), truncate, timeout=120)
    assert out.startswith("CheckpointError: truncated or corrupt checkpoint") and "full.pt" in out, out


def _corrupt_full(rank: int, world: int, tmp: str, truncate: bool):
    import smp

    smp.init({"pipeline_parallel_degree": 1})
    path = os.path.join(tmp, "full.pt")
    smp.save({"w": torch.arange(10000.0)}, path, partial=False)
    damage(path, truncate)
    return _error(lambda: smp.load(path, partial=False))
