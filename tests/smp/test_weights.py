"""Reading a checkpoint tensor by tensor (smp/weights.py): a rank reads only the keys it holds, from the files
that hold them, in every format models come in; a checkpoint that lacks or misshapes a local tensor is an
error naming it."""
from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from smp.engine.weights import WeightsError, load_local, read_weights
from smp.testing import run_ranks


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, use_cache=False, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def test_sharded_safetensors_are_read_key_by_key(tmp_path):
    model = _tiny_llama()
    model.save_pretrained(tmp_path, max_shard_size="40KB")  # several shards and an index
    assert (tmp_path / "model.safetensors.index.json").exists()
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2
    mine = ["model.layers.3.mlp.down_proj.weight", "model.norm.weight"]
    got = read_weights(tmp_path, mine)
    assert got.keys_read == mine and got.missing == []
    assert len(got.files_opened) < len(shards)  # only the shards that hold these keys
    state = model.state_dict()
    for k in mine:
        assert torch.equal(got.tensors[k], state[k])


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_single_files(tmp_path, fmt):
    model = _tiny_llama()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if fmt == "torch":
        path = tmp_path / "weights.pt"
        torch.save(state, path)
    else:
        from safetensors.torch import save_file

        path = tmp_path / "weights.safetensors"
        del state["lm_head.weight"]  # tied to the embedding: safetensors keeps one of them
        save_file(state, str(path))
    got = read_weights(path, ["model.embed_tokens.weight", "no.such.key"])
    assert got.keys_read == ["model.embed_tokens.weight"] and got.missing == ["no.such.key"]


def test_loading_into_the_local_share_checks_names_and_shapes(tmp_path):
    model = _tiny_llama()
    model.save_pretrained(tmp_path)
    fresh = _tiny_llama()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    local = {id(fresh.lm_head.weight), id(fresh.model.layers[0].self_attn.q_proj.weight)}
    got = load_local(fresh, tmp_path, local)
    # The tied output head is satisfied by the embedding the checkpoint keeps.
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    assert torch.equal(fresh.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight)
    assert not fresh.model.layers[1].self_attn.q_proj.weight.detach().any()  # not local: not read
    assert set(got.keys_read) <= {"model.embed_tokens.weight", "lm_head.weight",
                                  "model.layers.0.self_attn.q_proj.weight"}

    os.remove(tmp_path / "model.safetensors")
    from safetensors.torch import save_file

    state = {k: v for k, v in model.state_dict().items() if k != "model.layers.0.self_attn.q_proj.weight"}
    del state["lm_head.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    lacks = r"lacks 1 tensor\(s\) this rank holds: model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(WeightsError, match=lacks):
        load_local(fresh, tmp_path, local)
    assert load_local(fresh, tmp_path, local, strict=False).missing == ["model.layers.0.self_attn.q_proj.weight"]
    state["model.embed_tokens.weight"] = torch.zeros(3, 3)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"model.embed_tokens.weight has shape \(3, 3\) in .* but \(128, 32\)"):
        load_local(fresh, tmp_path, local, strict=False)


def test_a_path_without_a_checkpoint_says_so(tmp_path):
    with pytest.raises(WeightsError, match="holds no checkpoint: expected one of model.safetensors.index.json"):
        read_weights(tmp_path, ["x"])
    with pytest.raises(WeightsError, match="no checkpoint at"):
        read_weights(tmp_path / "nope.pt", ["x"])


def _train(rank: int, world: int, weights: str | None, pipeline: str, steps: int = 3) -> dict:
    """A few Adam steps of the tiny Llama under smp: built with weights (seeded), or built without them and
    loaded from ``weights``; what the rank read and held, the losses and (rank 0) the gathered state."""
    import smp
    import smp.distributed_model as model_mod
    from smp.runtime import state

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": pipeline, "ddp": world > 2})
    reads = []
    if weights is None:
        net = _tiny_llama()
    else:
        with smp.delay_param_initialization():
            net = _tiny_llama()
        real = model_mod.load_local
        model_mod.load_local = lambda *a, **k: reads.append(real(*a, **k)) or reads[-1]  # record what is read
    model = smp.DistributedModel(net)
    if weights is not None:
        model.load_weights(weights)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))

    @smp.step
    def train_step(model, ids):
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))  # one batch: loss falls
        losses.append(float(train_step(model, ids.chunk(smp.dp_size())[smp.dp_rank()]).reduce_mean()))
        opt.step()
        opt.zero_grad()
    local = dict(model.local_named_parameters())
    held = sorted(n for n, p in net.named_parameters() if not p.is_meta)
    full = {k: v.clone() for k, v in model.state_dict().items()}
    out = {"losses": losses, "held": held, "local": sorted(local), "state": full if rank == 0 else None,
           "read": sorted(reads[0].keys_read) if reads else None, "files": reads[0].files_opened if reads else None}
    smp.barrier()
    state.reset()
    return out


def _both(rank: int, world: int, weights: str, pipeline: str) -> tuple[dict, dict]:
    return _train(rank, world, None, pipeline), _train(rank, world, weights, pipeline)


@pytest.mark.parametrize("world,pipeline", [(2, "interleaved"), pytest.param(2, "simple", marks=pytest.mark.slow),
                                            pytest.param(4, "interleaved", marks=pytest.mark.slow),
                                            pytest.param(4, "simple", marks=pytest.mark.slow)])
def test_a_model_built_without_weights_and_loaded_from_disk_trains_like_the_materialised_one(tmp_path, world, pipeline):
    """Built on meta under delay_param_initialization and loaded from a sharded save_pretrained checkpoint, each
    rank reads and holds only its stages' tensors, and training gives the losses and weights of the model built
    with those weights (pp2, and pp2 x dp2)."""
    _tiny_llama().save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    results = run_ranks(_both, world, str(tmp_path), pipeline, timeout=240)
    every = {n for n, _ in _tiny_llama().named_parameters()}
    for full, delayed in results:
        assert delayed["losses"] == pytest.approx(full["losses"], rel=1e-6, abs=0)
        assert delayed["held"] == delayed["local"] == full["held"] == full["local"]  # only its own share...
        assert set(delayed["held"]) < every  # ...which is not everything
        shared = {"model.embed_tokens.weight", "lm_head.weight"}  # tied: one storage, read under either name
        assert set(delayed["read"]) - shared == set(delayed["local"]) - shared
    assert results[0][0]["losses"][-1] < results[0][0]["losses"][0]
    a, b = results[0][0]["state"], results[0][1]["state"]
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)
    held = [set(r[1]["held"]) for r in results[:2]]
    assert not held[0] & held[1] - {"model.embed_tokens.weight", "lm_head.weight"}  # stages do not overlap
