"""A second Python environment for the tests that run smp under other pins than the development one: another
transformers (the Hugging Face ``Trainer`` test), the oldest torch the package accepts (the floor test).

Each is a virtual environment at the repository root, built on first use (minutes) and rebuilt when its pins change,
with smp installed from this checkout. torch comes from the first source that has the pinned release: a wheel on
this machine's disk (pip's find-links, as the Makefile takes it), PyTorch's CPU index (a plain ``pip install torch``
on Linux brings the CUDA build, several GB), else PyPI (that CUDA build, which runs on the CPU too).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

__all__ = ["ROOT", "SecondEnvError", "env_python"]

ROOT = Path(__file__).resolve().parents[1]
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


class SecondEnvError(RuntimeError):
    """A second environment could not be built; the message has the failing command and its output."""


def run(cmd: list[str], what: str, venv: Path) -> subprocess.CompletedProcess:
    """``cmd``, or :class:`SecondEnvError` naming ``what`` was being done in ``venv`` and how it failed."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SecondEnvError(f"building {venv} failed while {what}: `{' '.join(cmd)}` exited with "
                             f"{done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}\nfix the cause, or "
                             f"remove {venv} and run again")
    return done


def env_python(venv: Path, pins: str, after: Callable[[Path], str] | None = None, extras: str = "") -> Path:
    """The interpreter of ``venv`` with ``pins`` (requirements text: a ``torch==`` line and any others) and smp
    from this checkout, building it first when it is missing or its pins changed. ``after(python)`` runs once the
    packages are in and returns a line kept in the environment's marker; ``extras``: smp's extras to install
    (``"test"``: pytest, transformers)."""
    python, marker = venv / "bin" / "python", venv / ".smp-env"
    if python.exists() and marker.exists() and marker.read_text().startswith(pins):
        return python
    run([sys.executable, "-m", "venv", str(venv)], "creating the virtual environment", venv)
    torch_pin = next(line for line in pins.splitlines() if line.startswith("torch=="))
    pip = [str(python), "-m", "pip", "install", "-q"]
    if subprocess.run(pip + ["--no-index", "--no-deps", torch_pin], capture_output=True).returncode != 0 and \
            subprocess.run(pip + [torch_pin, "--index-url", TORCH_CPU_INDEX], capture_output=True).returncode != 0:
        run(pip + [torch_pin], f"installing {torch_pin} (not on disk, nor on PyTorch's CPU index)", venv)
    others = [line for line in pins.splitlines() if line.strip() and not line.startswith(("#", "torch=="))]
    run(pip + [*others, "-e", f"{ROOT}[{extras}]" if extras else str(ROOT)], f"installing {others} and smp", venv)
    done = after(python) if after else ""
    marker.write_text(pins + f"# {done}\n")
    return python
