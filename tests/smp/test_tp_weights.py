"""Reading tensor-parallel shards from disk (smp/engine/weights.py): a rank reads only its slice of each sharded
tensor (safetensors ``get_slice``, block by block for a fused weight; the mmap'd pages of a torch file), never the
whole tensor; and a tp=2 model built without weights and loaded from a ``save_pretrained`` checkpoint trains like
the single-process model."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from partitioner.tp.shard_program import shard_tensor
from partitioner.tp.sharding import Shard
from smp.engine.weights import Cut, WeightsError, read_weights, weight_cuts
from smp.testing import run_ranks
from tests.smp.test_tp_training import VOCAB, build

SHARDS = {"embed": Shard(0, 101), "qkv": Shard(1, 24, 3), "bias": Shard(0, 24, 3)}


def spy_on_safetensors() -> tuple[list[str], object]:
    """A stand-in for ``safetensors.safe_open`` that records the keys read whole (``get_tensor``): the list they go
    to, and the stand-in (the caller patches it in)."""
    import safetensors

    real, whole = safetensors.safe_open, []

    class Spy:
        def __init__(self, *args, **kwargs):
            self.fh = real(*args, **kwargs)

        def __enter__(self):
            self.inner = self.fh.__enter__()
            return self

        def __exit__(self, *exc):
            return self.fh.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, key):
            whole.append(key)
            return self.inner.get_tensor(key)

        def get_slice(self, key):
            return self.inner.get_slice(key)
    return whole, Spy


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_a_rank_reads_only_its_slices(tmp_path, monkeypatch, fmt):
    whole = {"embed": torch.randn(101, 8), "qkv": torch.randn(8, 24), "bias": torch.randn(24), "norm": torch.randn(8)}
    if fmt == "torch":
        path = str(tmp_path / "w.pt")
        torch.save(whole, path)
    else:
        from safetensors.torch import save_file
        path = str(tmp_path / "w.safetensors")
        save_file(whole, path)
    import safetensors
    read_whole, spy = spy_on_safetensors()
    monkeypatch.setattr(safetensors, "safe_open", spy)
    for rank in range(2):
        got = read_weights(path, list(whole), weight_cuts(SHARDS, 2, rank))
        assert got.keys_read == sorted(whole) and got.missing == []
        for k, v in whole.items():
            want = shard_tensor(v, SHARDS[k], 2, rank) if k in SHARDS else v
            assert torch.equal(got.tensors[k], want), k
    if fmt == "safetensors":
        assert read_whole == ["norm", "norm"], read_whole  # the sharded tensors were only ever sliced
    with pytest.raises(WeightsError, match=r"embed has shape \(101, 8\) in .* a shard of a tensor 100 long along "
                                           r"dim 0: the checkpoint is of another model"):
        read_weights(path, ["embed"], {"embed": Cut(0, 100, ((0, 50),))})
    assert weight_cuts(SHARDS, 1, 0) == {}


def _load(rank: int, world: int, weights: str) -> dict:
    """tp=2: GPT-2 built without weights, ``load_weights`` from disk, one step; what was read whole, the loss
    and the worst difference of this rank's parameters from its shards of the checkpoint."""
    import safetensors

    import smp

    read_whole, safetensors.safe_open = spy_on_safetensors()  # this process is the rank's own
    smp.init({"pipeline_parallel_degree": 1, "tensor_parallel_degree": 2, "ddp": True, "microbatches": 2,
              "prescaled_batch": True})
    with smp.delay_param_initialization():
        model = smp.DistributedModel(build("gpt2"))
    model.load_weights(weights)

    @smp.step
    def train_step(model, x):
        loss = model(x, labels=x).loss
        model.backward(loss)
        return loss

    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = float(train_step(model, ids).reduce_mean())
    ref = build("gpt2")
    want = float(sum(ref(ids[i:i + 2], labels=ids[i:i + 2]).loss for i in (0, 2)) / 2)
    layout = model.tensor_parallel_layout()
    whole = ref.state_dict()
    worst = max(float((p - (shard_tensor(whole[n], layout.shards[n], 2, smp.tp_rank()) if n in layout.shards
                            else whole[n])).abs().max()) for n, p in model.module.named_parameters())
    return {"loss": loss, "want": want, "worst": worst, "sharded": sorted(layout.shards),
            "whole_reads": sorted(set(read_whole) & set(layout.shards)), "replicated_reads": len(read_whole)}


def test_tp2_load_weights_reads_slices_and_trains_like_the_single_process_model(tmp_path):
    build("gpt2").save_pretrained(tmp_path, max_shard_size="100KB")  # several safetensors files and an index
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    for r in run_ranks(_load, 2, str(tmp_path), timeout=240):
        assert r["sharded"] and r["whole_reads"] == [] and r["replicated_reads"] > 0, r  # sharded ones: sliced
        assert r["worst"] == 0.0, r
        assert abs(r["loss"] - r["want"]) <= 1e-5 * abs(r["want"]), r


def _runner_load(rank: int, world: int, weights: str) -> dict:
    """``pipeline_runner(weights=...)`` on tp=2: a model built on meta, its shards read from disk, one step."""
    from smp.engine.planning import pipeline_runner

    read_whole, safetensors_spy = spy_on_safetensors()
    import safetensors
    safetensors.safe_open = safetensors_spy
    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
    with torch.device("meta"):
        model = build("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner = pipeline_runner(model, (ids[:2],), {"labels": ids[:2]}, microbatches=2, pipelines=[[0], [1]],
                                 tp_groups=[[0, 1]], weights=weights, timeout_s=60)
    loss = runner.step((ids,), {"labels": ids}, loss_fn=lambda out, _: out.loss).loss
    runner.close()
    ref = build("gpt2")
    want = float(sum(ref(ids[i:i + 2], labels=ids[i:i + 2]).loss for i in (0, 2)) / 2)
    return {"loss": float(loss), "want": want, "whole_reads": sorted(set(read_whole) & {"transformer.wte.weight"})}


@pytest.mark.slow
def test_pipeline_runner_reads_tp_shards_from_disk(tmp_path):
    build("gpt2").save_pretrained(tmp_path)
    for r in run_ranks(_runner_load, 2, str(tmp_path), timeout=240):
        assert r["whole_reads"] == [] and abs(r["loss"] - r["want"]) <= 1e-5 * abs(r["want"]), r
