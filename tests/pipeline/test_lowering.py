"""Lowering (pipeline/lowering.py): sends and receives become actions that the executor, the simulator and the
FIFO check all read."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.lowering import fifo_violations, lower, transfers
from pipeline.schedule import Action, Schedule, ScheduleError, make_schedule, one_f_one_b
from pipeline.simulate import compute_only, simulate, validate


def test_comm_actions_print_and_parse() -> None:
    for text in ("SEND_F3@s1->s2", "RECV_F3@s2<-s1", "SEND_B0@s2->s1", "RECV_B0@s1<-s2", "W4@s0"):
        assert str(Action.parse(text)) == text
    assert Action.parse("SEND_F3@s1->s2") == Action("SEND_F", 1, 3, 2)
    for bad in ("SEND_F3@s1<-s2", "F3@s1->s2", "RECV_B3@s1"):
        with pytest.raises(ValueError, match="cannot parse action"):
            Action.parse(bad)


def test_one_f_one_b_on_two_ranks_lowers_as_expected() -> None:
    lowered = lower(one_f_one_b(2, 2))
    assert [str(a) for a in lowered.actions[0]] == [
        "F0@s0", "SEND_F0@s0->s1", "RECV_B0@s0<-s1", "F1@s0", "SEND_F1@s0->s1", "RECV_B1@s0<-s1", "B0@s0", "B1@s0"]
    # Each receive is posted one communicating action ahead: F1's before B0 runs (the last stage's B
    # receives nothing).
    assert [str(a) for a in lowered.actions[1]] == [
        "RECV_F0@s1<-s0", "F0@s1", "RECV_F1@s1<-s0", "B0@s1", "SEND_B0@s1->s0", "F1@s1", "B1@s1", "SEND_B1@s1->s0"]
    assert lower(one_f_one_b(2, 2), lookahead=0).actions[1][:2] == [Action("RECV_F", 1, 0, 0), Action("F", 1, 0)]


names = st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved-virtual"])


@settings(max_examples=40, deadline=None)
@given(name=names, p=st.integers(1, 5), m=st.integers(1, 8), lookahead=st.integers(0, 3))
def test_lowered_schedules_are_valid_and_time_like_their_compute(name, p, m, lookahead) -> None:
    v = 2 if name == "interleaved-virtual" else 1
    m = m * p if v > 1 else m
    base = make_schedule(name, p, m, virtual_stages=v)
    lowered = lower(base, lookahead=lookahead)
    validate(lowered)
    assert compute_only(lowered).actions == base.actions
    edges = p * v - 1
    sends = sum(a.kind.startswith("SEND") for o in lowered.actions for a in o)
    remote = sum(1 for s in range(edges) if lowered.stage_to_rank[s] != lowered.stage_to_rank[s + 1])
    assert sends == 2 * remote * m  # every cross-rank edge: activations forward, gradients back
    a = simulate(base, [1.0] * (p * v), [2.0] * (p * v), comm_s=0.5)
    b = simulate(lowered, [1.0] * (p * v), [2.0] * (p * v), comm_s=0.5)
    assert a.step_s == b.step_s and len(b.events) == sum(map(len, base.actions))


def _replace(schedule: Schedule, rank: int, order: list[str]) -> Schedule:
    actions = [list(o) for o in schedule.actions]
    actions[rank] = [Action.parse(a) for a in order]
    return Schedule(schedule.name, schedule.num_ranks, schedule.num_stages, schedule.microbatches,
                    schedule.stage_to_rank, actions, schedule.split_backward, lowered=True)


def test_validate_rejects_misplaced_or_missing_transfers() -> None:
    lowered = lower(one_f_one_b(2, 1))
    order = [str(a) for a in lowered.actions[1]]
    assert order == ["RECV_F0@s1<-s0", "F0@s1", "B0@s1", "SEND_B0@s1->s0"]
    with pytest.raises(ScheduleError, match=r"RECV_F0@s1<-s0 comes after F0@s1, which needs what it receives"):
        validate(_replace(lowered, 1, ["F0@s1", "RECV_F0@s1<-s0", "B0@s1", "SEND_B0@s1->s0"]))
    with pytest.raises(ScheduleError, match=r"SEND_B0@s1->s0 comes before B0@s1"):
        validate(_replace(lowered, 1, ["RECV_F0@s1<-s0", "F0@s1", "SEND_B0@s1->s0", "B0@s1"]))
    with pytest.raises(ScheduleError, match=r"1 transfer\(s\) missing: SEND_B0@s1->s0"):
        validate(_replace(lowered, 1, ["RECV_F0@s1<-s0", "F0@s1", "B0@s1"]))
    with pytest.raises(ScheduleError, match=r"appears twice"):
        validate(_replace(lowered, 1, order + ["SEND_B0@s1->s0"]))


def test_transfers_and_fifo_read_the_lowered_lists() -> None:
    lowered = lower(one_f_one_b(2, 2))
    sent, received = transfers(lowered)
    assert sent[0, 1] == received[0, 1] == ["activation mb0 s0->s1", "activation mb1 s0->s1"]
    assert sent[1, 0] == received[1, 0] == ["gradient mb0 s1->s0", "gradient mb1 s1->s0"]
    bad = _replace(lowered, 1, ["RECV_F1@s1<-s0", "RECV_F0@s1<-s0", "F0@s1", "B0@s1", "SEND_B0@s1->s0",
                                "F1@s1", "B1@s1", "SEND_B1@s1->s0"])  # microbatch 1's receive posted first
    validate(bad)  # fine with tagged transports...
    assert fifo_violations(bad) == [  # ...but not for NCCL's in-order matching
        "rank 0 -> rank 1: message #0 sent is activation mb0 s0->s1 but the receiver expects activation mb1 s0->s1"
    ]
