"""``smp demo``: GPT-2's plan, its simulated schedule as text, and pipelined training (slow)."""
from __future__ import annotations

import os
import re

import pytest

from tests.cli.helpers import ok, smp


@pytest.mark.slow
def test_demo_prints_plan_schedule_and_trains() -> None:
    out = ok(smp("demo", timeout=600))
    assert "GPT-2" in out and "lower bound" in out and "simulated schedule" in out
    assert re.search(r"rank  0 \|[0-9a-j.]+\|", out) and re.search(r"rank  1 \|[0-9a-j.]+\|", out)
    losses = [float(x) for x in re.findall(r"step\s+\d+/\d+\s+loss ([0-9.]+)", out)]
    assert len(losses) == 8 and losses[-1] < losses[0], out
    # It ends with the report of its own profiled training: every rule's verdict.
    assert all(f"{rule}: " in out for rule in ("StageImbalance", "PlanDrift", "Bubble")) and "report: " in out
    # The run trained the plan printed: the report measures the step against the prediction printed above.
    predicted = re.search(r"predicted step ([0-9.]+ ms)", out)
    assert predicted and f"the {predicted.group(1)} the plan predicted" in out, out


def test_the_demo_trains_the_bundled_example() -> None:
    """The training half of the demo runs examples/train_gpt2.py: the path must survive moving the command."""
    from smp.cli.commands.demo import TRAIN_SCRIPT

    assert TRAIN_SCRIPT.endswith("examples/train_gpt2.py") and os.path.isfile(TRAIN_SCRIPT), TRAIN_SCRIPT
