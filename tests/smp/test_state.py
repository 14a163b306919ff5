"""What ``smp.init`` sets up for reliability: one timeout (config ``timeout_s``, else ``SMP_TIMEOUT_S``) for
every wait and collective of smp, and failures that reach every rank, naming the rank that failed first."""
from __future__ import annotations

import os
import time

import pytest

from smp.testing import run_ranks
from tests.smp.scripts import mlp_step, outcome


def _pause(rank: int, world: int, pause: float):
    """Two steps with a pause on rank 0 in between (evaluation, a slow disk) while rank 1 waits in the step:
    first with SMP_TIMEOUT_S=1.5 (standing for the default) raised in the config, then with it alone."""
    from smp.runtime import state

    os.environ["SMP_TIMEOUT_S"] = "1.5"
    outcomes = []
    for config in ({"timeout_s": 20.0}, {}):
        state.reset()  # a fresh smp on the same processes: new groups, with the new timeout
        _, step = mlp_step(config)
        step()
        if rank == 0:
            time.sleep(pause)
        outcomes.append(outcome(step))
    return outcomes


@pytest.mark.slow
def test_pause_longer_than_the_timeout_fails_and_passes_once_raised():
    (raised0, default0), (raised1, default1) = run_ranks(_pause, 2, 4.0, timeout=120)
    # Raised in the config (which wins over the environment), a 4 s pause is just a pause.
    assert raised0[0] == raised1[0] == "ok", (raised0, raised1)
    # With 1.5 s, rank 1 gives up on rank 0 and says where rank 0 is: not in the step yet.
    kind, msg, elapsed = default1
    assert kind == "PeerError" and "from pp_rank 0 failed: no answer within 1.5 s" in msg, msg
    assert "rank 0 is not in @smp.step train_step" in msg and "raise timeout_s" in msg, msg
    assert elapsed < 5, elapsed
    assert default0[0] == "PeerError" and "rank 0 stopped answering (rank 1: " in default0[1], default0  # the note


def _dp_peer_dies(rank: int, world: int):
    import smp

    dying = []

    def die() -> None:
        if dying and smp.rank() == 3:
            os._exit(3)  # the last stage of replica 1 goes away mid-step, as a crashed process does

    _, step = mlp_step({"ddp": True, "timeout_s": 20}, after_backward=die)
    step()
    dying.append(True)
    return outcome(step)


@pytest.mark.slow
def test_data_parallel_rank_whose_peer_dies_reports_it():
    out = run_ranks(_dp_peer_dies, 4, timeout=150, allow_failure=True)
    assert out[3].startswith("FAILED: rank 3 exited with code 3"), out
    for rank in (0, 1, 2):
        kind, msg, elapsed = out[rank]
        # Rank 0 waits for rank 2 in the gradient all-reduce, rank 1 for rank 3: each names rank 3, at once
        # (the first rank to see the death closes smp's groups) rather than after the 20 s timeout.
        assert kind == "PeerError" and "rank 3" in msg, (rank, out)
        assert "rank 3 closed the connection: it has likely died" in msg, (rank, msg)
        assert elapsed < 12, (rank, out)


def _closed_at_exit(rank: int, world: int) -> list[bool]:
    """One step, then what ``State.close`` (the exit handler smp.init registers) leaves of this process's groups."""
    import torch.distributed as dist

    from smp.runtime import state

    state.reset()
    _, step = mlp_step({})
    step()
    st = state.get()
    groups = [st.world_group, st.mp_group, st.model.runner.transport.group]
    st.close(default_group=False)  # the default group is the caller's here (run_ranks made it): kept
    names = {id(g) for g in dist.distributed_c10d._world.pg_names}
    return [id(g) in names for g in groups] + [dist.is_initialized()]


def test_smp_closes_its_groups_at_exit():
    """Left to the interpreter's teardown, a finished run sometimes aborted ("terminate called without an active
    exception"): smp.init registers State.close to run at exit, which destroys the pipeline's and smp's groups."""
    assert run_ranks(_closed_at_exit, 2, timeout=120) == [[False, False, False, True]] * 2
