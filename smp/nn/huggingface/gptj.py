"""GPT-J (Wang and Komatsuzaki 2021) as SMP v1's ``DistributedTransformerLMHead``: hooks and translators.

GPT-J's layers apply attention and the feed-forward block to one normalised input and add both to the
residual (``parallel_attn_output``, ``single_pre_layernorm``), rotate the first ``rotary_dim`` features of
each head (GPT-J's interleaved rotary embedding), have no position embedding, no q/k/v or attention-output
biases, a final layer norm and an untied LM head with a bias. SMP v1's names:
``translate_hf_state_dict_to_smdistributed_gptj`` (also ``translate_hf_gptj_state_dict_to_smdistributed(state_dict,
max_seq_len)``) and ``translate_state_dict_to_hf_gptj(state_dict, max_seq_len=None)``.
"""
from __future__ import annotations

from typing import Any

from smp.nn.huggingface.hooks import hf_activation, lm_forward_hook, lm_return_hook
from smp.nn.huggingface.mapping import Rule, to_hf, to_smp

__all__ = ["RULES", "lm_head_kwargs", "forward_hook", "return_hook", "translate_hf_state_dict_to_smdistributed_gptj",
           "translate_hf_gptj_state_dict_to_smdistributed", "translate_state_dict_to_hf_gptj"]

_LAYER = "transformer.seq_layers.{i}"
RULES = [Rule("transformer.wte.{p}", "word_embedding.{p}"),
         Rule("transformer.h.{i}.ln_1.{p}", f"{_LAYER}.pre_layernorm.{{p}}"),
         *(Rule(f"transformer.h.{{i}}.attn.{hf}.{{p}}", f"{_LAYER}.attention.{smp}.{{p}}")
           for hf, smp in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value"), ("out_proj", "dense"))),
         Rule("transformer.h.{i}.mlp.fc_in.{p}", f"{_LAYER}.output.dense1.{{p}}"),
         Rule("transformer.h.{i}.mlp.fc_out.{p}", f"{_LAYER}.output.dense2.{{p}}"),
         Rule("transformer.ln_f.{p}", "layernorm.{p}")]


def lm_head_kwargs(config: Any) -> dict[str, Any]:
    """``DistributedTransformerLMHead`` arguments for a ``GPTJConfig`` (SMP's init hook)."""
    if config.n_embd % config.n_head:
        raise ValueError(f"GPT-J with n_embd={config.n_embd} and n_head={config.n_head}: the embedding size must "
                         "divide by the number of heads")
    return {"num_layers": config.n_layer, "num_attention_heads": config.n_head,
            "attention_head_size": config.n_embd // config.n_head, "hidden_size": config.n_embd,
            "rotary_dim": config.rotary_dim, "mask_value": -1e9, "use_positional_embedding": False,
            "parallel_attn_output": True, "use_lm_head_bias": True,
            "tie_input_output_embedding": config.tie_word_embeddings, "use_attn_dense_bias": False,
            "use_qkv_bias": False, "final_layernorm": True, "single_pre_layernorm": True,
            "vocab_size": config.vocab_size, "activation": hf_activation(config.activation_function, "GPT-J"),
            "intermediate_size": config.n_inner if config.n_inner is not None else 4 * config.n_embd,
            "attention_dropout_prob": config.attn_pdrop, "hidden_dropout_prob": config.resid_pdrop,
            "embedding_dropout_prob": config.embd_pdrop, "layernorm_epsilon": config.layer_norm_epsilon,
            "initializer_range": config.initializer_range, "use_normal_initialization": True,
            "pre_layernorm": False, "post_layernorm": False, "causal_mask_size": config.n_positions,
            "num_positions": config.n_positions, "attention_in_fp32": True}


forward_hook = lm_forward_hook("GPTJForCausalLM")


def return_hook(outputs: Any) -> Any:
    """The LM head's outputs as ``CausalLMOutputWithPast``."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return lm_return_hook(CausalLMOutputWithPast)(outputs)


def translate_hf_state_dict_to_smdistributed_gptj(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A ``GPTJForCausalLM`` state dict with ``DistributedTransformerLMHead``'s keys."""
    return to_smp(state_dict, RULES)


def translate_hf_gptj_state_dict_to_smdistributed(state_dict: dict[str, Any], max_seq_len: int | None = None) -> dict:
    """SMP v1's earlier name of :func:`translate_hf_state_dict_to_smdistributed_gptj`."""
    return to_smp(state_dict, RULES)


def translate_state_dict_to_hf_gptj(state_dict: dict[str, Any], max_seq_len: int | None = None) -> dict[str, Any]:
    """A ``DistributedTransformerLMHead`` state dict with ``GPTJForCausalLM``'s keys."""
    return to_hf(state_dict, RULES)
