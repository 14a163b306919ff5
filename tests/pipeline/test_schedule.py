"""Schedules as data: generators produce valid, deadlock-free, memory-bounded schedules; validate
pinpoints broken ones."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.lowering import fifo_violations
from pipeline.schedule import (
    SCHEDULE_NAMES,
    Action,
    Schedule,
    ScheduleError,
    gpipe,
    interleaved,
    make_schedule,
    one_f_one_b,
    peak_in_flight,
    stage_edges,
    zero_bubble_h1,
)
from pipeline.simulate import validate

ranks = st.integers(1, 8)
microbatches = st.integers(1, 16)
fast = settings(max_examples=60, deadline=None)


@st.composite
def skip_deps(draw: st.DrawFn, num_stages: int) -> list[tuple[int, int]]:
    """The chain plus random skip edges (s, t), t > s + 1, as from residual connections."""
    skips = [(s, t) for s in range(num_stages) for t in range(s + 2, num_stages)]
    extra = draw(st.lists(st.sampled_from(skips), unique=True, max_size=6)) if skips else []
    return [(s, s + 1) for s in range(num_stages - 1)] + extra


def fb_only(schedule: Schedule) -> list[list[Action]]:
    return [[a for a in order if a.kind != "W"] for order in schedule.actions]


# ---------------------------------------------------------------- generators: properties


@fast
@given(p=ranks, m=microbatches, v=st.integers(1, 3), data=st.data())
def test_every_generator_validates_under_skip_edges(p: int, m: int, v: int, data: st.DataObject) -> None:
    deps = data.draw(skip_deps(p))
    for schedule in (gpipe(p, m), one_f_one_b(p, m), zero_bubble_h1(p, m)):
        validate(schedule, deps)
    m_virtual = p * ((m + p - 1) // p)  # interleaved needs m % p == 0
    schedule = interleaved(p, m_virtual, v)
    assert schedule.num_stages == p * v
    assert schedule.stage_to_rank == [s % p for s in range(p * v)]
    assert schedule.stages_of(0) == list(range(0, p * v, p))
    validate(schedule, data.draw(skip_deps(p * v)))


@fast
@given(p=ranks, m=microbatches)
def test_every_pass_scheduled_once_on_its_rank(p: int, m: int) -> None:
    schedule = zero_bubble_h1(p, m)
    scheduled = [(rank, a) for rank, order in enumerate(schedule.actions) for a in order]
    expected = [Action(k, s, mb) for k in "FBW" for s in range(p) for mb in range(m)]
    assert sorted(a for _, a in scheduled) == sorted(expected)
    assert all(schedule.stage_to_rank[a.stage] == rank for rank, a in scheduled)


@fast
@given(p=ranks, m=microbatches)
def test_1f1b_holds_at_most_p_minus_s(p: int, m: int) -> None:
    assert peak_in_flight(one_f_one_b(p, m)) == [min(p - s, m) for s in range(p)]


@fast
@given(p=ranks, m=microbatches)
def test_gpipe_holds_all_microbatches(p: int, m: int) -> None:
    assert peak_in_flight(gpipe(p, m)) == [m] * p


@fast
@given(p=ranks, m=microbatches, cap=st.integers(1, 10))
def test_max_in_flight_caps_activations(p: int, m: int, cap: int) -> None:
    assert peak_in_flight(one_f_one_b(p, m, max_in_flight=cap)) == [min(p - s, m, cap) for s in range(p)]


@fast
@given(p=ranks, m=microbatches)
def test_zb_h1_keeps_1f1b_memory(p: int, m: int) -> None:
    zb, base = zero_bubble_h1(p, m), one_f_one_b(p, m)
    assert zb.split_backward and not base.split_backward
    assert all(z <= b for z, b in zip(peak_in_flight(zb), peak_in_flight(base)))
    assert fb_only(zb) == base.actions  # W's are only inserted, F/B order is 1F1B's


@fast
@given(p=ranks, m=microbatches)
def test_interleaved_with_one_chunk_is_1f1b(p: int, m: int) -> None:
    one, base = interleaved(p, m, 1), one_f_one_b(p, m)
    assert (one.actions, one.stage_to_rank, one.num_stages) == (base.actions, base.stage_to_rank, base.num_stages)


@fast
@given(p=ranks, m=microbatches)
def test_gpipe_and_1f1b_are_fifo_on_a_chain(p: int, m: int) -> None:
    assert fifo_violations(gpipe(p, m)) == []
    assert fifo_violations(one_f_one_b(p, m)) == []


def test_interleaved_round_robin_order() -> None:
    # p=2, v=2: rank 0 runs chunk 0 (stage 0) for microbatches 0, 1, then chunk 1 (stage 2) for 0, 1.
    schedule = interleaved(2, 4, 2)
    assert [str(a) for a in schedule.actions[0][:4]] == ["F0@s0", "F1@s0", "F0@s2", "F1@s2"]
    assert [a.stage for a in schedule.actions[0] if a.kind == "B"][:4] == [2, 2, 0, 0]


# ---------------------------------------------------------------- API details


def test_action_str_and_parse_round_trip() -> None:
    action = Action("F", 1, 3)
    assert str(action) == "F3@s1"
    assert Action.parse("F3@s1") == action
    with pytest.raises(ValueError, match="'X3@s1'"):
        Action.parse("X3@s1")


def test_make_schedule_names() -> None:
    assert make_schedule("simple", 2, 4).actions == gpipe(2, 4).actions
    assert make_schedule("interleaved", 3, 4).name == "1f1b"  # SMP calls 1F1B "interleaved"
    assert make_schedule("1f1b", 3, 4, max_in_flight=1).actions == one_f_one_b(3, 4, 1).actions
    assert make_schedule("interleaved-virtual", 2, 4, virtual_stages=2).num_stages == 4
    assert make_schedule("zero-bubble", 2, 4).name == "zb-h1"
    expected = {"gpipe", "simple", "1f1b", "interleaved", "interleaved-virtual", "zb-h1", "zero-bubble"}
    assert set(SCHEDULE_NAMES) == expected


def test_make_schedule_rejects_unknown_and_misapplied_options() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'.*gpipe.*zb-h1"):
        make_schedule("pipedream", 2, 4)
    with pytest.raises(ValueError, match="virtual_stages=2 only applies to 'interleaved-virtual'"):
        make_schedule("1f1b", 2, 4, virtual_stages=2)
    with pytest.raises(ValueError, match="max_in_flight=2 only applies"):
        make_schedule("gpipe", 2, 4, max_in_flight=2)


def test_generator_argument_errors() -> None:
    with pytest.raises(ValueError, match="microbatches=6, num_ranks=4: use 4 or 8 microbatches"):
        interleaved(4, 6, 2)
    with pytest.raises(ValueError, match="max_in_flight must be a positive integer, got 0"):
        one_f_one_b(2, 4, max_in_flight=0)
    with pytest.raises(ValueError, match="num_ranks must be a positive integer, got 0"):
        gpipe(0, 4)


def test_stage_edges() -> None:
    assert stage_edges(3) == [(0, 1), (1, 2)]
    with pytest.raises(ScheduleError, match=r"edge \(2, 1\) is invalid: need 0 <= producer < consumer < num_stages=3"):
        stage_edges(3, [(2, 1)])
    with pytest.raises(ScheduleError, match=r"lists edge \(0, 1\) twice"):
        stage_edges(3, [(0, 1), (0, 1)])


# ---------------------------------------------------------------- validate: broken schedules


def broken(schedule: Schedule, rank: int, order: list[str]) -> Schedule:
    """``schedule`` with rank ``rank``'s list replaced by the given action names."""
    actions = [list(o) for o in schedule.actions]
    actions[rank] = [Action.parse(a) for a in order]
    return Schedule(schedule.name, schedule.num_ranks, schedule.num_stages, schedule.microbatches,
                    schedule.stage_to_rank, actions, schedule.split_backward)


