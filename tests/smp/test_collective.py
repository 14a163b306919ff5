"""Collective smp calls say so: a rank that calls ``model.state_dict()`` (or ``smp.barrier``,
``smp.allgather``) while its peers are in another call, or in none, gets a clear error within ``timeout_s``
naming them; the peers stop too, naming it."""
from __future__ import annotations

import time

import pytest

from pipeline.p2p import FAILURE_KEY, PeerError
from smp.runtime.call_log import CallLog, CollectiveError
from smp.testing import run_ranks
from tests.smp.scripts import mlp_step, outcome


def _state_dict_on_rank_0(rank: int, world: int, others: str):
    model, step = mlp_step({"timeout_s": 2}, (8, 8, 2))
    step()
    if rank == 0:
        return outcome(model.state_dict)
    if others == "step":
        return outcome(step)
    time.sleep(4)  # not calling at all (the torch habit: only rank 0 saves)
    return "idle", "", 0.0


def test_state_dict_on_one_rank_while_the_other_steps():
    (kind0, msg0, t0), (kind1, msg1, t1) = run_ranks(_state_dict_on_rank_0, 2, "step", timeout=120)
    assert kind0 == "CollectiveError", msg0
    assert ("model.state_dict() is collective: it must be called on every rank of the pipeline (ranks [0, 1])"
            in msg0 and "rank 1 called @smp.step train_step instead" in msg0), msg0
    assert kind1 == "PeerError" and "rank 0 failed: CollectiveError: rank 0: model.state_dict() is collective" in msg1
    assert t0 < 2 and t1 < 4, (t0, t1)  # at once, not after the timeout


def test_state_dict_on_one_rank_while_the_other_does_not_call():
    (kind0, msg0, t0), _ = run_ranks(_state_dict_on_rank_0, 2, "nothing", timeout=120)
    assert kind0 == "CollectiveError", msg0
    assert "rank(s) [1] did not call it within 2 s (rank 1's last smp call: @smp.step train_step)" in msg0, msg0
    assert 2 <= t0 < 5, t0


def _collectives(rank: int, world: int):
    import smp

    model, step = mlp_step({"timeout_s": 5}, (8, 8, 2))
    step()
    sd = model.state_dict()  # on every rank: fine
    gathered = smp.allgather(rank)
    mismatch = outcome(smp.barrier if rank == 0 else lambda: smp.allgather(rank))
    return sorted(sd), gathered, mismatch


def test_collectives_called_everywhere_work_and_mismatches_fail_fast():
    r0, r1 = run_ranks(_collectives, 2, timeout=120)
    assert r0[0] == r1[0] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert r0[1] == r1[1] == [0, 1]
    # Both calls check before they communicate, so each side names the other's call at once.
    (kind0, msg0, t0), (kind1, msg1, t1) = r0[2], r1[2]
    assert kind0 == "CollectiveError" and "rank 1 called smp.allgather() instead" in msg0, msg0
    assert kind1 in ("CollectiveError", "PeerError") and "smp.barrier()" in msg1, msg1
    assert t0 < 3 and t1 < 3, (t0, t1)


class _Store:
    """An in-memory stand-in for the default store (its set/multi_get/check/get)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.data[k] for k in keys]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]


def test_call_log_protocol():
    store = _Store()
    a, b = (CallLog("pipeline", [0, 1], r, store, 0.05) for r in (0, 1))
    for log in (a, b):  # same calls in the same order: no waiting once both are there
        log.announce("@smp.step train_step")
    b.announce("smp.barrier()")
    a.check("smp.barrier()")
    assert a.explain(1) == "" and b.explain(0) == ""
    b.announce("@smp.step train_step")  # b went on to a step that a has not entered
    assert a.explain(1) == ("rank 1 is not in smp.barrier() (call #2 on the pipeline): its last smp call is "
                            "#3 @smp.step train_step")
    with pytest.raises(CollectiveError, match=r"rank 0: smp.allgather\(\) is collective: .* rank 1 called "
                                              r"@smp.step train_step instead$"):
        a.check("smp.allgather()")
    b.announce("smp.barrier()")
    b.announce("smp.barrier()")
    with pytest.raises(CollectiveError, match=r"rank 1 called smp.barrier\(\) instead \(its call #5, this is #4\)"):
        a.check("smp.barrier()")
    # A peer that never gets there: named, with its last call, after the timeout.
    c0, c1 = (CallLog("world", [0, 1], r, store, 0.05) for r in (0, 1))
    with pytest.raises(CollectiveError, match=r"rank\(s\) \[0\] did not call it within 0.05 s \(rank 0's last smp "
                                              r"call: smp.init\(\)\)"):
        c1.check("smp.barrier()")
    # A failure elsewhere ends the wait with the failure note.
    store.data[FAILURE_KEY] = b"rank 0 failed: ValueError: boom"
    with pytest.raises(PeerError, match="rank 1: smp.barrier.. on the world .0, 1. failed: rank 0 failed: ValueError"):
        c1.check("smp.barrier()")
    assert CallLog("data-parallel", [3], 3, store, 1.0).store is None  # a group of one checks nothing
