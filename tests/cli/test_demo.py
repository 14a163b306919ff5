"""``smp demo``: GPT-2's plan, its simulated schedule as text, and pipelined training (slow), written for a newcomer:
one plan table, its terms in plain words, the run against its prediction, every fired rule in plain terms."""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest

from tests.cli.helpers import REPO, ok, smp

TERMS = ("stage", "microbatch", "cut", "memory_weight", "bubble")


def _plan_tables(out: str) -> int:
    """How many stage tables (a header row 'stage ops params ...') the output prints."""
    return len(re.findall(r"^stage\s+ops\s+params\b", out, re.M))


def _explained_terms(out: str) -> dict[str, str]:
    """The 'in plain terms:' block under the plan: term -> its line."""
    block = out.split("in plain terms:\n", 1)[1].split("\n\n", 1)[0]
    return dict(re.findall(r"^  (\S+)\s+(.+)$", block, re.M))


@pytest.mark.slow
def test_the_demo_reads_as_one_plan_one_run_and_rules_in_plain_terms() -> None:
    """The plan, its schedule, 8 steps of falling loss and the profile's rules, as a newcomer reads them: one plan
    table (the training script used to print the plan again, in another format), the plan's terms in plain words,
    the steps that are not training said to be so, the checkpoint's purpose, the run against the prediction printed
    above without the first step, and under every rule that fired what it means."""
    out = ok(smp("demo", timeout=600))
    assert "GPT-2" in out and "lower bound" in out and "simulated schedule" in out
    assert re.search(r"rank  0 \|[0-9a-j.]+\|", out) and re.search(r"rank  1 \|[0-9a-j.]+\|", out)
    losses = [float(x) for x in re.findall(r"step\s+\d+/\d+\s+loss ([0-9.]+)", out)]
    assert len(losses) == 8 and losses[-1] < losses[0], out
    assert _plan_tables(out) == 1, out
    assert re.search(r"^partition plan: \S+plan\.json \(2 stages\)$", out, re.M), out
    assert set(_explained_terms(out)) == set(TERMS), out
    assert out.index("in plain terms:") < out.index("\nsimulated schedule, "), out  # where the terms first appear
    assert re.search(r"^step\s+1/8 .* s  \(the first step traces the model and builds its stages\)$", out, re.M)
    assert re.search(r"^step\s+8/8 .* s  \(and writes the profile\)$", out, re.M), out
    assert "to show that smp.save works" in out and "pass --out DIR to keep it" in out, out
    against = re.search(r"^the run against its prediction: the median step took ([0-9.]+ ms), ([0-9.]+)x the "
                        r"([0-9.]+ ms) the plan predicted", out, re.M)
    predicted = re.search(r"predicted step ([0-9.]+ ms)", out)
    assert against and predicted and against.group(3) == predicted.group(1), out
    assert "measured: steps 2-8 as the profile recorded them; not step 1" in out, out
    from smp.profiling.findings import PLAIN_TERMS

    rules = re.findall(r"^(\w+): (ok|FIRED): ", out, re.M)
    assert len(rules) >= 12 and {r for r, _ in rules} <= set(PLAIN_TERMS) and "report: " in out, rules
    for rule, verdict in rules:
        after = out.split(f"\n{rule}: {verdict}: ", 1)[1].split("\n")
        plain = [line for line in after[1:3] if line.startswith("  in plain terms: ")]
        assert (plain == [f"  in plain terms: {PLAIN_TERMS[rule]}"]) == (verdict == "FIRED"), (rule, out)


def test_the_plan_is_printed_once_with_its_terms_in_plain_words() -> None:
    """``smp demo --no-train``: the plan table, then one plain line for each of its terms, with this plan's
    numbers (the cut's bytes, the memory_weight, the predicted bubble), before the schedule that shows the bubble."""
    out = ok(smp("demo", "--no-train", "--quiet", timeout=300))
    assert _plan_tables(out) == 1, out
    terms = _explained_terms(out)
    assert set(terms) == set(TERMS), out
    cut = re.search(r"^cut ([0-9.]+ \w+) per microbatch", out, re.M).group(1)
    bubble = re.search(r"predicted step [0-9.]+ ms, bubble ([0-9.]+%)", out).group(1)
    assert f"({cut} per microbatch)" in terms["cut"] and "(0.2 here)" in terms["memory_weight"], terms
    assert f"({bubble} predicted here)" in terms["bubble"] and "'.': idle, the bubble" in out, out


def test_every_rule_has_plain_terms() -> None:
    """Every rule the profile's report can fire (each ``Finding("Name", ...)`` in smp/profiling) has a plain line,
    so that the demo never prints a fired rule without one."""
    from smp.profiling.findings import PLAIN_TERMS

    names = {n for path in (REPO / "smp" / "profiling").glob("*rules.py")
             for n in re.findall(r'Finding\("(\w+)"', path.read_text())}
    assert len(names) >= 12 and names == set(PLAIN_TERMS), names ^ set(PLAIN_TERMS)


def test_a_busy_machine_is_named_as_the_cause_of_a_slow_run() -> None:
    """When other processes kept cores busy while the ranks trained (the first run after an install measured 116
    ms against 61 ms predicted), the comparison says so and names the rules that follow from it; on a quiet
    machine it does not."""
    from types import SimpleNamespace

    from smp.cli.commands.demo import DemoRun, _against_prediction
    from smp.profiling.findings import Finding

    run = DemoRun(argparse.Namespace(), SimpleNamespace(partitions=2), print)
    findings = [Finding("StepDrift", True, "", numbers={"measured_s": 0.116, "predicted_s": 0.061, "ratio": 1.9}),
                Finding("CommBound", True, ""), Finding("Bubble", True, ""), Finding("StageImbalance", False, "")]
    run.host.update(others=0.98, cores=2.0)
    lines = _against_prediction(run, findings)
    assert lines[0] == ("the run against its prediction: the median step took 116.00 ms, 1.90x the 61.00 ms the "
                        "plan predicted (beyond the ±25% StepDrift allows)"), lines
    assert "other processes kept 0.98 of this machine's 2 cores busy" in lines[2], lines
    assert "(StepDrift, CommBound, Bubble below follow from that)" in lines[2], lines
    run.host.update(others=0.05)
    assert len(_against_prediction(run, findings)) == 2


def test_the_demo_trains_the_bundled_example() -> None:
    """The training half of the demo runs examples/train_gpt2.py: the path must survive moving the command."""
    from smp.cli.commands.demo import TRAIN_SCRIPT

    assert TRAIN_SCRIPT.endswith("examples/train_gpt2.py") and os.path.isfile(TRAIN_SCRIPT), TRAIN_SCRIPT
    assert Path(TRAIN_SCRIPT).read_text().count("def step_note") == 1  # the word on the steps that do more
