"""The Python environment the Hugging Face ``Trainer`` tests run in: ``.venv-trainer`` at the repository root, with
the pins of ``tests/smp/trainer_requirements.txt`` and smp from this checkout, built on first use
(:mod:`tests.second_env`). On a machine without CUDA one change is made to the
installed transformers, the one a CPU-only run of its SMP code path needs: its ``TrainingArguments`` puts every
SMP rank on ``cuda:<local_rank>`` (:data:`DEVICE_LINES`), which becomes the CPU there.
"""
from __future__ import annotations

from pathlib import Path

from tests.second_env import ROOT, SecondEnvError, env_python, run

__all__ = ["ROOT", "VENV", "REQUIREMENTS", "DEVICE_LINES", "trainer_python"]

VENV = ROOT / ".venv-trainer"
REQUIREMENTS = Path(__file__).with_name("trainer_requirements.txt")
# transformers 4.56.2, training_args.py, TrainingArguments._setup_devices under is_sagemaker_mp_enabled():
DEVICE_LINES = ('            device = torch.device("cuda", local_rank)\n'
                '            torch.cuda.set_device(device)\n')
CPU_LINES = ('            device = torch.device("cuda", local_rank) if torch.cuda.is_available() '
             'else torch.device("cpu")\n'
             '            if device.type == "cuda":  # patched by smp tests/smp/trainer_env.py: CPU-only machine\n'
             '                torch.cuda.set_device(device)\n')


def _patch_device(python: Path) -> str:
    """Put transformers' SMP ranks on the CPU where there is no CUDA; returns what was done, for the marker."""
    probe = run([str(python), "-c", "import torch, transformers.training_args as t; "
                 "print(torch.cuda.is_available()); print(t.__file__)"], "finding transformers", VENV)
    cuda, path = probe.stdout.split()
    if cuda == "True":
        return "cuda: transformers unchanged"
    text = Path(path).read_text()
    if CPU_LINES not in text:
        if text.count(DEVICE_LINES) != 1:
            raise SecondEnvError(f"{path} does not hold the SMP device lines this test changes for the CPU "
                                  f"({DEVICE_LINES!r}): is transformers the version {REQUIREMENTS.name} pins?")
        Path(path).write_text(text.replace(DEVICE_LINES, CPU_LINES))
    return f"cpu: {path} patched"


def trainer_python() -> Path:
    """The environment's interpreter (:func:`tests.second_env.env_python`), building it first when it is missing
    or its pins changed."""
    return env_python(VENV, REQUIREMENTS.read_text(), after=_patch_device)
