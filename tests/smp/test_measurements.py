"""What a profile measured: stage costs, phases per step and rank, waits split into dependency and
transfer, the bubble, and the simulator's prediction beside them."""
from __future__ import annotations

import pytest

from pipeline.timeline import Event
from smp.profiling.measurements import ProfileError, load_profile, measure
from tests.smp import synthetic_profile as sp


@pytest.fixture(scope="module")
def plan():
    return sp.plan_of()[0]


def test_stage_costs_and_the_prediction_come_from_the_profile(plan):
    m = measure(*sp.make(plan, forward_s=[1e-3, 2e-3], backward_s=[2e-3, 4e-3]))
    assert m.stage_forward_s == pytest.approx([1e-3, 2e-3])
    assert m.stage_backward_s == pytest.approx([2e-3, 4e-3])
    assert m.steps == [0, 1, 2, 3, 4] and m.ranks == [0, 1]
    assert m.replayed.step_s == pytest.approx(m.phases[0, 0].step_s, rel=0.01)  # + the plan's transfer times
    assert m.predicted.step_s > 0 and m.planned_cost_s == pytest.approx(
        [s.forward_s + s.backward_s for s in plan.stages])
    # The measured bubble is the simulator's definition applied to the passes.
    assert m.bubble[2] == pytest.approx(m.replayed.bubble, abs=0.01)
    assert m.memory[0]["rss_bytes"] == 1e8


def test_gaps_between_steps_are_data_time_without_the_optimizer(plan):
    events, counters, info = sp.make(plan, forward_s=1e-3, backward_s=2e-3, gap_s=0.05)
    step1 = next(e for e in events if e.rank == 0 and e.action == "step 1")
    events.append(Event(0, "optimizer.step", step1.start - 0.02, step1.start - 0.01, "optimizer"))
    m = measure(events, counters, info)
    assert m.phases[1, 0].optimizer_s == pytest.approx(0.01)
    assert m.phases[1, 0].data_s == pytest.approx(0.04)
    assert m.phases[1, 1].data_s == pytest.approx(0.05)
    assert m.phases[0, 0].data_s == 0.0  # the first step of the window has no gap before it
    assert m.phases[1, 0].iteration_s == pytest.approx(0.05 + m.phases[1, 0].step_s)


def test_a_receive_wait_splits_into_dependency_and_transfer(plan):
    """A pass's compute excludes the wait nested in it; only the part of the wait after the peer sent is
    communication."""
    events = [Event(0, "step 0", 0.0, 1.0, "step"), Event(1, "step 0", 0.0, 1.0, "step"),
              Event(0, "F0@s0", 0.0, 0.3), Event(0, "SEND_F0@s0->s1", 0.3, 0.31, "comm"),
              Event(1, "F0@s1", 0.0, 0.5), Event(1, "wait F0@s1", 0.0, 0.4, "wait")]
    _, counters, info = sp.make(plan, forward_s=1.0, backward_s=1.0, steps=1)
    m = measure(events, counters, info)
    ph = m.phases[0, 1]
    assert ph.forward_s == pytest.approx(0.1) and ph.wait_s == pytest.approx(0.4)
    assert ph.comm_s == pytest.approx(0.1)  # waited from 0.3 (sent) to 0.4
    assert ph.idle_s == pytest.approx(0.8)
    assert m.phases[0, 0].comm_s == pytest.approx(0.01)


def test_a_directory_without_a_profile_says_how_to_make_one(tmp_path):
    with pytest.raises(ProfileError, match="holds no profile.*smp.profile"):
        load_profile(tmp_path)


def test_profiles_round_trip_through_their_files(plan, tmp_path):
    made = sp.make(plan, forward_s=[1e-3, 2e-3], backward_s=[2e-3, 4e-3])
    m = load_profile(sp.write(tmp_path, *made))
    assert m.stage_forward_s == pytest.approx([1e-3, 2e-3])
    assert len(m.events) == len(made[0])
