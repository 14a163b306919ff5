"""Checkpoint at step k, restart in new processes, resume: identical to the uninterrupted run."""
from __future__ import annotations

import glob
import os

from smp.spawn import run_ranks
from tests.smp.scripts import train

CFG = {"pipeline_parallel_degree": 2, "microbatches": 2}


def test_resume_is_identical(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    whole = run_ranks(train, 2, CFG, "gpt2", 4, 8, timeout=240)
    run_ranks(train, 2, CFG, "gpt2", 4, 8, ckpt, None, 1, timeout=240)          # steps 0-1, save, exit
    files = sorted(os.path.basename(f) for f in glob.glob(ckpt + "*"))
    assert files == ["ckpt.model_0_0", "ckpt.model_1_0", "ckpt.opt_0_0", "ckpt.opt_1_0"], files
    assert not glob.glob(str(tmp_path / ".smp-*")), "temporary files left behind"
    resumed = run_ranks(train, 2, CFG, "gpt2", 4, 8, ckpt, 2, None, timeout=240)  # new processes, steps 2-3
    # The partial checkpoint carries the plan, so a restart cuts the model the same way even when its
    # cost calibration (measured per process) would have chosen another plan.
    for w, r in zip(whole, resumed):
        assert r["losses"] == w["losses"][2:]          # bit for bit: same ops, same order
        assert r["param_rel_err"] == w["param_rel_err"]
