"""The oldest torch the package accepts (``torch>=X.Y`` in pyproject.toml) is tested, not assumed: a second
environment (:mod:`tests.second_env`, ``.venv-floor``) with exactly release X.Y.0 runs the default cases of the
exactness tests of every axis: pipelines under every schedule, pp x dp, tensor parallelism, sharded data parallelism
and checkpoints.

The floor is where those pass. Below it: torch 2.7 and 2.8 sum on gloo where an average is asked for
(``ReduceOp.AVG``, pytorch/pytorch#162338), so a 2-rank FSDP2 run gets gradients 2x the reference, silently, and
2.6's FSDP machinery fails on a CPU stream (``'Stream' object has no attribute 'record_event'``). Slow: building the
environment alone takes minutes (PyPI's torch on Linux is the CUDA build, several GB, which runs on the CPU too).
"""
from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.second_env import ROOT, env_python

FLOOR_FILES = ("tests/pipeline/test_exactness.py", "tests/smp/test_training.py", "tests/smp/test_tp_training.py",
               "tests/smp/test_sharded_dp.py", "tests/smp/test_checkpoint.py")


def floor() -> str:
    """The torch release pyproject.toml accepts at the least (``"2.9"`` of ``torch>=2.9``)."""
    found = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert found, "pyproject.toml's dependencies must name torch as a range with a floor (torch>=X.Y)"
    return found.group(1)


def test_the_floor_is_the_one_the_set_up_names():
    """README and the Makefile tell a user which torch the package keeps; they say what pyproject.toml says."""
    for doc in ("README.md", "Makefile"):
        assert f"torch>={floor()}" in (ROOT / doc).read_text(), f"{doc} names another floor than torch>={floor()}"


@pytest.mark.slow
def test_the_oldest_accepted_torch_trains_exactly_on_every_axis():
    release = floor() + ".0" * (2 - floor().count("."))
    python = env_python(ROOT / ".venv-floor", f"torch=={release}\n", extras="test")
    version = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True,
                             text=True, check=True).stdout.strip()
    assert version.split("+")[0] == release, f"the floor environment has torch {version}, not {release}"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *FLOOR_FILES], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, f"torch {version}:\n{done.stdout[-6000:]}{done.stderr[-2000:]}"
