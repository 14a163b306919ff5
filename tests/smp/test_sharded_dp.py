"""Sharded data parallelism (``sharded_data_parallel_degree``) on spawned ranks: an SMP v1 script matches a
single-process run of the same global batches, clipped as SMP clips (``sdp_gradient_clipping``), for sdp alone, under
pipelines, hybrid and with tensor parallelism; each rank holds only its shards; checkpoints resume bit-identical and
a full one loads into another layout; bad configs are refused with the fix."""
from __future__ import annotations

import copy
import os

import pytest
import torch
from torch.distributed.tensor import DTensor

from smp.testing import run_ranks
from tests.smp.scripts import build, train

SDP = {"microbatches": 2, "ddp": True, "sdp_param_persistence_threshold": 0}  # shard every parameter


def _check(results, steps: int = 3):
    for r in results:
        assert len(r["losses"]) == steps
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= 1e-5 * abs(want) + 1e-6, (r["losses"], r["ref_losses"])
        assert r["param_rel_err"] < 1e-4, r["param_rel_err"]
        assert max(r["ref_norms"]) > 1.0, r["ref_norms"]  # clipping at 1.0 changed the reference's steps
    assert results[0]["losses"][-1] < results[0]["losses"][0]


@pytest.mark.parametrize("world,pp,sdp,name", [
    (2, 1, 2, "gpt2"),
    pytest.param(4, 2, 2, "gpt2", marks=pytest.mark.slow),  # 4 ranks
    pytest.param(4, 1, 4, "gpt2", marks=pytest.mark.slow),
    pytest.param(4, 1, 2, "gpt2", marks=pytest.mark.slow),  # hybrid: 2 sharding groups of 2, replicated
    pytest.param(2, 1, 2, "bert", marks=pytest.mark.slow),
    pytest.param(4, 2, 2, "t5", marks=pytest.mark.slow),  # tied embeddings on both stages stay whole
])
def test_sdp_matches_one_process(world, pp, sdp, name):
    cfg = {**SDP, "pipeline_parallel_degree": pp, "sharded_data_parallel_degree": sdp}
    _check(run_ranks(train, world, cfg, name, 3, 8, timeout=400))


def _shards_nothing_warnings(rank: int, world: int) -> list[str]:
    import warnings

    from partitioner.sdp.shards import ShardsNothingWarning

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # each distinct warning once per place, as a script sees them
        train(rank, world, {"pipeline_parallel_degree": 1, "microbatches": 2, "ddp": True,
                            "sharded_data_parallel_degree": 2}, "gpt2", 2, 8)
    return [str(w.message) for w in seen if issubclass(w.category, ShardsNothingWarning)]


def test_sdp_that_shards_nothing_says_so_once():
    # gpt2's largest parameter has 65,536 elements, under SMP's default sdp_param_persistence_threshold (10^6):
    # sharding changes nothing, and the run says so once, on rank 0 (the console under smp launch)
    first, second = run_ranks(_shards_nothing_warnings, 2, timeout=300)
    assert second == [] and len(first) == 1
    assert first[0].startswith("sharded_data_parallel_degree=2 shards nothing at sdp_param_persistence_threshold="
                               "1,000,000: none of the model's 52 parameters has 1,000,000 elements or more (the "
                               "largest, transformer.wte.weight, has 65,536)")
    assert "Fix: set sdp_param_persistence_threshold to 65,536 or less in the smp config" in first[0]