def test_validate_reports_missing_action() -> None:
    with pytest.raises(ScheduleError, match=r"1 action\(s\) never scheduled: B1@s0"):
        validate(broken(gpipe(2, 2), 0, ["F0@s0", "F1@s0", "B0@s0"]))


def test_validate_reports_missing_weight_grad() -> None:
    zb = zero_bubble_h1(2, 2)
    order = [str(a) for a in zb.actions[1] if str(a) != "W1@s1"]
    with pytest.raises(ScheduleError, match="never scheduled: W1@s1.*one W"):
        validate(broken(zb, 1, order))


def test_validate_reports_duplicate() -> None:
    with pytest.raises(ScheduleError, match=r"more than once: F1@s0 at \(rank, index\) \[\(0, 1\), \(0, 2\)\]"):
        validate(broken(gpipe(2, 2), 0, ["F0@s0", "F1@s0", "F1@s0", "B0@s0", "B1@s0"]))


def test_validate_reports_action_on_wrong_rank() -> None:
    message = "F0@s1 belongs to stage 1, which lives on rank 1; move it to rank 1's list"
    with pytest.raises(ScheduleError, match=message):
        validate(broken(gpipe(2, 1), 0, ["F0@s0", "F0@s1", "B0@s0"]))


def test_validate_reports_weight_grad_without_split() -> None:
    with pytest.raises(ScheduleError, match="set split_backward=True to use W"):
        validate(broken(gpipe(1, 1), 0, ["F0@s0", "B0@s0", "W0@s0"]))


