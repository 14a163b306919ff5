"""Every example has a fast variant that prints finite losses that fall (the restart example's need not); the full
runs are marked slow. The default test run keeps the fast variants of the examples whose paths no other default test
takes (:data:`DEFAULT`: the demo's GPT-2 with tied weights over two stages, the SMP v1 scripts' checkpoints in both
formats, the restart example); the CNN, the ViT distillation and the tensor-parallel recipe, whose engine paths the
default run tests without ``smp launch`` (zoo models on two ranks, SMP's distributed transformer at tp 2), run theirs
under ``-m slow``.

An example's fast variant is its own command line with few steps (``--steps 2`` or 3: start-up, not the steps,
is most of a run's time, so the examples keep their sizes), launched as the README launches them, ``smp launch -n
2 examples/NAME.py ...`` (a thin wrapper over torchrun); :data:`FAST` names each one's, and
``test_every_example_has_a_fast_variant`` fails when an example is added without one. The SMP v1-style ones
(``smp_v1_*.py``) also stop, save and resume to the
same printed losses. Slow: the documented full runs, 4 ranks, other pipelines.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

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


# -- the fast variants: the default test run ----------------------------------------------------------------
MNIST_FILES = "model.manifest.json model_0 model_1 optimizer.manifest.json optimizer_0 optimizer_1"


def fast_train_cnn(tmp_path: Path) -> None:
    out = smp_launch("train_cnn.py", "--steps", "3", nproc=2)
    assert_falls(losses(out, 3))
    assert "partition plan:" in out and "conv1" in out


def fast_train_vit(tmp_path: Path) -> None:
    out = smp_launch("train_vit.py", "--steps", "3", nproc=2)
    assert_falls(losses(out, 3))
    assert "student partition plan:" in out and "distill" in out and "accuracy" in out


def fast_train_gpt2(tmp_path: Path) -> None:
    out = smp_launch("train_gpt2.py", "--steps", "2", nproc=2)
    assert_falls(losses(out, 2))
    assert "partition plan:" in out and "transformer.wte.weight on stages [0, 1]" in out  # tied embeddings
    assert ("wrote and removed a partial checkpoint (gpt2.model.manifest.json, gpt2.model_0, gpt2.model_1, "
            "gpt2.optimizer.manifest.json, gpt2.optimizer_0, gpt2.optimizer_1); pass --out DIR to keep it") in out


def fast_smp_v1_mnist(tmp_path: Path) -> None:
    """Data on pp_rank 0 only, ``sum(loss_batch)`` of ``loss.item()`` returns, ``smp.save`` on rdp_rank 0 (the
    resume to the same losses: slow)."""
    assert_falls(losses(smp_launch("smp_v1_mnist.py", "--steps", "3", "--ckpt", str(tmp_path), "--stop-after", "3",
                                     nproc=2), 3))
    assert " ".join(sorted(p.name for p in tmp_path.iterdir())) == MNIST_FILES


def fast_smp_v1_gpt2(tmp_path: Path) -> None:
    """bf16, the optimizer and ``args`` as step arguments, ``smp.save_checkpoint`` (the resume: slow)."""
    assert_falls(losses(smp_launch("smp_v1_gpt2.py", "--steps", "2", "--ckpt", str(tmp_path), "--stop-after", "2",
                                     nproc=2), 2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["newest", "step2_partial"]


def fast_train_restart(tmp_path: Path) -> None:
    """A run without a failure (killing a rank and restarting is tested with ``smp launch --max-restarts``); its
    learning rate is small and every step a new batch, so two losses need not fall: finite ones are the check."""
    out = smp_launch("train_restart.py", "--steps", "2", "--ckpt", str(tmp_path), nproc=2)
    losses(out, 2)
    assert (tmp_path / "newest").is_file(), sorted(p.name for p in tmp_path.iterdir())


EXACT = ("--same_seed", "1", "--resid_pdrop", "0", "--embd_pdrop", "0", "--attn_pdrop", "0", "--weight_decay", "0")


def gpt2_reference(start: Path, steps: int, batch: int, report: int) -> list[float]:
    """The losses of the Hugging Face GPT-2 saved in ``start`` (``save_pretrained``) trained in this process with
    torch alone as ``smp_v1_gpt2_tp.py`` trains (its data, weight-decay groups and learning rate), on ``batch`` rows
    a step (every replica's); the loss of the first ``report`` rows (rank 0's replica) as the script prints it."""
    import torch
    from transformers import GPT2LMHeadModel

    from examples.smp_v1_gpt2_tp import annealing, batches, param_groups_by_weight_decay, parse_args
    sys.argv = ["smp_v1_gpt2_tp.py", "--max_steps", str(steps), "--train_batch_size", str(batch), *EXACT]
    args = parse_args()
    model = GPT2LMHeadModel.from_pretrained(start)
    optimizer = torch.optim.Adam(param_groups_by_weight_decay(model), betas=(args.beta1, args.beta2), lr=args.lr,
                                 weight_decay=args.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, annealing(args))
    out = []
    for _, ids, mask in batches(args, 0, 1, 0):
        optimizer.zero_grad()
        with torch.no_grad():
            out.append(model(input_ids=ids[:report], attention_mask=mask[:report], labels=ids[:report]).loss.item())
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        optimizer.step()
        schedule.step()
    return out


def gpt2_tp_matches_reference(tmp_path: Path, nproc: int, *layout: str, replicas: int = 1) -> list[float]:
    """The published-recipe example on ``nproc`` ranks in ``layout`` (6 steps, 4 rows a replica), started from the
    model an initial run saved (SMP's initialisation; ``--max_steps 0 --save_final_full_model 1``, exported to Hugging
    Face's format) with ``--load_full 1``: its losses are those of that Hugging Face model trained in one process."""
    model_dir = ("--model-dir", str(tmp_path))
    smp_launch("smp_v1_gpt2_tp.py", "--max_steps", "0", "--save_final_full_model", "1", *model_dir, *EXACT, *layout,
               nproc=nproc)
    out = smp_launch("smp_v1_gpt2_tp.py", "--max_steps", "6", "--load_full", "1", *model_dir, *EXACT, *layout,
                     nproc=nproc)
    values = losses(out, 6)
    want = gpt2_reference(tmp_path / "hf", 6, 4 * replicas, 4)
    assert all(abs(a - b) < 1e-5 * abs(b) for a, b in zip(values, want)), (values, want)
    return values


def fast_smp_v1_gpt2_tp(tmp_path: Path) -> None:
    """SMP's distributed transformer at tensor degree 2 (the published recipe's calls): a full model saved, exported
    to Hugging Face's format and loaded back (``--load_full``) trains to the single-process losses of that model."""
    assert_falls(gpt2_tp_matches_reference(tmp_path, 2, "--tensor_parallel_degree", "2"))


FAST: dict[str, Callable[[Path], None]] = {
    "train_cnn.py": fast_train_cnn, "train_vit.py": fast_train_vit, "train_gpt2.py": fast_train_gpt2,
    "smp_v1_mnist.py": fast_smp_v1_mnist, "smp_v1_gpt2.py": fast_smp_v1_gpt2, "train_restart.py": fast_train_restart,
    "smp_v1_gpt2_tp.py": fast_smp_v1_gpt2_tp,
}


def test_every_example_has_a_fast_variant():
    examples = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
    assert sorted(FAST) == examples, f"give every example a fast variant in FAST (examples: {examples})"


# Whose fast variant the default test run keeps (see the module docstring); the others run under -m slow.
DEFAULT = ("train_gpt2.py", "smp_v1_mnist.py", "smp_v1_gpt2.py")  # train_restart.py: resume is also in test_checkpoint


@pytest.mark.parametrize("script", [s if s in DEFAULT else pytest.param(s, marks=pytest.mark.slow)
                                    for s in sorted(FAST)])
def test_example_fast_variant(script, tmp_path):
    FAST[script](tmp_path)


# -- the full runs: slow ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("script,marker", [("train_cnn.py", "conv1"), ("train_vit.py", "distill")])
def test_documented_full_run(script, marker):
    """The command each docstring gives: ``smp launch -n 2 examples/NAME.py --steps 8``."""
    out = smp_launch(script, "--steps", "8", nproc=2)
    assert_falls(losses(out, 8))
    assert marker in out


@pytest.mark.slow
def test_train_cnn_simple_pipeline_8_microbatches():
    out = smp_launch("train_cnn.py", "--steps", "4", "--pipeline", "simple", "--microbatches", "8", nproc=2)
    assert_falls(losses(out, 4))


@pytest.mark.slow
def test_train_gpt2_demo_through_smp_launch(tmp_path):
    """The README's demo command: ``smp launch -n 2 examples/train_gpt2.py --steps 8``."""
    out = smp_launch("train_gpt2.py", "--steps", "8", "--pipeline", "simple", "--out", str(tmp_path), nproc=2)
    values = losses(out, 8)
    assert_falls(values)
    assert values[-1] < values[0] - 0.5, values
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2.model.manifest.json", "gpt2.model_0", "gpt2.model_1",
                                                           "gpt2.optimizer.manifest.json", "gpt2.optimizer_0",
                                                           "gpt2.optimizer_1"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_smp_v1_mnist_resumes_exactly(nproc, tmp_path):
    _, files = _resume_reproduces("smp_v1_mnist.py", nproc, 4, tmp_path)
    assert files == MNIST_FILES, files


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_smp_v1_gpt2_resumes_exactly(nproc, tmp_path):
    _, files = _resume_reproduces("smp_v1_gpt2.py", nproc, 4, tmp_path)
    assert files == "newest step2_partial", files


@pytest.mark.slow
@pytest.mark.parametrize("layout,replicas", [(("--pipeline_parallel_degree", "2", "--microbatches", "2"), 1),
                                             ((), 2), (("--prescaled_batch", "0"), 2)])
def test_smp_v1_gpt2_tp_on_4_ranks_is_exact(layout, replicas, tmp_path):
    """tp2 x pp2 and tp2 x dp2 (prescaled or not: the tp ranks read one batch, or each its own)."""
    gpt2_tp_matches_reference(tmp_path, 4, "--tensor_parallel_degree", "2", *layout,
                              *(("--train_batch_size", "2") if "0" in layout else ()),
                              replicas=replicas)


@pytest.mark.slow
def test_smp_v1_gpt2_tp_published_defaults_train(tmp_path):
    """The published defaults (dropout 0.1, a seed per tp rank, activation checkpointing) on tp2 x pp2: it trains."""
    out = smp_launch("smp_v1_gpt2_tp.py", "--tensor_parallel_degree", "2", "--pipeline_parallel_degree", "2",
                     "--microbatches", "2", "--max_steps", "6", "--checkpoint-dir", str(tmp_path), nproc=4)
    assert_falls(losses(out, 6))


@pytest.mark.slow
def test_smp_v1_gpt2_tp_resumes_exactly(tmp_path):
    """tp2 x pp2, activation checkpointing, a seed per tp rank: a run saved at step 3 (``--max_steps 3``, the
    schedule fixed by ``--lr_decay_iters``) and resumed with ``--load_partial 1`` prints the uninterrupted run's
    losses (dropout off: its masks come from random streams a checkpoint does not hold)."""
    common = ("--tensor_parallel_degree", "2", "--pipeline_parallel_degree", "2", "--microbatches", "2",
              "--lr_decay_iters", "6", "--same_seed", "0", *EXACT[2:], "--checkpoint-dir")
    whole = losses(smp_launch("smp_v1_gpt2_tp.py", "--max_steps", "6", *common, str(tmp_path / "whole"), nproc=4), 6)
    smp_launch("smp_v1_gpt2_tp.py", "--max_steps", "3", "--checkpoint_freq", "3", *common, str(tmp_path / "cut"),
               nproc=4)
    rest = smp_launch("smp_v1_gpt2_tp.py", "--max_steps", "6", "--load_partial", "1", *common, str(tmp_path / "cut"),
                      nproc=4)
    assert [float(v) for _, _, v in STEP.findall(rest)] == whole[3:], (whole, rest)
