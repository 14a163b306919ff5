"""What ``smp.init`` sets up for reliability: one timeout (config ``timeout_s``, else ``SMP_TIMEOUT_S``) for
every wait and collective of smp, and failures that reach every rank, naming the rank that failed first."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F

from smp.config import DEFAULT_TIMEOUT_S, ConfigError, load_config
from tests.smp.scripts import MANUAL, two_stage_mlp
from tests.spawn import run_ranks


def test_timeout_comes_from_config_then_environment(monkeypatch):
    monkeypatch.delenv("SMP_TIMEOUT_S", raising=False)
    assert load_config({"partitions": 2}).timeout_s == DEFAULT_TIMEOUT_S == 60
    monkeypatch.setenv("SMP_TIMEOUT_S", "600")
    assert load_config({"partitions": 2}).timeout_s == 600
    assert load_config({"partitions": 2, "timeout_s": 90}).timeout_s == 90  # the config wins
    monkeypatch.setenv("SMP_TIMEOUT_S", "ten minutes")
    with pytest.raises(ConfigError, match="SMP_TIMEOUT_S='ten minutes' is not valid: a number of seconds"):
        load_config({"partitions": 2})
    with pytest.raises(ConfigError, match="'timeout_s'=0 is not valid: a positive number of seconds"):
        load_config({"partitions": 2, "timeout_s": 0})


def _pause(rank: int, world: int, env: str, config_timeout: float | None, pause: float):
    """Two steps with a pause on rank 0 in between (evaluation, a slow disk), while rank 1 waits in the step."""
    import smp

    os.environ["SMP_TIMEOUT_S"] = env
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 2, **MANUAL}
    if config_timeout is not None:
        cfg["timeout_s"] = config_timeout
    smp.init(cfg)
    model = smp.DistributedModel(two_stage_mlp(16, 16, 4))

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    x, y = torch.randn(8, 16), torch.randint(4, (8,))
    train_step(model, x, y)
    if rank == 0:
        time.sleep(pause)
    t0 = time.monotonic()
    try:
        train_step(model, x, y)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0


def test_pause_longer_than_the_timeout_fails_and_passes_once_raised():
    # SMP_TIMEOUT_S=1.5 stands for the default: rank 1 gives up on rank 0 after 1.5 s, naming it.
    out = run_ranks(_pause, 2, "1.5", None, 4.0, timeout=120, allow_failure=True)
    kind, msg, elapsed = out[1]
    assert kind == "PeerError" and "with rank 0 failed: no answer within 1.5 s" in msg, out
    assert "rank 0 is not in @smp.step train_step" in msg and "raise timeout_s" in msg, msg
    assert elapsed < 5, out
    # Raised in the config (which wins over the environment), the same pause is just a pause.
    out = run_ranks(_pause, 2, "1.5", 20.0, 4.0, timeout=120)
    assert [r[0] for r in out] == ["ok", "ok"], out


def _dp_peer_dies(rank: int, world: int):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, "timeout_s": 20, **MANUAL})
    model = smp.DistributedModel(two_stage_mlp(16, 16, 4))

    @smp.step
    def train_step(model, x, y, die):
        loss = F.cross_entropy(model(x), y)
        if die and smp.rank() == 3:
            os._exit(3)  # the last stage of replica 1 goes away mid-step, as a crashed process does
        model.backward(loss)
        return loss

    x, y = torch.randn(8, 16), torch.randint(4, (8,))
    train_step(model, x, y, False)
    t0 = time.monotonic()
    try:
        train_step(model, x, y, True)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


def test_data_parallel_rank_whose_peer_dies_reports_it():
    out = run_ranks(_dp_peer_dies, 4, timeout=150, allow_failure=True)
    assert out[3].startswith("FAILED: rank 3 exited with code 3"), out
    for rank in (0, 1, 2):
        kind, msg, elapsed = out[rank]
        # Rank 0 waits for rank 2 in the gradient all-reduce, rank 1 for rank 3: each names rank 3, at once
        # (the first rank to see the death closes smp's groups) rather than after the 20 s timeout.
        assert kind == "PeerError" and "rank 3" in msg, (rank, out)
        assert "closed the connection" in msg or "died or hung" in msg, (rank, msg)
        assert elapsed < 12, (rank, out)
