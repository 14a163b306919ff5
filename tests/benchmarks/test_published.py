"""``benchmarks/published.py``: a calibration row and a held-out row priced on meta, each printed with its published
and predicted throughput and whether it is within 20 %. Slow: it traces two model shapes."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.cli.helpers import REPO, smp_env


@pytest.mark.slow
def test_two_rows_are_priced_and_within_the_goal() -> None:
    done = subprocess.run([sys.executable, "benchmarks/published.py", "--rows", "titan-8b-8,sc21-1.7B", "--no-search"],
                          cwd=REPO, env=dict(smp_env(), OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    for row in ("titan-8b-8", "sc21-1.7B"):
        line = rf"^ *{re.escape(row)} +\d+ +tp\d+ pp\d+ dp\d+ +\d+x\d+ +[\d,]+ +[\d,]+ +(\d\.\d\d) +yes"
        found = re.search(line, done.stdout, re.M)
        assert found and 0.8 <= float(found.group(1)) <= 1.2, done.stdout
