"""Scripts written for SageMaker's data-parallel library (``smdistributed.dataparallel``) run on this engine through
the opt-in ``smdistributed`` alias (:mod:`smp.smddp`).

Default run: the library's API on two ranks (rank helpers, collectives, the ``"smddp"`` backend, the errors of what is
not supported), a world of one, and a fast variant of each API of the public MNIST example (tests/smp/smddp_scripts)
on two ranks, whose losses and trained weights are those of one process over the same global batches. Under ``-m
slow``: every revision of the public script (tests/smp/smddp_public.py names each by commit, from 6365190 of 2020-11-19
to e5a0e78 of 2024-07-29), launched as a user would, ``smp launch -n N --as-smdistributed script.py``.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from smp.runtime.rank_env import free_port
from smp.testing import run_ranks
from tests.smp import smddp_public
from tests.smp.smddp_scripts.model_def import reference_losses

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "smp" / "smddp_scripts"
STANDINS = ROOT / "tests" / "smp" / "smddp_standins"
VARIANTS = {"v1": "train_v1.py", "backend": "train_smddp_backend.py"}  # the fast variant of each API
STEP = re.compile(r"^step (\d+) loss (\S+)$", re.M)
WORLD, BATCH, STEPS, LR = 2, 8, 3, 1.0
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# --- the API on two ranks, and a world of one ---------------------------------------------------------------------

def _api(rank: int, world: int) -> dict:
    import torch.distributed as torch_dist

    import smp
    import smp.smddp.distributed

    smp.alias_smdistributed()
    import smdistributed.dataparallel.torch.distributed as dist
    import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401
    from smdistributed.dataparallel import __version__
    from smdistributed.dataparallel.torch.parallel import DistributedDataParallel
    from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel as DDP

    dist.init_process_group()  # run_ranks made the default group: this joins it
    out: dict = {"same": dist is smp.smddp.distributed and DistributedDataParallel is DDP, "version": __version__,
                 "ranks": (dist.get_rank(), dist.get_world_size(), dist.get_local_rank(), dist.get_local_size(),
                           dist.is_available(), dist.is_initialized())}
    x = torch.tensor([rank + 1.0])
    out["reduced"] = {}
    for op in ("SUM", "AVERAGE", "MIN", "MAX"):
        t = x.clone()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out["reduced"][op] = t.item()
    t = x.clone()
    dist.all_reduce(t, op=torch_dist.ReduceOp.PRODUCT)  # torch's own reductions pass through
    out["reduced"]["torch PRODUCT"] = t.item()
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=1)
    parts = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(parts, x)
    scattered = torch.zeros(world)
    dist.all_to_all_single(scattered, torch.arange(world, dtype=torch.float32) + 10 * rank)
    dist.barrier(group=dist.group.WORLD)
    out.update(broadcast=b.item(), gathered=[p.item() for p in parts], all_to_all=scattered.tolist())
    smddp_group = torch_dist.new_group(backend="smddp")
    t = x.clone()
    torch_dist.all_reduce(t, group=smddp_group)
    out["smddp_group"] = (torch_dist.get_backend(smddp_group), t.item())
    out["errors"] = []
    for call in (lambda: dist.all_reduce(x.clone(), op=dist.ReduceOp.AVERAGE, async_op=True),
                 lambda: dist.all_reduce(torch.tensor([1]), op=dist.ReduceOp.AVERAGE),
                 lambda: DDP(torch.nn.Linear(2, 2), gradient_accumulation_steps=2)):
        try:
            call()
        except dist.SmddpError as exc:
            out["errors"].append(str(exc))
    return out


def test_the_library_api_on_two_ranks() -> None:
    got = run_ranks(_api, 2)
    for rank, out in enumerate(got):
        assert out["same"] and out["version"] == "1.4.0"
        assert out["ranks"] == (rank, 2, rank, 2, True, True)
        assert out["reduced"] == {"SUM": 3.0, "AVERAGE": 1.5, "MIN": 1.0, "MAX": 2.0, "torch PRODUCT": 2.0}
        assert out["broadcast"] == 1.0 and out["gathered"] == [1.0, 2.0]
        assert out["all_to_all"] == [rank, 10.0 + rank]
        assert out["smddp_group"] == ("gloo", 3.0)  # "smddp" is torch's gloo on the CPU
        not_supported = out["errors"]
        assert len(not_supported) == 3, not_supported
        assert "AVERAGE) with async_op=True is not supported" in not_supported[0]
        assert "AVERAGE) with a torch.int64 tensor is not supported" in not_supported[1]
        assert "gradient_accumulation_steps" in not_supported[2] and "no_sync()" in not_supported[2]


def _world_of_one(rank: int, world: int) -> dict:
    import torch.distributed as torch_dist

    import smp

    torch_dist.destroy_process_group()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_USE_AGENT_STORE"):
        os.environ.pop(name, None)  # as `python script.py` starts
    smp.alias_smdistributed()
    import smdistributed.dataparallel.torch.distributed as dist

    out: dict = {"available": dist.is_available()}
    try:
        dist.get_rank()
    except dist.SmddpError as exc:
        out["before"] = str(exc)
    dist.init_process_group()
    out["after"] = (dist.get_rank(), dist.get_world_size(), dist.get_local_rank(), dist.get_local_size(),
                    dist.is_available())
    return out


def test_a_script_run_without_a_launcher_is_a_world_of_one() -> None:
    out = run_ranks(_world_of_one, 1)[0]
    assert out["available"] is False  # the library's way to tell a script it was not launched
    assert out["before"] == "smdistributed.dataparallel is not initialised: call init_process_group() before get_rank()"
    assert out["after"] == (0, 1, 0, 1, True)


# --- the fast variants: exact against one process -----------------------------------------------------------------

def _run_variant(rank: int, world: int, script: str, args: list[str], port: int) -> tuple[int, str]:
    """The script as ``smp launch --as-smdistributed`` runs it on a rank (smp.cli.worker), making its own process
    group (on a new store) as a launched script does."""
    import torch.distributed as torch_dist

    from smp.cli.worker import run_script

    torch_dist.destroy_process_group()
    os.environ.update(MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="False", SMP_AS_SMDISTRIBUTED="1",
                      CUDA_VISIBLE_DEVICES="")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = run_script([script, *args])
    return status, printed.getvalue()


def _check_exact(stdout: str, saved: Path, world: int) -> None:
    losses = [float(v) for _, v in STEP.findall(stdout)]
    expected, weights = reference_losses(world, BATCH, STEPS, LR)
    assert len(losses) == STEPS, stdout
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    trained = torch.load(saved, map_location="cpu")
    assert sorted(trained) == sorted(f"module.{k}" for k in weights)  # DDP's state dict
    for name, value in weights.items():
        torch.testing.assert_close(trained[f"module.{name}"], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("api", sorted(VARIANTS))
def test_the_fast_variant_trains_as_one_process(api: str, tmp_path: Path) -> None:
    saved = tmp_path / "model.pt"
    args = ["--batch-size", str(BATCH), "--steps", str(STEPS), "--lr", str(LR), "--save", str(saved)]
    results = run_ranks(_run_variant, WORLD, str(SCRIPTS / VARIANTS[api]), args, free_port(), timeout=120)
    for status, printed in results:
        assert status == 0, printed
    _check_exact(results[0][1], saved, WORLD)
    assert not STEP.search(results[1][1]), "only rank 0 prints"


@CUDA
@pytest.mark.parametrize("api", sorted(VARIANTS))
def test_the_fast_variant_on_gpus(api: str, tmp_path: Path) -> None:
    """One process per GPU (NCCL), up to two: the same losses as one process on the CPU."""
    world = min(WORLD, torch.cuda.device_count())
    saved = tmp_path / "model.pt"
    done = _launch(SCRIPTS / VARIANTS[api], world, ["--batch-size", str(BATCH), "--steps", str(STEPS), "--lr", str(LR),
                                                    "--device", "cuda", "--save", str(saved)], tmp_path, cpu=False)
    assert done.returncode == 0, done.stdout + done.stderr
    _check_exact(done.stdout, saved, world)


# --- the public script, every revision (slow) ---------------------------------------------------------------------

def _launch(script: Path, nproc: int, args: list[str], where: Path, cpu: bool,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(STANDINS), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(env or {})}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, "-m", "smp.cli", "launch", "-n", str(nproc), "--log-dir",
                           str(where / "logs"), "--as-smdistributed", str(script), *args],
                          cwd=where, env=env, capture_output=True, text=True, timeout=600)


def _revision_params() -> list:
    return [pytest.param(r, device, id=f"{r.date}-{r.commit[:7]}-{device}",
                         marks=[pytest.mark.slow] + ([CUDA] if device == "cuda" else []))
            for r in smddp_public.REVISIONS for device in ("cpu", "cuda")]


@pytest.mark.parametrize("revision,device", _revision_params())
def test_the_public_script_runs(revision: smddp_public.Revision, device: str, tmp_path: Path) -> None:
    """Each revision of aws/amazon-sagemaker-examples' train_pytorch_smdataparallel_mnist.py (with the model_def.py
    of its commit), as smddp_public.REVISIONS names them, edited only as smddp_public.adapt says, trains one epoch of
    the stand-in MNIST and tests on rank 0; the three with a bug of their own (smddp_public.BUGS) fail by it, as they
    did on SageMaker, two of them after the epoch."""
    script = smddp_public.fetch(revision.commit, revision.script)
    model_def = smddp_public.fetch(revision.commit, f"{revision.folder}/model_def.py")
    if script is None or model_def is None:
        pytest.skip(f"{smddp_public.REPO}@{revision.commit[:7]} is not reachable: set {smddp_public.SOURCE_ENV} to "
                    "a clone of it (or fill the cache folder smddp_public.fetch reads)")
    smddp_public.check_blob(revision, script)
    if "tensorboard" in script:
        pytest.importorskip("tensorboard", reason="this revision logs to TensorBoard")
    nproc = smddp_public.ranks_needed(script)
    if device == "cuda" and torch.cuda.device_count() < nproc:
        pytest.skip(f"this revision needs {nproc} GPUs (one per process)")
    for folder in ("model", "output", "data"):
        (tmp_path / "opt" / "ml" / folder).mkdir(parents=True)
    (tmp_path / "train.py").write_text(smddp_public.adapt(script, device == "cpu", tmp_path / "opt" / "ml"))
    (tmp_path / "model_def.py").write_text(model_def)
    env = {"SM_MODEL_DIR": str(tmp_path / "opt" / "ml" / "model"),
           "SM_FRAMEWORK_PARAMS": json.dumps({"sagemaker_distributed_dataparallel_enabled": True})}
    done = _launch(tmp_path / "train.py", nproc, ["--epochs", "1", "--data-path", str(tmp_path / "data")], tmp_path,
                   device == "cpu", env)
    out = done.stdout + done.stderr
    bug, trains = smddp_public.BUGS.get(revision.blob, ("", True))
    if bug:
        assert done.returncode != 0 and bug in out, out[-4000:]
    else:
        assert done.returncode == 0, out[-4000:]
    if trains:
        losses = [float(v) for v in re.findall(r"Train Epoch: 1 \[.*\]\s+Loss: (\S+)", done.stdout)]
        assert losses and all(math.isfinite(v) for v in losses), out[-4000:]
        assert re.search(r"Test set: Average loss: [0-9.]+, Accuracy: \d+/256", done.stdout), out[-4000:]
