"""smp.engine.planning.pipeline_runner: trace, partition on rank 0, share the plan, keep this rank's tensors, run.
A model with pipe_split() markers runs its markers' stages on fewer ranks as interleaved virtual stages, through
pipeline_runner and through smp.DistributedModel and @smp.step, exactly as in one process."""
from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.pipelining import pipe_split

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


# --- pipe_split() markers on fewer ranks: interleaved virtual stages ---------------------------------------------


class Marked(torch.nn.Module):
    """An MLP in four pieces, cut by three pipe_split() markers as torch.distributed.pipelining's examples are."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 32), torch.nn.Linear(32, 32),
                                           torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
            pipe_split()
        return self.layers[-1](x)


def _marked(seed: int = 0) -> Marked:
    torch.manual_seed(seed)
    return Marked()


def _batch(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=g), torch.randint(4, (8,), generator=g)


def _reference(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, m: int) -> tuple[list[float], torch.Tensor]:
    """One process: the microbatches' losses, and the gradients of their mean left in ``net``; and its outputs."""
    net.zero_grad()
    losses = [F.cross_entropy(net(xm), ym) for xm, ym in zip(x.chunk(m), y.chunk(m))]
    (sum(losses) / m).backward()
    return [float(v.detach()) for v in losses], net(x).detach()


def _grad_errors(model: torch.nn.Module, reference: torch.nn.Module) -> list[str]:
    """Every held parameter whose gradient differs from the reference's (rtol 1e-5), as assert_close words it."""
    ref = dict(reference.named_parameters())
    errors = []
    for name, p in model.named_parameters():
        if p.grad is None and not p.is_meta:
            errors.append(f"{name}: no gradient")
        elif not p.is_meta:  # the other ranks' stages' parameters are released
            try:
                torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-5, atol=1e-7, msg=name)
            except AssertionError as exc:
                errors.append(str(exc))
    return errors


