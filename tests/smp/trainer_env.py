"""The Python environment the Hugging Face ``Trainer`` tests run in: ``.venv-trainer`` at the repository root, with
the pins of ``tests/smp/trainer_requirements.txt`` and smp from this checkout, built on first use.

torch comes as in the Makefile: the wheel on this machine's disk when there is one, else PyTorch's CPU index (a
plain ``pip install torch`` on Linux brings the CUDA build). On a machine without CUDA one change is made to the
installed transformers, the one a CPU-only run of its SMP code path needs: its ``TrainingArguments`` puts every
SMP rank on ``cuda:<local_rank>`` (:data:`DEVICE_LINES`), which becomes the CPU there.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

__all__ = ["ROOT", "VENV", "REQUIREMENTS", "DEVICE_LINES", "trainer_python", "TrainerEnvError"]

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-trainer"
REQUIREMENTS = Path(__file__).with_name("trainer_requirements.txt")
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# transformers 4.56.2, training_args.py, TrainingArguments._setup_devices under is_sagemaker_mp_enabled():
DEVICE_LINES = ('            device = torch.device("cuda", local_rank)\n'
                '            torch.cuda.set_device(device)\n')
CPU_LINES = ('            device = torch.device("cuda", local_rank) if torch.cuda.is_available() '
             'else torch.device("cpu")\n'
             '            if device.type == "cuda":  # patched by smp tests/smp/trainer_env.py: CPU-only machine\n'
             '                torch.cuda.set_device(device)\n')
_MARKER = VENV / ".smp-trainer-env"


class TrainerEnvError(RuntimeError):
    """The Trainer tests' environment could not be built; the message has the failing command and its output."""


def _run(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise TrainerEnvError(f"building {VENV} failed while {what}: `{' '.join(cmd)}` exited with "
                              f"{done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}\nfix the cause, or "
                              f"remove {VENV} and run again")
    return done


def _patch_device(python: Path) -> str:
    """Put transformers' SMP ranks on the CPU where there is no CUDA; returns what was done, for the marker."""
    probe = _run([str(python), "-c", "import torch, transformers.training_args as t; "
                  "print(torch.cuda.is_available()); print(t.__file__)"], "finding transformers")
    cuda, path = probe.stdout.split()
    if cuda == "True":
        return "cuda: transformers unchanged"
    text = Path(path).read_text()
    if CPU_LINES not in text:
        if text.count(DEVICE_LINES) != 1:
            raise TrainerEnvError(f"{path} does not hold the SMP device lines this test changes for the CPU "
                                  f"({DEVICE_LINES!r}): is transformers the version {REQUIREMENTS.name} pins?")
        Path(path).write_text(text.replace(DEVICE_LINES, CPU_LINES))
    return f"cpu: {path} patched"


def trainer_python() -> Path:
    """The environment's interpreter, building the environment first when it is missing or its pins changed."""
    python = VENV / "bin" / "python"
    wanted = REQUIREMENTS.read_text()
    if python.exists() and _MARKER.exists() and _MARKER.read_text().startswith(wanted):
        return python
    _run([sys.executable, "-m", "venv", str(VENV)], "creating the virtual environment")
    torch_pin = next(line for line in wanted.splitlines() if line.startswith("torch=="))
    pip = [str(python), "-m", "pip", "install", "-q"]
    if subprocess.run(pip + ["--no-index", "--no-deps", torch_pin], capture_output=True).returncode != 0:
        _run(pip + [torch_pin, "--index-url", TORCH_CPU_INDEX], f"installing {torch_pin} from PyTorch's CPU index")
    _run(pip + ["-r", str(REQUIREMENTS), "-e", str(ROOT)], f"installing {REQUIREMENTS.name} and smp")
    done = _patch_device(python)
    _MARKER.write_text(wanted + f"# {done}\n")
    return python
