"""``benchmarks/sdp_vs_fsdp.py``: a tiny run prints both rows, each exact against one process with FSDP2's state
per rank, and the collectives per step: the bytes FSDP2 gathers, one unit more (the embedding alone; FSDP2's root
unit holds it with the head) and one all-reduce more (the global gradient norm). Slow: two runs of two ranks, and an
``smp plan``."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.cli.helpers import REPO, smp_env


@pytest.mark.slow
def test_a_tiny_run_is_exact_and_moves_fsdp2s_bytes() -> None:
    done = subprocess.run([sys.executable, "benchmarks/sdp_vs_fsdp.py", "--rounds", "1", "--steps", "1", "--layers",
                           "2", "--hidden", "64", "--intermediate", "128", "--vocab", "512", "--seq", "16", "--batch",
                           "4", "--no-pin"], cwd=REPO, env=dict(smp_env(), OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    out = done.stdout
    rows = {}
    for name in ("smp sdp", "fsdp2"):
        found = re.search(rf"^{name}\s+[\d.]+\s+[\d.]+x\s+(\S+)\s+(\S+)\s+([\d.]+)\s+all-gather (\d+) / ([\d.]+), "
                          rf"reduce-scatter (\d+) / ([\d.]+), all-reduce (\d+)", out, re.M)
        assert found, out
        rows[name] = found.groups()
    ours, fsdp = rows["smp sdp"], rows["fsdp2"]
    assert float(ours[0]) < 1e-5 and float(ours[1]) < 1e-5, ours  # loss and parameters as one process's
    assert ours[2] == fsdp[2], (ours, fsdp)  # the same state per rank
    # 4 units (embedding, 2 layers, norm + head) forward, the 2 layers again backward, the last unit kept whole;
    # FSDP2: 3 units forward (its root holds embedding, norm and head), the 2 layers again
    assert (ours[3], ours[4]) == ("6", fsdp[4]) and fsdp[3] == "5", (ours, fsdp)
    assert (ours[5], fsdp[5]) == ("4", "3") and ours[6] == fsdp[6], (ours, fsdp)
    assert (ours[7], fsdp[7]) == ("2", "1"), (ours, fsdp)  # the loss's average; and our global gradient norm
    assert "smp plan's step for the smp run's layout" in out and out.count("load average") == 2, out