@pytest.mark.slow
def test_sdp_with_tensor_parallelism_matches_one_process():
    cfg = {**SDP, "pipeline_parallel_degree": 1, "tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2}
    _check(run_ranks(train, 4, cfg, "gpt2", 3, 8, timeout=400))


@pytest.mark.slow
def test_training_health_rules_measure_sharded_parameters():
    rules = ["LossNotDecreasing", "VanishingGradient", "ExplodingTensor", "PoorWeightInitialization",
             "WeightUpdateRatio"]
    cfg = {**SDP, "pipeline_parallel_degree": 1, "sharded_data_parallel_degree": 2,
           "debug": {"rules": rules, "every_n_steps": 1}}
    _check(run_ranks(train, 2, cfg, "gpt2", 3, 8, timeout=400))


def _checkpointed(rank: int, world: int, offload: bool):
    import smp
    from tests.smp.features import make_net
    from tests.smp.features import train as train_net

    smp.init({**SDP, "pipeline_parallel_degree": 1, "sharded_data_parallel_degree": 2, "sdp_gradient_clipping": 0,
              "offload_activations": offload})
    return train_net(make_net(), 3, checkpoint=("block1", "block2"))[1]


@pytest.mark.slow
@pytest.mark.parametrize("offload", [False, True])
def test_checkpointed_and_offloaded_activations_with_sdp_are_exact(offload):
    from tests.smp.features import assert_exact

    for r in run_ranks(_checkpointed, 2, offload, timeout=300):
        assert_exact(r)


@pytest.mark.slow
def test_bf16_sdp_trains_as_bf16_data_parallelism():
    base = {**SDP, "pipeline_parallel_degree": 1, "bf16": True, "sdp_gradient_clipping": 0}
    sharded = run_ranks(train, 2, {**base, "sharded_data_parallel_degree": 2}, "gpt2", 3, 8, timeout=400)
    whole = run_ranks(train, 2, base, "gpt2", 3, 8, timeout=400)
    assert sharded[0]["losses"] == pytest.approx(whole[0]["losses"], rel=1e-6), (sharded[0], whole[0])
    assert sharded[0]["param_rel_err"] == pytest.approx(whole[0]["param_rel_err"], rel=1e-3)


def _held(rank: int, world: int, threshold: int):
    """After one step of GPT-2 under sdp2 with delayed initialisation: what this rank holds, and the gathered
    parameters against a delayed initialisation without sharding (the same seeds)."""
    import smp

    smp.init({**SDP, "pipeline_parallel_degree": 1, "sharded_data_parallel_degree": 2,
              "sdp_param_persistence_threshold": threshold})
    with smp.delay_param_initialization():
        model, _, _ = build("gpt2", 8, 0)
    plain = copy.deepcopy(model)
    from smp.engine.materialize import materialize
    materialize(plain, [n for n, _ in plain.named_parameters()], "cpu")
    model = smp.DistributedModel(model)
    smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    from tests.smp.scripts import _shard
    _, loss_fn, batches = build("gpt2", 8, 0)

    @smp.step
    def step(model, args, kwargs, target):
        model.backward(loss_fn(model(*args, **kwargs), target))

    args, kwargs, target = batches(0)
    step(model, _shard(args, rank, 2), _shard(kwargs, rank, 2), _shard(target, rank, 2))
    params = dict(model.module.named_parameters())  # no optimizer step yet: the initial values
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params.values())
    whole = sum(p.numel() for p in params.values())
    want = dict(plain.named_parameters())
    init_equal = all(torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, want[n]) for n, p in params.items())
    grads_sharded = all(isinstance(p.grad, DTensor) for p in params.values() if isinstance(p, DTensor))
    return {"held": held, "whole": whole, "init_equal": init_equal, "grads_sharded": grads_sharded,
            "sharded": sum(isinstance(p, DTensor) for p in params.values()), "count": len(params)}


@pytest.mark.slow
def test_each_rank_holds_its_shards_initialised_as_unsharded():
    results = run_ranks(_held, 2, 0, timeout=300)
    for r in results:
        assert r["sharded"] == r["count"], r
        assert r["init_equal"] and r["grads_sharded"], r
    assert sum(r["held"] for r in results) == results[0]["whole"]  # every element on exactly one rank
    assert max(r["held"] for r in results) <= results[0]["whole"] // 2 + 1024


@pytest.mark.slow
def test_persistence_threshold_keeps_small_parameters_whole():
    r = run_ranks(_held, 2, 10_000, timeout=300)[0]
    assert 0 < r["sharded"] < r["count"] and r["init_equal"], r


def _resume(rank: int, world: int, tmp: str):
    """sdp2: two steps, a partial and a full checkpoint, two more steps; then the partial checkpoint loaded and the
    same two steps again (bit-identical), and the full one loaded into this model's parameters' whole values."""
    import smp
    from tests.smp.test_checkpoint import tied_training

    # No clipping: the other layout's run (no sdp) does not clip.
    model, opt, step = tied_training({"pipeline_parallel_degree": 1, **SDP, "sharded_data_parallel_degree": 2,
                                      "sdp_gradient_clipping": 0}, shard=True)
    step(0), step(1)
    path = os.path.join(tmp, "ckpt")
    smp.save({"model": model.local_state_dict(), "opt": opt.local_state_dict()}, path, partial=True)
    full = {"model": model.state_dict(), "opt": opt.state_dict()}
    if smp.rank() == 0:
        smp.save(full, os.path.join(tmp, "full"), partial=False)
    after = [step(2), step(3)]
    loaded = smp.load(path, partial=True)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["opt"])
    again = [step(2), step(3)]
    model.load_state_dict(full["model"])
    opt.load_state_dict(full["opt"])
    whole_again = [step(2), step(3)]
    smp.barrier()
    return {"after": after, "again": again, "whole_again": whole_again, "files": sorted(os.listdir(tmp)),
            "state": sorted(full["opt"]["state"]), "exp_avg": tuple(full["opt"]["state"][0]["exp_avg"].shape)}


