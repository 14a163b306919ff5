"""Every published revision of SageMaker's public SMP v1 scripts (GPT-2, BERT, MNIST) runs on smp with its import
lines unchanged: reductions of each revision (tests/smp/smp_v1_reductions, registry in tests/smp/smp_v1_public.py)
through ``smp launch --as-smdistributed``, with their notebooks' settings on two ranks, and their stop/resume paths."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=120)


def test_the_alias_has_smps_test_helpers_by_name() -> None:
    """The BERT script's ``from smdistributed.modelparallel.test.torch.utils import dump_model, verify`` imports;
    calling one says what it was."""
    done = _python("""
        import smp
        smp.alias_smdistributed()
        from smdistributed.modelparallel.test.torch.utils import dump_model, verify
        try:
            verify()
        except NotImplementedError as exc:
            print(exc)
    """)
    assert done.returncode == 0, done.stderr
    assert "verify was one of SMP's internal test helpers" in done.stdout
