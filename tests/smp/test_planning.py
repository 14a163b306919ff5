"""smp.engine.planning.pipeline_runner: trace, partition on rank 0, share the plan, keep this rank's tensors, run."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from smp.testing import run_ranks


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 1024))


def _run(rank: int, world: int) -> dict:
    from smp.engine.planning import pipeline_runner

    x, y = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)), torch.arange(8) * 100
    want = sum(float(F.cross_entropy(_model()(x[i:i + 2]), y[i:i + 2])) for i in range(0, 8, 2)) / 4
    model = _model()
    # example inputs: one microbatch (x[:2] of 4); the step takes the whole batch
    priced = pipeline_runner(model, (x[:2],), microbatches=4, loss_fn=F.cross_entropy, target=y[:2], timeout_s=60)
    plain = pipeline_runner(_model(), (x[:2],), microbatches=4, timeout_s=60)
    out = lambda r: r.plan.graph.flops[r.plan.graph.kinds.index("output")]  # noqa: E731
    loss = priced.step((x,), target=y, loss_fn=F.cross_entropy).loss
    held = sorted(n for n, p in model.named_parameters() if not p.is_meta)
    for r in (priced, plain):
        r.close()
    return {"loss": loss, "want": want, "priced": out(priced), "plain": out(plain), "held": held}


def test_pipeline_runner_prices_the_loss_it_is_given_and_trains_this_ranks_share():
    got = run_ranks(_run, 2, timeout=120)
    for r in got:
        assert abs(r["loss"] - r["want"]) < 1e-5 * abs(r["want"]), r
        assert r["priced"] >= 5 * 2 * 1024 and r["plain"] == 0, r
    assert got[0]["held"] and got[1]["held"] and not set(got[0]["held"]) & set(got[1]["held"])



def _smp_offload(rank: int, world: int) -> dict:
    import smp
    from tests.smp.features import make_net, train

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "simple", "offload_activations": True,
              "activation_loading_horizon": 2})
    model, out = train(make_net(), 2, checkpoint="block1")
    offload = model.runner.offload
    out.update(horizon=offload.horizon, checkpointed=sorted(model.runner.executor.checkpointed),
               local=[st.index for st in model.runner.local_stages],
               packed=sorted({(e.stage, e.microbatch) for e in offload.events if e.kind == "pack"}))
    return out


def test_smp_config_offloads_the_checkpointed_activations_and_stays_exact():
    """``offload_activations`` with ``smp.set_activation_checkpointing``: the checkpointed stages' inputs of every
    microbatch go through host memory, and training equals a single process without either."""
    from tests.smp.features import assert_exact

    for r in run_ranks(_smp_offload, 2, timeout=180):
        assert_exact(r)
        assert r["horizon"] == 2 and r["checkpointed"], r
        assert r["packed"] == [(s, k) for s in r["local"] if s in r["checkpointed"] for k in range(4)], r


def _smp_training(rank: int, world: int, offload: bool) -> dict:
    import smp
    from tests.smp.features import make_net, train

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "simple",
              "offload_activations": offload, "activation_loading_horizon": 2})
    model, out = train(make_net(dropout=0.1), 2, checkpoint=("block1", "block2"))
    offloaded = model.runner.offload
    return {"losses": out["losses"], "params": {n: p.detach().clone() for n, p in model.local_named_parameters()},
            "horizon": offloaded.horizon if offloaded else None,
            "packed": sum(e.kind == "pack" for e in offloaded.events) if offloaded else 0}


@pytest.mark.slow
def test_smp_config_offloading_trains_bit_for_bit_as_without_it():
    """``offload_activations`` with ``smp.set_activation_checkpointing`` (dropout on): the same losses and weights
    as without, bit for bit, and the checkpointed stages' inputs went through host memory."""
    plain, offloaded = (run_ranks(_smp_training, 2, offload, timeout=180) for offload in (False, True))
    for want, got in zip(plain, offloaded):
        assert got["losses"] == want["losses"] and want["packed"] == 0 and want["horizon"] is None
        assert got["horizon"] == 2 and got["packed"] >= 4, got  # each of 4 microbatches, last step
        assert got["params"].keys() == want["params"].keys() and got["params"]
        for name, p in want["params"].items():
            torch.testing.assert_close(got["params"][name], p, rtol=0, atol=0, msg=name)


def _timed_after_every_trace(rank: int, world: int) -> dict:
    import time

    import smp.engine.planning as planning

    traced, partitioned = planning.trace, planning.partition
    stamps: dict = {}

    def slow_trace(*args, **kwargs):  # a peer whose trace takes a second longer
        graph = traced(*args, **kwargs)
        time.sleep(1.0 if rank == 1 else 0.0)
        stamps["traced"] = time.time()
        return graph

    def partition(*args, **kwargs):
        stamps["partitioning"] = time.time()
        return partitioned(*args, **kwargs)

    planning.trace, planning.partition = slow_trace, partition
    runner = planning.pipeline_runner(_model(), (torch.randn(2, 16),), microbatches=2, timeout_s=60)
    runner.close()
    return stamps


def test_rank_0_partitions_and_times_the_ops_once_every_rank_has_traced():
    # Timing ops beside a peer's trace would price them on a host shared with it.
    got = run_ranks(_timed_after_every_trace, 2, timeout=120)
    assert got[0]["partitioning"] >= got[1]["traced"] > got[0]["traced"] + 0.5, got
