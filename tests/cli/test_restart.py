"""Restart on failure as a pattern (``examples/train_restart.py``): ``smp launch --max-restarts 1`` brings a job that
lost a rank (SIGKILL at a random step) back from its newest committed checkpoint, and it finishes with the losses and
weights of an uninterrupted run (slow: three runs of a 2-rank job)."""
from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from tests.cli.helpers import REPO, ok, smp_env
from tests.cli.helpers import smp_process as smp  # torchrun, consoles, signals: the real process

_STEP = re.compile(r"^step (\d+)/(\d+) loss (\S+)$", re.M)
_STEPS = 12


def _losses(stdout: str) -> dict[int, str]:
    """Step -> the loss printed for it last (a restarted job prints the steps after its checkpoint again)."""
    return {int(step): loss for step, _, loss in _STEP.findall(stdout)}


def _rank_process(launcher: psutil.Process, rank: int) -> psutil.Process:
    """The process of local rank ``rank`` among the processes ``smp launch`` started."""
    for child in launcher.children(recursive=True):
        try:
            if child.environ().get("LOCAL_RANK") == str(rank) and "smp.cli.worker" in child.cmdline():
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no process of local rank {rank} under smp launch (pid {launcher.pid})")


def _weights(folder: Path) -> dict[str, dict]:
    """Every file of a partial checkpoint; the plan each model file keeps is reduced to its cut: its stage prices
    are the ops timed by whichever job made it (two jobs time them apart, on a host whose speed moves)."""
    files = {p.name: torch.load(p, weights_only=False) for p in sorted(folder.glob("*.pt"))}
    for name, content in files.items():
        if name.startswith("model_") and "_smp_plan" in content:
            plan = json.loads(content["_smp_plan"])
            content["_smp_plan"] = (plan["num_stages"], plan["assignment"])
    return files


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.slow
def test_a_killed_rank_restarts_and_finishes_as_if_uninterrupted(tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    after, victim = rng.randint(1, _STEPS // 2), rng.randint(0, 1)  # SIGKILL local rank `victim` once step `after`
    note = f"seed {seed}: SIGKILL rank {victim} after step {after}"  # is printed: inside step after+1, or its save
    job = ["examples/train_restart.py", "--steps", str(_STEPS)]

    whole = ok(smp("launch", "-n", "2", *job, "--ckpt", str(tmp_path / "whole"), timeout=300))
    assert sorted(_losses(whole)) == list(range(1, _STEPS + 1)), whole

    launcher = subprocess.Popen([sys.executable, "-m", "smp.cli", "launch", "-n", "2", "--max-restarts", "1", *job,
                                 "--ckpt", str(tmp_path / "cut")], cwd=REPO, env=smp_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        printed = []
        while not printed or not printed[-1].startswith(f"step {after}/"):
            line = launcher.stdout.readline()
            assert line, f"{note}: the job ended before step {after}: {''.join(printed)}"
            printed.append(line)
        _rank_process(psutil.Process(launcher.pid), victim).send_signal(signal.SIGKILL)
        rest, err = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    out = "".join(printed) + rest
    assert launcher.returncode == 0, f"{note}\nstdout:\n{out}\nstderr:\n{err}"
    assert f"failed on rank {victim}: killed by SIGKILL" in err and "restarting the job (1 of 1 restarts)" in err, \
        f"{note} (did the job end before the kill?)\n{err}"
    # (A kill before the first save commits restarts from step 1: "resumed from step K" is not always printed.)
    assert _losses(out) == _losses(whole), f"{note}\n{out}\n---\n{whole}"
    # Every loss printed before the kill and after the restart is the uninterrupted run's, and so are the weights
    # and the optimizer state of the last checkpoint, bit for bit.
    assert all(_losses(whole)[int(s)] == loss for s, _, loss in _STEP.findall(out)), out
    final = f"step{_STEPS}_partial"
    got, want = _weights(tmp_path / "cut" / final), _weights(tmp_path / "whole" / final)
    assert got.keys() == want.keys() == {"model_0.pt", "model_1.pt", "optimizer_0.pt", "optimizer_1.pt",
                                         "user_content.pt"}, got.keys()
    assert _same(got, want), note
