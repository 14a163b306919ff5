"""``benchmarks/end_to_end.py``: its ``--quick`` run prints the table, and every variant (our plan, torch's
pipelining, the equal-layer and equal-parameter splits, the SMP script) computes the single-process loss on the same
weights.
The quick run is slow (two ranks trace and split a GPT-2 twice); the 1F1B ideal is checked in the default run."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.cli.helpers import REPO, smp_env

LOSSES = re.compile(r"^\s+losses: (.*)$", re.M)


def test_ideal_step_is_1f1b_with_free_communication() -> None:
    from benchmarks.end_to_end import ideal_step

    # 2 stages, 4 microbatches, forward 1 s and backward 2 s on each: (m + p - 1) (f + b) = 5 * 3.
    assert ideal_step([1.0, 1.0], [2.0, 2.0], 4) == pytest.approx(15.0)
    # The slower stage sets the pace: m (f + b) of it, plus the other stage's work once.
    assert ideal_step([1.0, 2.0], [2.0, 4.0], 4) == pytest.approx(4 * 6.0 + 3.0)


@pytest.mark.slow
def test_quick_run_prints_the_table_and_every_variant_computes_the_single_process_loss() -> None:
    done = subprocess.run([sys.executable, "benchmarks/end_to_end.py", "--quick", "--no-pin"], cwd=REPO,
                          env=dict(smp_env(), OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    out = done.stdout
    assert "(a) ours" in out and "(b) torch" in out and "(e) single" in out and "(f) smp" in out
    assert "load average" in out
    row = next(line for line in out.splitlines() if line.startswith("gpt2 "))
    assert len(re.findall(r"\d+\.\d ms", row)) == 7, row  # six variants and the ideal, none failed
    assert "could not split" not in out and "MISSED" not in out, out
    (found,) = LOSSES.findall(out)
    losses = {k: float(v) for k, v in (item.split() for item in found.split(", "))}
    assert set(losses) == {"ours", "torch", "ours/layers", "ours/params", "single", "smp"}
    for name, value in losses.items():
        assert value == pytest.approx(losses["single"], rel=1e-5), (name, losses)
