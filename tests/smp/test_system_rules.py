"""The system monitor's rules on constructed profiles (CPUBottleneck, IOBottleneck, LowGPUUtilization,
MemoryGrowth): each fires on its case with its numbers, and stays quiet where the samples prove nothing.
(The same from real runs: tests/smp/test_profiling.py.)"""
from __future__ import annotations

import pytest

from smp.profiling.measurements import measure
from smp.profiling.rules import RULES, Thresholds, evaluate
from tests.smp import synthetic_profile as sp

SYSTEM = ["CPUBottleneck", "IOBottleneck", "LowGPUUtilization", "MemoryGrowth"]


@pytest.fixture(scope="module")
def plan():
    return sp.plan_of()[0]


def _run(plan, *, gap_s=0.0, rss_step=0.0, **monitor):
    """Measurements of a balanced run (the plan's proportions) with the given monitor samples."""
    events, counters, info = sp.make(plan, forward_s=[s.forward_s for s in plan.stages],
                                     backward_s=[s.backward_s for s in plan.stages], gap_s=gap_s,
                                     rss_step=rss_step)
    return measure(events, counters + sp.monitor(events, info, **monitor), info)


def _findings(m, **thresholds):
    return {f.rule: f for f in evaluate(m, Thresholds(**thresholds))}


def test_the_system_rules_follow_the_pipeline_rules_and_a_healthy_run_fires_none(plan):
    # The ranks fill both cores (a healthy job on a small host) and the step never waits on data.
    m = _run(plan, busy=98.0, ranks_cores=1.95)
    assert [f.rule for f in evaluate(m)][-4:] == SYSTEM and len(RULES) == 12
    assert not [f for f in evaluate(m) if f.fired], [str(f) for f in evaluate(m)]
    assert m.system[0].core_busy.shape[1] == 2 and m.system[0].host == "h"


def test_cpu_bottleneck_needs_data_waits_and_cores_saturated_by_other_processes(plan):
    hot = dict(busy=99.0, ranks_cores=0.2, children=4, children_cores=0.9)
    f = _findings(_run(plan, gap_s=0.05, **hot))["CPUBottleneck"]
    assert f.fired and f.numbers["ranks"] == [0, 1]
    cpu = f.numbers["cpu"][0]
    assert cpu["busy"] == pytest.approx(0.99) and cpu["others_cores"] == pytest.approx(1.78)
    assert cpu["children"] == 8 and cpu["children_cores"] == pytest.approx(1.8)
    assert "8 child process(es)" in f.summary and "num_workers" in f.recommendation
    assert "pin_memory" in f.recommendation and "prefetch_factor" in f.recommendation
    # The same saturation without waiting on data: a busy host, not a bottleneck.
    assert not _findings(_run(plan, **hot))["CPUBottleneck"].fired
    # Waiting on data with the cores filled by the ranks themselves (their compute), or with idle cores.
    assert not _findings(_run(plan, gap_s=0.05, busy=99.0, ranks_cores=1.9))["CPUBottleneck"].fired
    assert not _findings(_run(plan, gap_s=0.05, busy=20.0, ranks_cores=0.2))["CPUBottleneck"].fired
    assert _findings(_run(plan, gap_s=0.05, **hot), cpu_busy=0.995)["CPUBottleneck"].fired is False


def test_io_bottleneck_fires_on_iowait_while_waiting_on_data(plan):
    f = _findings(_run(plan, gap_s=0.05, busy=10.0, iowait=40.0))["IOBottleneck"]
    assert f.fired and f.numbers["iowait"][0] == pytest.approx(0.4) and "40%" in f.summary
    assert f.numbers["disk_read_bytes_s"] == pytest.approx(5e6) and "local disk" in f.recommendation
    assert not _findings(_run(plan, busy=10.0, iowait=40.0))["IOBottleneck"].fired  # no data wait
    assert not _findings(_run(plan, gap_s=0.05, busy=10.0, iowait=2.0))["IOBottleneck"].fired


def test_low_gpu_utilization_degrades_to_quiet_without_gpu_samples(plan):
    f = _findings(_run(plan))["LowGPUUtilization"]
    assert not f.fired and "no GPU samples" in f.summary and "[gpu]" in f.summary
    f = _findings(_run(plan, gpu_util=20.0))["LowGPUUtilization"]
    assert f.fired and f.numbers["p95"] == {0: 0.2, 1: 0.2} and "Fake GPU" in f.summary
    assert not _findings(_run(plan, gpu_util=95.0))["LowGPUUtilization"].fired


def test_memory_growth_fires_on_rss_rising_every_step(plan):
    f = _findings(_run(plan, rss_step=8 * 2**20))["MemoryGrowth"]
    assert f.fired and f.numbers["ranks"] == [0, 1]
    assert f.numbers["per_step_bytes"]["0 rss_bytes"] == pytest.approx(8 * 2**20)
    assert "+8.00 MiB per step" in f.summary and "rising in 100%" in f.summary and ".item()" in f.recommendation
    assert not _findings(_run(plan, rss_step=2**19))["MemoryGrowth"].fired  # below 1 MiB per step


def test_the_rules_say_when_there_is_no_monitor(plan):
    events, counters, info = sp.make(plan, forward_s=[1e-3, 1e-3], backward_s=[2e-3, 2e-3], gap_s=0.05)
    found = _findings(measure(events, counters, info))
    assert "monitor_s" in found["CPUBottleneck"].summary and not found["CPUBottleneck"].fired
    assert not found["IOBottleneck"].fired and not found["MemoryGrowth"].fired
