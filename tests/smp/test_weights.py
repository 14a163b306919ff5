"""Reading a checkpoint tensor by tensor (smp/weights.py): a rank reads only the keys it holds, from the files
that hold them, in every format models come in; a checkpoint that lacks or misshapes a local tensor is an
error naming it."""
from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from smp.weights import WeightsError, load_local, read_weights


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
