"""The rules on constructed profiles: each fires on its case, with its numbers, and stays quiet on a
balanced run. (The same cases from real runs: tests/smp/test_profiling.py.)"""
from __future__ import annotations

import dataclasses

import pytest

from pipeline.timeline import Event
from smp.profiling.measurements import measure
from smp.profiling.rules import RULES, Thresholds, evaluate
from tests.smp import synthetic_profile as sp


@pytest.fixture(scope="module")
def plan():
    return sp.plan_of()[0]


def _balanced(plan, scale: float = 1.0):
    """Measured stage costs in the plan's proportions (as planned, or ``scale`` times that)."""
    return {"forward_s": [s.forward_s * scale for s in plan.stages],
            "backward_s": [s.backward_s * scale for s in plan.stages]}


def fired(m, **thresholds):
    return {f.rule: f for f in evaluate(m, Thresholds(**thresholds)) if f.fired}


def test_a_balanced_run_fires_nothing(plan):
    findings = evaluate(measure(*sp.make(plan, **_balanced(plan))))
    assert [f.rule for f in findings][:8] == ["StageImbalance", "PlanDrift", "StepDrift", "Straggler", "StepOutlier",
                                              "DataBound", "CommBound", "Bubble"]
    assert not [f for f in findings if f.fired], [str(f) for f in findings]
    assert len(RULES) == 12  # and the system monitor's four: tests/smp/test_system_rules.py


def test_stage_imbalance_names_the_stages_and_their_modules(plan):
    f = fired(measure(*sp.make(plan, forward_s=[1e-3, 3e-3], backward_s=[2e-3, 6e-3])))["StageImbalance"]
    assert "stage 1 (" in f.summary and "1.50x the mean" in f.summary
    assert plan.stages[1].modules[-1] in f.summary and "smp replan" in f.recommendation
    assert f.numbers["slowest"] == 1 and f.numbers["fastest"] == 0


def test_plan_drift_sees_a_stage_the_cost_model_misjudged_not_a_uniformly_slower_device(plan):
    base = _balanced(plan, 3.0)
    assert "PlanDrift" not in fired(measure(*sp.make(plan, **base)))
    skewed = dict(base, backward_s=[base["backward_s"][0], base["backward_s"][1] * 3])
    f = fired(measure(*sp.make(plan, **skewed)))["PlanDrift"]
    assert f.numbers["stages"] and "trace_execution_times" in f.recommendation


def test_step_drift_says_the_predicted_step_missed_and_why(plan):
    """Every stage 3x slower than planned: the shares hold (PlanDrift quiet), the predicted step does not; the step
    model with the measured stage costs explains the run, so the advice is to time the ops. A step that loses
    time outside its passes gets the other advice."""
    f = fired(measure(*sp.make(plan, **_balanced(plan, 3.0))))["StepDrift"]
    assert f.numbers["ratio"] > 2 and abs(f.numbers["replayed_s"] / f.numbers["measured_s"] - 1) < 0.25
    assert f"{f.numbers['ratio']:.2f}x the" in f.summary
    assert "trace_execution_times=True" in f.recommendation and "smp replan" in f.recommendation
    timed = dataclasses.replace(plan, options={**plan.options, "measured": True})  # its ops were timed: stale times
    f = fired(measure(*sp.make(timed, **_balanced(timed, 3.0))))["StepDrift"]
    assert "SMP_RECALIBRATE=1" in f.recommendation and "trace_execution_times" not in f.recommendation
    assert "StepDrift" not in fired(measure(*sp.make(plan, **_balanced(plan, 1.2))))
    slow = fired(measure(*sp.make(plan, **_balanced(plan), slow={0: 3.0, 1: 3.0})), step_drift=0.25)
    assert "StepDrift" in slow or "PlanDrift" in slow


def test_straggler_needs_replicas_and_names_the_slow_rank(plan):
    base = _balanced(plan)
    assert "one pipeline" in evaluate(measure(*sp.make(plan, **base)))[3].summary
    f = fired(measure(*sp.make(plan, **base, replicas=2, slow={3: 1.5})))["Straggler"]
    assert f.numbers["ranks"] == [3] and "rank 3" in f.summary and "1.50x" in f.summary
    assert "Straggler" not in fired(measure(*sp.make(plan, **base, replicas=2, slow={3: 1.1})))


def test_step_outlier_says_which_phase_grew(plan):
    m = measure(*sp.make(plan, **_balanced(plan), steps=6, gap_s=1e-3, slow_steps={4: 0.1}))
    f = fired(m)["StepOutlier"]
    assert f.numbers["steps"] == [4] and f.numbers["phase"] == {4: "data"} and "data grew by" in f.summary


def test_a_first_step_that_partitions_is_an_outlier_outside_its_passes(plan):
    # smp partitions on the first step: a profile from step 0 sees it long, and not in any pass or wait.
    m = measure(*sp.make(plan, **_balanced(plan), steps=6, late_steps={0: 0.5}))
    f = fired(m)["StepOutlier"]
    assert f.numbers["phase"] == {0: "the time outside the passes"}, f.summary
    assert "step 0 (the run's first step, which traces and partitions the model)" in f.summary
    assert "the time outside the passes grew by 500.00 ms" in f.summary, f.summary


def test_data_bound_and_comm_bound(plan):
    m = measure(*sp.make(plan, **_balanced(plan), gap_s=0.05))
    f = fired(m)["DataBound"]
    assert sorted(f.numbers["ranks"]) == [0, 1] and "num_workers" in f.recommendation
    events, counters, info = sp.make(plan, **_balanced(plan))
    # Rank 0 posts each send for a long time: communication it spends instead of computing.
    long = [Event(0, f"SEND_F{k}@s0->s1", e.end, e.end + 0.02, "comm") for k, e in
            enumerate(e for e in events if e.rank == 0 and e.action.startswith("F"))]
    assert fired(measure(events + long, counters, info))["CommBound"].numbers["ranks"] == [0]


def test_bubble_compares_with_the_prediction(plan):
    m = measure(*sp.make(plan, **_balanced(plan)))
    assert "Bubble" not in fired(m)
    assert "Bubble" in fired(m, bubble=-0.5)  # a threshold below the prediction: the measured bubble exceeds it
    assert "(p - 1) / (m + p - 1)" in evaluate(m)[7].recommendation
