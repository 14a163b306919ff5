"""smp.testing.run_ranks: ranks run in the caller's environment and folder as of the call, their store outlives a
rank that ended (as torchrun's agent holds it), and a failure comes back as its traceback."""
from __future__ import annotations

import os
import time

import pytest

from smp.testing import run_ranks


def _where(rank: int, world: int) -> tuple[str | None, str, int]:
    import torch

    return os.environ.get("SMP_TESTING_PROBE"), os.getcwd(), torch.get_num_threads()


def test_each_call_runs_in_the_callers_environment_and_folder_of_that_moment(tmp_path, monkeypatch):
    monkeypatch.setenv("SMP_TESTING_PROBE", "first")
    assert run_ranks(_where, 2)[1][0] == "first"
    # A later call with another environment and folder: ranks forked from a server started earlier see them too.
    monkeypatch.setenv("SMP_TESTING_PROBE", "second")
    monkeypatch.chdir(tmp_path)
    assert run_ranks(_where, 2) == [("second", str(tmp_path), 1)] * 2


def _leave_then_read(rank: int, world: int) -> str | None:
    from pipeline.p2p import default_store

    store = default_store()
    if rank == 0:
        store.set("why", "rank 0 stopped: no data")
        return None
    time.sleep(1.0)  # rank 0 has ended by now
    return store.get("why").decode()


def test_the_store_outlives_a_rank_that_ended():
    assert run_ranks(_leave_then_read, 2, timeout=60) == [None, "rank 0 stopped: no data"]


def _fails_on_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("bad shard 7")
    return rank


def test_a_failing_rank_comes_back_as_its_traceback():
    got = run_ranks(_fails_on_1, 2, allow_failure=True)
    assert got[0] == 0 and got[1].startswith("FAILED") and "ValueError: bad shard 7" in got[1]
    with pytest.raises(AssertionError, match="(?s)rank 1:.*ValueError: bad shard 7"):
        run_ranks(_fails_on_1, 2)
