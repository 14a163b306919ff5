"""``benchmarks/tensor_parallel.py``: a tiny run prints both tables with every layout, the layouts computing the same
first-step loss, tp2's ranks holding half of dp2's parameter state, and the load average. Slow: two ranks build and
train three layouts of a GPT-2."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.cli.helpers import REPO, smp_env


@pytest.mark.slow
def test_a_tiny_run_prints_every_layout_and_the_memory_per_rank() -> None:
    done = subprocess.run([sys.executable, "benchmarks/tensor_parallel.py", "--rounds", "2", "--warmup", "1",
                           "--layers", "2", "--hidden", "64", "--vocab", "2048", "--seq", "32", "--no-pin"], cwd=REPO,
                          env=dict(smp_env(), OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    out = done.stdout
    for layout in ("pp2", "tp2", "dp2"):
        row = rf"^{layout}(\s+\d+){{2}}\s+\d+\.\d{{3}}(\s+\d+){{3}}\s+\d+\.\d\s+\d+\.\d\d\s+\d+\.\d{{6}}$"
        assert re.search(row, out, re.M), out
        for rank in (0, 1):
            assert re.search(rf"^{layout}\s+{rank}\s+\d+\s+\d+\s+\d+\.\d\s+\d+\.\d\s+\S", out, re.M), out
    assert "first-step losses agree" in out, out
    found = re.search(r"tp2 / dp2 parameters \+ gradients \+ Adam state per rank: (\d\.\d+)", out)
    assert found and 0.45 < float(found.group(1)) <= 0.55, out
    assert out.count("load average") == 2, out
