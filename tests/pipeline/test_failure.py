"""A rank that raises, dies or hangs mid-step makes the others stop with an error naming it, in bounded
time — never a silent hang."""
from __future__ import annotations

import os
import time

import pytest
import torch

from smp.testing import run_ranks


def _mlp_runner(timeout_s: float):
    from partitioner import DeviceRates, partition, trace
    from pipeline import PipelineRunner

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    plan = partition(trace(model, (x[:2],)), 2, rates=DeviceRates())
    return PipelineRunner(plan, schedule="1f1b", microbatches=4, timeout_s=timeout_s), x, y


def _fail(rank: int, world: int, how: str):
    from pipeline import PeerError

    runner, x, y = _mlp_runner(timeout_s=4.0)

    def loss_fn(out, target):
        if rank == 1 and loss_fn.calls == 2:
            if how == "raise":
                raise ValueError("boom in the loss")
            if how == "die":
                os._exit(3)
            if how == "hang":
                # Hang well past the peers' 4 s timeout, then go away rather than make the test wait it out.
                time.sleep(12)
                os._exit(4)
        loss_fn.calls += 1
        return torch.nn.functional.mse_loss(out, target)

    loss_fn.calls = 0
    t0 = time.monotonic()
    try:
        runner.step((x,), target=y, loss_fn=loss_fn)
    except PeerError as exc:
        return ("PeerError", str(exc), time.monotonic() - t0)
    except ValueError as exc:
        return ("ValueError", str(exc), time.monotonic() - t0)
    return ("ok", "", time.monotonic() - t0)


@pytest.mark.parametrize("how,limit", [("raise", 3.0), ("die", 3.0),
                                       pytest.param("hang", 15.0, marks=pytest.mark.slow)])
def test_peer_failure_is_reported_in_bounded_time(how, limit):
    out = run_ranks(_fail, 2, how, timeout=90, allow_failure=True)
    kind, message, elapsed = out[0]
    assert kind == "PeerError", out
    assert "rank 1" in message, message
    if how == "raise":
        assert "ValueError: boom in the loss" in message
        assert out[1][0] == "ValueError"
    if how == "hang":
        assert "within 4 s" in message
    assert elapsed < limit, f"rank 0 took {elapsed:.1f} s to notice"
