"""``benchmarks/health_overhead.py``: a short run prints the table with every configuration, each watched block
really watched (a profile written per monitored block), and the verdict line. Slow: two ranks train a GPT-2."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.cli.helpers import REPO, smp_env


@pytest.mark.slow
def test_a_short_run_prints_every_configuration_and_the_verdict() -> None:
    done = subprocess.run([sys.executable, "benchmarks/health_overhead.py", "--rounds", "2", "--steps", "2",
                           "--size", "small", "--no-pin"], cwd=REPO, env=dict(smp_env(), OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    out = done.stdout
    for mode in ("plain", "rules", "monitor", "both"):
        assert re.search(rf"^{mode}\s+\d+\.\d\s+\d+\.\d\s+[+-]\d+\.\d\d%$", out, re.M), out
    assert "4 profiles written by the monitored blocks" in out, out  # monitor and both, in each of 2 rounds
    assert re.search(r"rules every step \+ monitor at 200 ms: [+-]\d+\.\d\d % \(goal <= 3 %: (PASS|MISS)\)", out)
    assert "load average" in out
