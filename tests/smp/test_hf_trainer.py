"""Hugging Face's ``Trainer`` runs its own SMP v1 code path on smp, unchanged: ``tests/smp/trainer_script.py`` under
``smp launch --as-smdistributed`` with SageMaker's environment, on 2 pipeline stages and on 2 stages x 2 replicas,
trains, evaluates, saves a checkpoint and resumes from it with the losses of the same script run in one process
without smp.

The environment is transformers 4.56.2 (``tests/smp/trainer_requirements.txt``), built into ``.venv-trainer`` on first
use (:mod:`tests.smp.trainer_env`, a few minutes). In that release's SMP path every data-parallel replica reads the
whole training set in the same order (its data loader is not sharded when SMP is on), so the single-process run
that matches pp2 x dp2 uses one replica's batch; evaluation is sharded over the replicas and gathered.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.smp.trainer_env import ROOT, VENV, trainer_python

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("trainer_script.py")
TOL = 1e-5  # absolute, on losses about 4.5; the runs agree to about 5e-7
STEPS, SAVE_AT = 4, 2


def _run(cmd: list[str], env: dict[str, str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, cwd=ROOT, timeout=900)
    assert done.returncode == 0, f"{what} failed ({' '.join(cmd)}):\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"


def _losses(out: Path) -> tuple[dict[int, float], float]:
    """The mean over ranks of each step's training loss (each replica's, so the mean is the global batch's), and
    the evaluation loss, which every rank must agree on."""
    files = sorted(out.glob("losses_*.json"))
    runs = [json.loads(f.read_text()) for f in files]
    assert runs, f"no losses_*.json in {out}"
    steps = {int(k) for r in runs for k in r["train"]}
    train = {s: sum(r["train"][str(s)] for r in runs) / len(runs) for s in steps}
    evals = {r["eval"] for r in runs}
    assert max(evals) - min(evals) < TOL, f"ranks disagree on the evaluation loss: {sorted(evals)}"
    for f in files:
        f.unlink()
    return train, min(evals)


def _single_process(python: Path, out: Path, batch: int, eval_batch: int) -> tuple[dict[int, float], float]:
    _run([str(python), str(SCRIPT), "--out", str(out), "--steps", str(STEPS), "--save-steps", str(SAVE_AT),
          "--batch", str(batch), "--eval-batch", str(eval_batch)], {"OMP_NUM_THREADS": "1"}, "the single-process run")
    return _losses(out)


@pytest.mark.parametrize("ranks, mp_parameters, batch, eval_batch", [
    (2, {"partitions": 2, "microbatches": 2}, 16, 8),
    (4, {"partitions": 2, "microbatches": 2, "ddp": True}, 8, 4),
], ids=["pp2", "pp2xdp2"])
def test_trainer_on_smp_matches_one_process(tmp_path: Path, ranks: int, mp_parameters: dict, batch: int,
                                            eval_batch: int) -> None:
    python = trainer_python()
    ref_train, ref_eval = _single_process(python, tmp_path / "single", batch, eval_batch)
    sagemaker = {"SM_HP_MP_PARAMETERS": json.dumps(mp_parameters),
                 "SM_FRAMEWORK_PARAMS": json.dumps({"sagemaker_mpi_enabled": True})}
    out = tmp_path / "smp"
    launch = [str(VENV / "bin" / "smp"), "launch", "-n", str(ranks), "--log-dir", str(tmp_path / "logs"),
              "--as-smdistributed", str(SCRIPT), "--out", str(out), "--steps", str(STEPS), "--save-steps",
              str(SAVE_AT), "--batch", str(batch), "--eval-batch", str(eval_batch)]
    _run(launch, sagemaker, "training on smp")
    train, evaluated = _losses(out)
    assert set(train) == set(ref_train)
    for step, loss in train.items():
        assert abs(loss - ref_train[step]) < TOL, (step, loss, ref_train[step])
    assert abs(evaluated - ref_eval) < TOL, (evaluated, ref_eval)
    checkpoint = out / f"checkpoint-{SAVE_AT}"
    assert (checkpoint / "pytorch_model.bin").is_file() and (checkpoint / "user_content.pt").is_file()
    assert sorted(p.name for p in checkpoint.glob("optimizer.pt_*")) == ["optimizer.pt_0", "optimizer.pt_1"]

    _run(launch + ["--resume", str(checkpoint)], sagemaker, "resuming on smp")
    resumed, evaluated = _losses(out)
    assert set(resumed) == set(range(SAVE_AT + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert abs(loss - ref_train[step]) < TOL, (step, loss, ref_train[step])
    assert abs(evaluated - ref_eval) < TOL, (evaluated, ref_eval)