def test_validate_reports_out_of_range() -> None:
    with pytest.raises(ScheduleError, match=r"F5@s0 is out of range \(num_stages=2, microbatches=2\)"):
        validate(broken(gpipe(2, 2), 0, ["F0@s0", "F1@s0", "F5@s0", "B0@s0", "B1@s0"]))


def test_validate_reports_same_rank_misorder() -> None:
    zb = zero_bubble_h1(1, 1)  # F0 B0 W0 -> W before its B
    message = r"deadlock cycle: rank 0 index 1 W0@s0 waits for B0@s0 \(later on the same rank, index 2\)"
    with pytest.raises(ScheduleError, match=message):
        validate(broken(zb, 0, ["F0@s0", "W0@s0", "B0@s0"]))


def test_validate_reports_cross_rank_deadlock() -> None:
    # Rank 0 wants B0 back before sending F1, while rank 1 wants F1 before it runs B0.
    bad = broken(gpipe(2, 2), 0, ["F0@s0", "B0@s0", "F1@s0", "B1@s0"])
    with pytest.raises(ScheduleError) as info:
        validate(bad)
    assert str(info.value) == (
        "deadlock cycle: rank 0 index 1 B0@s0 waits for B0@s1 (on rank 1, index 2); "
        "rank 1 index 1 F1@s1 waits for F1@s0 (on rank 0, index 2); 2 rank(s) stuck in all; "
        "reorder the per-rank lists so each action's dependencies run before it"
    )


def test_validate_names_the_cycle_not_the_queue() -> None:
    # The last rank runs its list backwards; the 15 ranks queued behind it are not the cause.
    schedule = gpipe(16, 4)
    schedule.actions[15].reverse()
    message = r"cycle: rank 15 index 0 B3@s15 waits for F3@s15 \(later on the same rank, index 4\); 16 rank"
    with pytest.raises(ScheduleError, match=message):
        validate(schedule)


def test_validate_follows_the_given_stage_deps() -> None:
    # Stage 0 runs B0 before F1; only stages fed by stage 0 whose B0 waits on F1 close the cycle.
    actions = [
        ["F0@s0", "B0@s0", "F1@s0", "B1@s0"],
        ["F0@s1", "B0@s1", "F1@s1", "B1@s1"],
        ["F0@s2", "F1@s2", "B0@s2", "B1@s2"],
    ]
    schedule = Schedule("custom", 3, 3, 2, [0, 1, 2], [[Action.parse(a) for a in o] for o in actions], False)
    validate(schedule, [(0, 1)])
    validate(schedule, [])  # independent stages
    with pytest.raises(ScheduleError, match="rank 0 index 1 B0@s0 waits for B0@s2"):
        validate(schedule, [(0, 1), (0, 2)])  # the skip edge makes B0@s0 wait for stage 2


def test_validate_checks_header() -> None:
    s = gpipe(2, 2)
    with pytest.raises(ScheduleError, match="stage_to_rank has 1 entries but num_stages=2"):
        validate(Schedule(s.name, 2, 2, 2, [0], s.actions, False))
    with pytest.raises(ScheduleError, match="actions has 1 per-rank lists but num_ranks=2"):
        validate(Schedule(s.name, 2, 2, 2, [0, 1], s.actions[:1], False))


def test_fifo_violation_is_reported_not_fatal() -> None:
    # Rank 1 takes microbatch 1 before 0: fine with tagged transports, wrong for NCCL's in-order matching.
    bad = broken(gpipe(2, 2), 1, ["F1@s1", "F0@s1", "B0@s1", "B1@s1"])
    validate(bad)
    assert fifo_violations(bad) == [
        "rank 0 -> rank 1: message #0 sent is activation mb0 s0->s1 but the receiver expects activation mb1 s0->s1"
    ]
