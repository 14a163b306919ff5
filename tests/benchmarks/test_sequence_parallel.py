"""``benchmarks/sequence_parallel.py`` on its smallest shape (the Llama, 2 layers of hidden 256, 1 x 1,024 tokens):
with sequence parallelism a tp2 rank holds fewer activations than without it, and ``smp inspect --tp 2
[--sequence-parallel]`` predicts each within 2 % (the issue's bar is 25 %; every storage is accounted for) and the
saving too: the predicted on/off ratio within 0.02 of the measured one. Slow: two ranks trace and train the model
twice (16 to 40 s on a shared 2-core machine)."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.cli.helpers import REPO, smp_env

ROW = re.compile(r"^llama\s+(off|on)\s+(\d+\.\d\d)\s+(\d+\.\d\d)\s+(\d+\.\d\d)\s+(\d+\.\d{3})\s+\d+\s+\d+\s+", re.M)
RATIOS = re.compile(r"^llama\s+on/off: saved (\d+\.\d{3}), peak \d+\.\d{3}, predicted (\d+\.\d{3})$", re.M)


@pytest.mark.slow
def test_sequence_parallelism_holds_fewer_activations_per_rank_as_predicted() -> None:
    done = subprocess.run([sys.executable, "benchmarks/sequence_parallel.py", "--models", "llama", "--layers", "2",
                           "--hidden", "256", "--seq", "1024", "--batch", "1"], cwd=REPO,
                          env=dict(smp_env(), OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    out = done.stdout
    rows = {m.group(1): [float(v) for v in m.groups()[1:]] for m in ROW.finditer(out)}
    assert set(rows) == {"off", "on"}, out
    (saved_off, peak_off, _, _), (saved_on, peak_on, _, _) = rows["off"], rows["on"]
    assert saved_on < saved_off and peak_on < peak_off, out
    for sp, (_, _, _, ratio) in rows.items():
        assert 0.98 <= ratio <= 1.02, f"sp {sp}: predicted / measured {ratio}\n{out}"
    ratios = RATIOS.search(out)
    assert ratios, out
    saved, predicted = (float(v) for v in ratios.groups())
    assert abs(predicted - saved) <= 0.02, f"sp on/off: measured {saved}, predicted {predicted}\n{out}"
    assert out.count("load average") == 2, out
