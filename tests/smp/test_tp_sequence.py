"""Sequence parallelism on real ranks (gloo): tp2 with the regions between tp regions on half the sequence reproduces
the single-process losses and gradients of tiny Hugging Face models (pp2 x tp2 too, slow), through the pipeline
runner and ``smp.init``'s ``sequence_parallel``; with dropout, each rank's masks come from the engine's streams."""
from __future__ import annotations

import warnings

import pytest
import torch

from smp.testing import run_ranks
from tests.smp.features import shard_grad_error
from tests.smp.test_tp_training import VOCAB, _loss, _run, build


def _exact(rank: int, world: int, kinds: list[str], pp: int) -> list[dict]:
    return [_run(rank, world, kind, pp, "1f1b", sequence_parallel=True) for kind in kinds]


def _check(results: list[list[dict]]) -> None:
    for per_rank in results:
        for r in per_rank:
            assert r["sequence"], r
            assert abs(r["loss"] - r["want"]) <= 1e-5 * abs(r["want"]), r
            assert r["worst"] < 1e-5, r


def test_tp2_with_sequence_parallelism_reproduces_the_single_process_llama():
    _check(run_ranks(_exact, 2, ["llama"], 1, timeout=240))


@pytest.mark.slow
def test_tp2_with_sequence_parallelism_reproduces_the_single_process_gpt2():
    _check(run_ranks(_exact, 2, ["gpt2"], 1, timeout=240))


@pytest.mark.slow
def test_pp2_tp2_with_sequence_parallelism_reproduces_the_single_process_losses_and_gradients():
    _check(run_ranks(_exact, 4, ["llama", "gpt2"], 2, timeout=400))


def _smp(rank: int, world: int) -> dict:
    import smp
    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
    ref = build("llama")
    want = sum(ref(ids[i:i + 2], labels=ids[i:i + 2]).loss for i in (0, 2)) / 2
    want.backward()
    grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    smp.init({"pipeline_parallel_degree": 1, "tensor_parallel_degree": 2, "ddp": True, "microbatches": 2,
              "prescaled_batch": True, "sequence_parallel": True})
    model = smp.DistributedModel(build("llama"))

    @smp.step
    def train_step(model, x):
        loss = model(x, labels=x).loss
        model.backward(loss)
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = train_step(model, ids).reduce_mean()
    sharding = model.partition_plan().traced_graph().fx.sharding
    worst, _ = shard_grad_error(model, grads)
    return {"loss": float(loss), "want": float(want), "sequence": sharding.sequence, "worst": worst,
            "deferred": sharding.deferred}


@pytest.mark.slow
def test_the_smp_config_key_turns_it_on_and_norm_weights_sum_their_gradients_once_per_step():
    for r in run_ranks(_smp, 2, timeout=240):
        assert r["sequence"] and abs(r["loss"] - r["want"]) <= 1e-5 * abs(r["want"]), r
        assert r["worst"] < 1e-5, r  # the norms' weights: partial sums on each tp rank, summed after the step
        assert any("norm" in name for name in r["deferred"]), r


def _dropout(rank: int, world: int) -> dict:
    import transformers as T

    from smp.engine.planning import pipeline_runner
    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
    out: dict = {}
    for run, checkpointed in (("first", []), ("again", []), ("recomputed", ["transformer.h.0"])):
        torch.manual_seed(0)
        model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32,
                                               bos_token_id=0, eos_token_id=0)).train()  # dropout 0.1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runner = pipeline_runner(model, (ids[:2],), {"labels": ids[:2]}, microbatches=2, pipelines=[[0], [1]],
                                     tp_groups=[[0, 1]], timeout_s=60, sequence_parallel=True,
                                     checkpoint_modules=checkpointed)
        state = torch.get_rng_state()
        losses = [runner.step((ids,), {"labels": ids}, loss_fn=_loss).loss for _ in range(2)]
        out[run] = {"losses": losses, "untouched": torch.equal(state, torch.get_rng_state()),
                    "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
        runner.close()
    return out


@pytest.mark.slow
def test_dropout_on_a_slice_of_the_sequence_is_reproducible_and_replayed_by_checkpointing():
    a, b = run_ranks(_dropout, 2, timeout=300)
    for r in (a, b):
        first, again, recomputed = r["first"], r["again"], r["recomputed"]
        assert first["untouched"] and first["losses"][0] != first["losses"][1]  # masks change from step to step
        assert first["losses"] == again["losses"] == recomputed["losses"]  # ... and the same from the same seed
        for name, grad in first["grads"].items():
            torch.testing.assert_close(recomputed["grads"][name], grad, rtol=0, atol=1e-7, msg=name)
    assert a["first"]["losses"] == b["first"]["losses"]  # one loss per tp group
