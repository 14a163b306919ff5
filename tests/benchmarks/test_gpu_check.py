"""``benchmarks/gpu_check.py`` (``make gpu-check``): its CPU half prints the header and a table with every check, none
FAILing (the CUDA-only checks SKIP with their reason), within its time budget."""
from __future__ import annotations

import re
import subprocess
import sys

from benchmarks.gpu_checks import CHECKS
from tests.cli.helpers import REPO, smp_env


def test_the_cpu_half_prints_every_check_and_no_fail() -> None:
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu"], cwd=REPO,
                          env=dict(smp_env(), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""),
                          capture_output=True, text=True, timeout=300)
    out = done.stdout
    assert done.returncode == 0, f"exit {done.returncode}\n{out}\n{done.stderr[-4000:]}"
    assert re.search(r"^date \d{4}-\d\d-\d\d .*, torch \S+, device CPU .*, load average", out, re.M), out
    assert re.search(r"^check\s+device\s+measured\s+expected/predicted\s+ratio/error\s+status$", out, re.M), out
    for name in CHECKS:
        assert re.search(rf"^{name}\s+cpu\s+.*\s(PASS|SKIP \(.+\)) \[\d+\.\d s\]$", out, re.M), (name, out)
    for name in ("memory", "nvml"):  # CUDA only: skipped, and saying why
        assert re.search(rf"^{name}\s+.*SKIP \(needs CUDA\)", out, re.M), out
    assert not re.search(r"FAIL (\(|\[)", out), out  # a FAIL status: "FAIL (reason)" or "FAIL [n s]"
    assert re.search(r"^total \d+\.\d s of a 420 s budget; 6 of 6 checks without FAIL$", out, re.M), out
