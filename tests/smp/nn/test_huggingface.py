"""The state-dict translators of ``smp.nn.huggingface``: a Hugging Face state dict translated to SMP's format
loads strictly into the distributed module built for its config (SMP's key names), computes the Hugging Face
model's logits, and translates back to the very same tensors, under every published name."""
from __future__ import annotations

import pytest
import torch

from smp.nn import DistributedTransformer, DistributedTransformerLayer, DistributedTransformerLMHead
from smp.nn.huggingface import bert, gpt2, gptj, gptneo, roberta
from tests.smp.test_tp_training import VOCAB, build

LM = {"gpt2": (gpt2, gpt2.translate_hf_state_dict_to_smdistributed_gpt2, gpt2.translate_state_dict_to_hf_gpt2),
      "gptj": (gptj, gptj.translate_hf_state_dict_to_smdistributed_gptj, gptj.translate_state_dict_to_hf_gptj),
      "gptneo": (gptneo, gptneo.translate_hf_state_dict_to_smdistributed_gptneo,
                 gptneo.translate_state_dict_to_hf_gptneo)}


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("kind", sorted(LM))
def test_a_causal_lm_round_trips_through_smps_format(kind):
    family, to_smp, to_hf = LM[kind]
    hf = build(kind).eval()
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    translated = to_smp(hf.state_dict())
    assert "transformer.seq_layers.1.attention.query.weight" in translated and "word_embedding.weight" in translated
    model = DistributedTransformerLMHead(**family.lm_head_kwargs(hf.config)).eval()
    model.load_state_dict(translated, strict=True)
    ids = _ids()
    loss, logits = model((ids, None, None, None, ids))
    want = hf(input_ids=ids, labels=ids)
    torch.testing.assert_close(logits, want.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, want.loss, rtol=1e-6, atol=1e-6)
    back = to_hf(model.state_dict())
    assert set(back) == set(original)
    for k, v in original.items():
        assert torch.equal(back[k], v), k


def test_gpt2s_fused_projection_is_split_and_transposed():
    hf = build("gpt2")
    sd = gpt2.translate_hf_state_dict_to_smdistributed_gpt2(hf.state_dict())
    c_attn = hf.transformer.h[0].attn.c_attn
    assert torch.equal(sd["transformer.seq_layers.0.attention.key.weight"], c_attn.weight[:, 64:128].t())
    assert torch.equal(sd["transformer.seq_layers.0.attention.value.bias"], c_attn.bias[128:])
    assert torch.equal(sd["transformer.seq_layers.1.output.layernorm.weight"], hf.transformer.ln_f.weight)
    early = gpt2.translate_hf_state_dict_to_smdistributed(hf.state_dict(), 32)  # SMP v1's early-2022 name
    assert early.keys() == sd.keys()


def test_a_gpt2_block_translates_in_place():
    import transformers as T
    body = T.GPT2Model(T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=16))
    sd = gpt2.translate_hf_state_dict_to_smdistributed_gpt2_layer(body.state_dict())
    layer = DistributedTransformerLayer(**gpt2.layer_kwargs(body.config))
    layer.load_state_dict({k[len("h.1."):]: v for k, v in sd.items() if k.startswith("h.1.")}, strict=True)
    back = gpt2.translate_state_dict_to_hf_gpt2_layer(sd)
    assert all(torch.equal(back[k], v) for k, v in body.state_dict().items())


@pytest.mark.parametrize("family", [bert, roberta])
def test_an_encoder_round_trips_and_computes_the_same(family):
    import transformers as T
    if family is bert:
        hf, prefix, to_smp, to_hf = build("bert").eval(), "bert.encoder.", \
            bert.translate_hf_state_dict_to_smdistributed, bert.translate_state_dict_to_hf_bert
    else:
        hf = T.RobertaForMaskedLM(T.RobertaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                                  num_attention_heads=4, vocab_size=VOCAB,
                                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).eval()
        prefix, to_smp, to_hf = "roberta.encoder.", roberta.translate_state_dict_to_smdistributed, \
            roberta.translate_state_dict_to_hf_roberta
    translated = to_smp(hf.state_dict())
    encoder = DistributedTransformer(**family.encoder_kwargs(hf.config)).eval()
    encoder.load_state_dict({k[len(prefix):]: v for k, v in translated.items() if k.startswith(prefix)}, strict=True)
    hidden = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 1, 1, 8)
    mask[1, ..., 6:] = -10000.0  # padding on the second row
    want = (getattr(hf, prefix.split(".")[0]).encoder)(hidden, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(encoder((hidden, mask))[0], want, rtol=1e-5, atol=1e-5)
    back = to_hf(translated)
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
    assert set(back) == set(hf.state_dict())
