"""``benchmarks/step_model.py``: a short run prints each model's predicted and measured step and the verdict, the
fit, and smp plan's best layouts run beside its prices. Slow: it trains models on two ranks and plans twice."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.cli.helpers import REPO, smp_env


@pytest.mark.slow
def test_a_short_run_prints_predicted_beside_measured_and_the_plans_layouts_run() -> None:
    done = subprocess.run([sys.executable, "benchmarks/step_model.py", "--models", "mlp", "gpt2", "--steps", "2",
                           "--repeats", "2", "--fit", "--plan", "--plan-model", "mlp", "--plan-top", "2", "--no-pin"],
                          cwd=REPO,
                          env=dict(smp_env(), OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    out = done.stdout
    for model in ("mlp", "gpt2"):
        for cut in ("timed", "cost model"):  # the median of two runs, then each run's error
            row = rf"^{model}\s+{cut}\s+\d+\.\d\d\s+\d+\.\d\d\s+[+-]\d+\.\d%\s+(yes|NO)\s+[+-]\d+% [+-]\d+%$"
            assert re.search(row, out, re.M), out
    assert re.search(r"best fit: pass_overhead_s = \d\.\d\de-0\d, step_overhead_s = \d\.\d\de-0\d", out), out
    # smp plan's two best layouts, each priced and run, for each of two plannings
    # (the schedule may be followed by more of the layout's choices: ", ckpt", ", offload")
    row = r"^pp\d tp\d dp\d sdp\d.*, \d+ x \d+, \S+(?:, \S+)* +\d +\d+\.\d ms +\d+\.\d ms +[+-]\d+\.\d%  (yes|NO)"
    assert len(re.findall(row, out, re.M)) >= 2, out
    for repeat in (1, 2):
        assert re.search(rf"^planning {repeat}: smp plan's choice pp\d.* measured \d+\.\d ms; the fastest of its 2: ",
                         out, re.M), out
    assert "load average" in out
