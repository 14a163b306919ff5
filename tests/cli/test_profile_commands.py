"""``smp report DIR`` and ``smp replan DIR -o FILE`` on a profile, and their one-line errors."""
from __future__ import annotations

import json

import pytest

from tests.cli.helpers import check_png, ok, one_line_error, smp
from tests.smp import synthetic_profile as sp


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
    """A profile whose second stage took three times its plan: imbalanced, misjudged."""
    plan, graph = sp.plan_of()
    fwd = [s.forward_s for s in plan.stages]
    bwd = [s.backward_s for s in plan.stages]
    fwd[1] *= 3
    bwd[1] *= 3
    return sp.write(tmp_path_factory.mktemp("prof"), *sp.make(plan, forward_s=fwd, backward_s=bwd), graph=graph)


def test_report_writes_markdown_and_pngs_and_prints_the_rules(profile_dir, tmp_path):
    out = ok(smp("report", profile_dir, "-o", str(tmp_path / "rep")))
    assert "StageImbalance: FIRED" in out and "Bubble: " in out and "-> " in out
    text = (tmp_path / "rep" / "report.md").read_text()
    for heading in ("## Rules", "## Step time", "## Where each rank's step goes", "## Stage costs",
                    "## One step, measured and predicted", "## Memory and profiling cost"):
        assert heading in text
    for name in ("steps.png", "ranks.png", "costs.png", "timeline.png"):
        check_png(tmp_path / "rep" / name)


def test_replan_writes_a_plan_that_moves_work_off_the_slow_stage(profile_dir, tmp_path):
    out = ok(smp("replan", profile_dir, "-o", str(tmp_path / "plan.json")))
    assert "re-planned" in out and "partition_file" in out
    new = json.loads((tmp_path / "plan.json").read_text())
    old = json.loads(open(f"{profile_dir}/profile.json").read())["plan"]
    assert sum(new["assignment"].values()) < sum(old["assignment"].values())  # fewer ops on stage 1


def test_errors_are_one_line(tmp_path):
    one_line_error(smp("report", str(tmp_path)), "holds no profile")
    one_line_error(smp("replan", str(tmp_path), "-o", str(tmp_path / "p.txt")), "must end in .json")
    one_line_error(smp("replan", str(tmp_path)), "-o")


def test_report_draws_the_cpu_heatmap_and_prints_the_system_rules(tmp_path):
    """A data-bound run whose cores the ranks' workers saturate: CPUBottleneck on the terminal, the heatmap."""
    plan, graph = sp.plan_of()
    events, counters, info = sp.make(plan, forward_s=[s.forward_s for s in plan.stages],
                                     backward_s=[s.backward_s for s in plan.stages], gap_s=0.05)
    counters += sp.monitor(events, info, busy=99.0, ranks_cores=0.2, children=4, children_cores=0.9, gpu_util=30.0)
    directory = sp.write(tmp_path / "prof", events, counters, info, graph=graph)
    out = ok(smp("report", directory, "-o", str(tmp_path / "rep")))
    assert "CPUBottleneck: FIRED" in out and "LowGPUUtilization: FIRED" in out and "MemoryGrowth: ok" in out
    for name in ("cpu_heatmap.png", "gpu.png"):
        check_png(tmp_path / "rep" / name)
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "## System" in text and "![cpu](cpu_heatmap.png)" in text and "| 0 | h | 2 | 99 |" in text