def _other_layout(rank: int, world: int, tmp: str):
    """The full checkpoint of the sdp run, loaded into a pipeline of two stages: the same next steps."""
    import smp
    from tests.smp.test_checkpoint import tied_training

    model, opt, step = tied_training({"pipeline_parallel_degree": 2, "microbatches": 2}, shard=True)
    full = smp.load(os.path.join(tmp, "full"), partial=False)
    model.load_state_dict(full["model"])
    opt.load_state_dict(full["opt"])
    return [step(2), step(3)]


def test_checkpoints_resume_exactly_and_load_into_another_layout(tmp_path):
    results = run_ranks(_resume, 2, str(tmp_path), timeout=300)
    for r in results:
        assert r["again"] == r["after"], r  # bit-identical from the partial checkpoint
        assert r["whole_again"] == pytest.approx(r["after"], rel=1e-6), r
        assert r["exp_avg"] == (32, 16), r  # the full optimizer state holds whole tensors
    assert results[0]["files"] == ["ckpt.manifest.json", "ckpt_0_0", "ckpt_0_1", "full", "full.manifest.json"]
    other = run_ranks(_other_layout, 2, str(tmp_path), timeout=300)
    whole_batch = [(a + b) / 2 for a, b in zip(results[0]["after"], results[1]["after"])]  # each replica had half
    assert other[0] == pytest.approx(whole_batch, rel=1e-5), (other, whole_batch)


def _shorter(rank: int, world: int) -> str:
    """sdp2 trains a step, then gets a batch of shorter sequences: the stages cannot be traced again."""
    import smp
    from tests.smp.scripts import _shard

    smp.init({**SDP, "pipeline_parallel_degree": 1, "sharded_data_parallel_degree": 2})
    model, loss_fn, batches = build("gpt2", 8, 0)
    model = smp.DistributedModel(model)

    @smp.step
    def step(model, args, kwargs, target):
        model.backward(loss_fn(model(*args, **kwargs), target))

    args, kwargs, target = batches(0)
    step(model, _shard(args, rank, 2), _shard(kwargs, rank, 2), _shard(target, rank, 2))
    short = (args[0][:, :16],)
    try:
        step(model, _shard(short, rank, 2), _shard(kwargs, rank, 2), _shard(target[:, :16], rank, 2))
    except Exception as exc:  # noqa: BLE001 - the message is what the test reads
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_a_shape_change_under_sdp_says_why_it_cannot_run():
    for msg in run_ranks(_shorter, 2, timeout=300):
        assert "sharded data parallelism holds shards" in msg and "keep the shapes fixed" in msg, msg


def _tagged(rank: int, world: int, tmp: str):
    """sdp2: smp.save_checkpoint (partial, then full) and smp.resume_from_checkpoint continue exactly."""
    import smp
    from tests.smp.test_checkpoint import tied_training

    model, opt, step = tied_training({"pipeline_parallel_degree": 1, **SDP, "sharded_data_parallel_degree": 2},
                                     shard=True)
    step(0), step(1)
    smp.save_checkpoint(tmp, "t", partial=True, model=model, optimizer=opt)
    smp.save_checkpoint(tmp, "full", partial=False, model=model, optimizer=opt)
    after = [step(2), step(3)]
    smp.resume_from_checkpoint(tmp, "t", partial=True)
    again = [step(2), step(3)]
    smp.resume_from_checkpoint(tmp, "full", partial=False)
    return after, again, [step(2), step(3)], sorted(os.listdir(os.path.join(tmp, "t_partial")))


def test_tagged_checkpoints_of_shards_resume_exactly(tmp_path):
    for after, again, full, files in run_ranks(_tagged, 2, str(tmp_path), timeout=300):
        assert again == after and full == pytest.approx(after, rel=1e-6), (after, again, full)
        assert files == ["manifest.json", "model_0_0.pt", "model_0_1.pt", "optimizer_0_0.pt", "optimizer_0_1.pt"]
