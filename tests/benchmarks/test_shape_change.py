"""``benchmarks/shape_change.py``: a tiny run prints the load average and a row per block (fixed, first step at a
new shape, steps while shapes change) with the time the first step spent making its stages."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.cli.helpers import REPO, smp_env


@pytest.mark.slow  # as the other benchmarks' tiny runs: 12 s of the default run; the shape cache's own tests stay
def test_a_tiny_run_prints_the_table() -> None:
    done = subprocess.run([sys.executable, "benchmarks/shape_change.py", "--size", "small", "--rounds", "1",
                           "--steps", "1", "--batch", "4", "--no-pin"], cwd=REPO,
                          env=dict(smp_env(), OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    out = done.stdout
    for block in ("fixed", "first", "changing"):
        assert re.search(rf"^{block}\s+\d+\.\d\s+\d+\.\d\s+\d+\.\d\dx$", out, re.M), out
    assert re.search(r"first step at a new shape: \d+\.\d ms of it make the stages", out), out
    assert out.count("load average") == 2, out