def _virtual_runner(rank: int, world: int) -> dict:
    from smp.engine.planning import pipeline_runner

    x, y = _batch()
    out = {}
    for m in (2, 4):
        model, reference = _marked(), _marked()
        runner = pipeline_runner(model, (x[:8 // m],), microbatches=m, timeout_s=60)
        got = runner.step((x,), target=y, loss_fn=F.cross_entropy)
        want, outputs = _reference(reference, x, y, m)
        out[m] = {"losses": got.losses, "want": want, "grads": _grad_errors(model, reference),
                  "outputs": None if got.outputs is None else float((got.outputs - outputs).abs().max() /
                                                                    outputs.abs().max()),
                  "schedule": (runner.schedule.name, runner.schedule.num_stages),
                  "local": [st.index for st in runner.local_stages],
                  "note": runner.plan.summary().splitlines()[-1]}
        runner.close()
    return out


def test_pipe_split_markers_stages_train_exactly_on_two_ranks_through_pipeline_runner():
    """Three markers, two ranks: four stages, two per rank (0 and 2, 1 and 3) under the interleaved virtual schedule,
    the losses, outputs and gradients of one process, for 2 and 4 microbatches."""
    for rank, r in enumerate(run_ranks(_virtual_runner, 2, timeout=180)):
        for got in r.values():
            assert got["schedule"] == ("interleaved", 4) and got["local"] == [rank, rank + 2], got
            assert got["note"] == ("4 stages from the model's 3 pipe_split() markers, 2 per rank on 2 ranks "
                                   "(interleaved virtual stages)"), got["note"]
            torch.testing.assert_close(got["losses"], got["want"], rtol=1e-5, atol=0)
            assert not got["grads"], got["grads"]
            assert (got["outputs"] is None) == (rank == 0) and (rank == 0 or got["outputs"] < 1e-5), got


def _three_ranks(rank: int, world: int) -> str:
    from smp.engine.planning import pipeline_runner

    try:
        pipeline_runner(_marked(), (torch.randn(2, 16),), microbatches=3, timeout_s=60)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_markers_whose_stages_three_ranks_cannot_share_stop_every_rank_naming_the_counts():
    for message in run_ranks(_three_ranks, 3, timeout=120):
        assert message.startswith("the model's 3 pipe_split() marker(s) make 4 stages, which a pipeline of 3 ranks "
                                  "cannot share"), message
        assert "to make 3 or 6 stages (2 or 5 markers), or use a pipeline degree that divides 4 (1, 2 or 4)" in message


def _virtual_step(rank: int, world: int) -> dict:
    import smp
    from smp.runtime import state
    from tests.smp.features import loss_and_outputs_step

    def setup(m: int, seed: int = 0):
        state.reset()
        smp.init({"pipeline_parallel_degree": 2, "microbatches": m})
        model = smp.DistributedModel(_marked(seed))
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        return model, opt, loss_and_outputs_step()

    out: dict = {}
    x, y = _batch()
    for m in (2, 4):
        model, opt, train_step = setup(m)
        reference = _marked()
        printed = io.StringIO()
        with contextlib.redirect_stderr(printed):
            losses, outputs = train_step(model, x, y)
        want, ref_out = _reference(reference, x, y, m)
        out[m] = {"losses": [float(v) for v in losses.outputs], "want": want, "grads": _grad_errors(model.module,
                  reference), "outputs": float((outputs.concat() - ref_out).abs().max() / ref_out.abs().max()),
                  "printed": printed.getvalue(), "local": [st.index for st in model.runner.local_stages],
                  "schedule": (model.runner.schedule.name, model.runner.schedule.num_stages)}
    # A partial checkpoint of the virtual stages, loaded before a new model's first step: it trains on exactly.
    opt.step()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    saved, full = model.local_state_dict(), model.state_dict()
    out["full"] = max(float((full[k] - v).abs().max()) for k, v in reference.state_dict().items())
    model, opt, train_step = setup(4, seed=1)
    model.load_state_dict(saved)
    x, y = _batch(1)
    losses, _ = train_step(model, x, y)
    want, _ = _reference(reference, x, y, 4)
    out["resumed"] = {"losses": [float(v) for v in losses.outputs], "want": want,
                      "grads": _grad_errors(model.module, reference),
                      "note": model.partition_plan().summary().splitlines()[-1]}
    return out


def test_pipe_split_markers_stages_train_exactly_on_two_ranks_through_smp_step():
    """pipeline_parallel_degree 2 and three markers: smp.DistributedModel runs the four stages two per rank, says so
    when it partitions, trains as one process does, and its partial checkpoint resumes on the same placement."""
    for rank, r in enumerate(run_ranks(_virtual_step, 2, timeout=240)):
        for m in (2, 4):
            got = r[m]
            assert got["schedule"] == ("interleaved", 4) and got["local"] == [rank, rank + 2], got
            torch.testing.assert_close(got["losses"], got["want"], rtol=1e-5, atol=0)
            assert not got["grads"] and got["outputs"] < 1e-5, got
            assert got["printed"] == ("smp: 4 stages from the model's 3 pipe_split() markers, 2 per rank on 2 ranks "
                                      "(interleaved virtual stages)\n" if rank == 0 else ""), got["printed"]
        assert r["full"] < 1e-6, r["full"]
        torch.testing.assert_close(r["resumed"]["losses"], r["resumed"]["want"], rtol=1e-5, atol=0)
        assert not r["resumed"]["grads"] and "2 per rank on 2 ranks" in r["resumed"]["note"], r["resumed"]


def test_virtual_stages_run_under_the_interleaved_schedule_and_others_are_refused_with_the_fix():
    import partitioner
    from smp.engine.planning import on_ranks, plan_ranks, stages_per_rank

    plan = partitioner.partition(partitioner.trace(_marked(), (torch.randn(2, 16),)), 4)
    assert [stages_per_rank(plan, p, 4, None, "") for p in (2, 4, 1)] == [2, 1, 4]
    assert stages_per_rank(plan, 2, 4, "interleaved-virtual", "") == 2
    assert plan_ranks(plan) == 4 and plan_ranks(on_ranks(plan, 2)) == 2 and on_ranks(plan, 4) is plan
    with pytest.raises(ValueError) as gpipe:
        stages_per_rank(plan, 2, 4, "simple", "use the config's pipeline 'interleaved', or pipeline_parallel_degree="
                                              "{stages}")
    assert str(gpipe.value) == (
        "the plan has 4 stages from the model's 3 pipe_split() markers, 2 per rank on 2 ranks (interleaved virtual "
        "stages), which run under the 'interleaved-virtual' schedule, but the schedule asked for is 'simple', which "
        "runs one stage per rank: use the config's pipeline 'interleaved', or pipeline_parallel_degree=4")
    with pytest.raises(ValueError, match=r"in rounds of 2: microbatches=3 is not a multiple of 2; use 2 or 4 micro"):
        stages_per_rank(plan, 2, 3, None, "")
