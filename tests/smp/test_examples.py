"""The examples run end to end on 2 CPU ranks, exit 0, and their printed losses fall; the SMP v1-style ones
(``smp_v1_*.py``) also run on 4 ranks and resume from their checkpoints to the same printed losses.

Each example runs as users launch it, as a subprocess of torchrun (``python -m torch.distributed.run
--standalone --nproc-per-node 2``; ``smp launch`` is a thin wrapper over it); the GPT-2 demo also runs through
``smp launch`` itself. The CNN and ViT examples (2 ranks) are in the default run; the others are marked slow.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEP = re.compile(r"^step\s+(\d+)/(\d+)\s+loss\s+([-+0-9.eE]+|nan|inf)", re.M)


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _run(cmd: list[str], timeout: float = 180) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{out[-4000:]}"
    return proc.stdout


def torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 180) -> str:
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                 f"examples/{script}", *args], timeout)


def losses(stdout: str, steps: int) -> list[float]:
    found = [(int(k), int(n), float(v)) for k, n, v in STEP.findall(stdout)]
    assert [k for k, _, _ in found] == list(range(1, steps + 1)), \
        f"expected {steps} step lines (rank 0 only):\n{stdout}"
    assert all(n == steps for _, n, _ in found)
    values = [v for _, _, v in found]
    assert all(math.isfinite(v) for v in values), values
    return values


def assert_falls(values: list[float]) -> None:
    assert values[-1] < values[0], f"the loss did not fall: {values}"


def test_train_cnn():
    out = torchrun("train_cnn.py", "--steps", "4")
    assert_falls(losses(out, 4))
    assert "partition plan:" in out and "conv1" in out


@pytest.mark.slow
def test_train_cnn_simple_pipeline_8_microbatches():
    out = torchrun("train_cnn.py", "--steps", "4", "--pipeline", "simple", "--microbatches", "8")
    assert_falls(losses(out, 4))


@pytest.mark.slow
def test_train_gpt2():
    out = torchrun("train_gpt2.py", "--steps", "3")
    assert_falls(losses(out, 3))
    assert "partition plan:" in out and "transformer.wte.weight on stages [0, 1]" in out  # tied embeddings
    assert ("wrote and removed a partial checkpoint (gpt2.model.manifest.json, gpt2.model_0, gpt2.model_1, "
            "gpt2.optimizer.manifest.json, gpt2.optimizer_0, gpt2.optimizer_1); pass --out DIR to keep it") in out


@pytest.mark.slow
def test_train_gpt2_demo_through_smp_launch(tmp_path):
    """The README's demo command: ``smp launch -n 2 examples/train_gpt2.py --steps 8``."""
    out = _run([sys.executable, "-m", "smp.cli", "launch", "-n", "2", "examples/train_gpt2.py", "--steps", "8",
                "--pipeline", "simple", "--out", str(tmp_path)], timeout=240)
    values = losses(out, 8)
    assert_falls(values)
    assert values[-1] < values[0] - 0.5, values
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2.model.manifest.json", "gpt2.model_0", "gpt2.model_1",
                                                           "gpt2.optimizer.manifest.json", "gpt2.optimizer_0",
                                                           "gpt2.optimizer_1"]


def test_train_vit_distillation():
    out = torchrun("train_vit.py", "--steps", "3")
    assert_falls(losses(out, 3))
    assert "student partition plan:" in out and "distill" in out and "accuracy" in out


def smp_launch(script: str, *args: str, nproc: int, timeout: float = 300) -> str:
    return _run([sys.executable, "-m", "smp.cli", "launch", "-n", str(nproc), f"examples/{script}", *args], timeout)


def _resume_reproduces(script: str, nproc: int, steps: int, ckpt: Path) -> tuple[list[str], str]:
    """The printed losses of ``steps`` uninterrupted steps, and of steps/2 + save, then resume + steps/2: equal
    to the last printed digit. Returns the losses and the checkpoint directory's listing."""
    whole = smp_launch(script, "--steps", str(steps), "--ckpt", str(ckpt / "whole"), nproc=nproc)
    values = losses(whole, steps)
    assert_falls(values)
    half = str(steps // 2)
    first = smp_launch(script, "--steps", str(steps), "--ckpt", str(ckpt / "cut"), "--stop-after", half, nproc=nproc)
    rest = smp_launch(script, "--steps", str(steps), "--ckpt", str(ckpt / "cut"), "--resume", nproc=nproc)
    printed = [v for _, _, v in STEP.findall(whole)]
    resumed = [v for _, _, v in STEP.findall(first + rest)]
    assert resumed == printed, (printed, resumed)
    return printed, " ".join(sorted(p.name for p in (ckpt / "cut").iterdir()))


@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_smp_v1_mnist_resumes_exactly(nproc, tmp_path):
    """Data on pp_rank 0 only, ``sum(loss_batch)`` of ``loss.item()`` returns, ``smp.save`` on rdp_rank 0."""
    _, files = _resume_reproduces("smp_v1_mnist.py", nproc, 4, tmp_path)
    assert files == "model.manifest.json model_0 model_1 optimizer.manifest.json optimizer_0 optimizer_1", files


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_smp_v1_gpt2_resumes_exactly(nproc, tmp_path):
    """bf16, the optimizer and ``args`` as step arguments, ``smp.save_checkpoint`` / ``resume_from_checkpoint``."""
    _, files = _resume_reproduces("smp_v1_gpt2.py", nproc, 4, tmp_path)
    assert files == "newest step2_partial", files
