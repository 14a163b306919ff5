"""GPT-Neo (Black et al. 2021) as SMP v1's ``DistributedTransformerLMHead``: hooks and translators.

GPT-Neo is GPT-2 with separate, bias-free q/k/v projections, unscaled attention scores computed in float32,
and layers alternating global and local attention (a window of ``window_size`` keys). SMP v1's names:
``translate_hf_state_dict_to_smdistributed_gptneo`` and ``translate_state_dict_to_hf_gptneo``.
"""
from __future__ import annotations

from typing import Any

from smp.nn.huggingface.gptj import return_hook
from smp.nn.huggingface.hooks import hf_activation, lm_forward_hook
from smp.nn.huggingface.mapping import Rule, to_hf, to_smp

__all__ = ["RULES", "lm_head_kwargs", "forward_hook", "return_hook", "translate_hf_state_dict_to_smdistributed_gptneo",
           "translate_state_dict_to_hf_gptneo"]

_LAYER = "transformer.seq_layers.{i}"
RULES = [Rule("transformer.wte.{p}", "word_embedding.{p}"), Rule("transformer.wpe.{p}", "position_embedding.{p}"),
         Rule("transformer.h.{i}.ln_1.{p}", f"{_LAYER}.attention.pre_layernorm.{{p}}"),
         *(Rule(f"transformer.h.{{i}}.attn.attention.{hf}.{{p}}", f"{_LAYER}.attention.{smp}.{{p}}")
           for hf, smp in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value"), ("out_proj", "dense"))),
         Rule("transformer.h.{i}.ln_2.{p}", f"{_LAYER}.output.pre_layernorm.{{p}}"),
         Rule("transformer.h.{i}.mlp.c_fc.{p}", f"{_LAYER}.output.dense1.{{p}}"),
         Rule("transformer.h.{i}.mlp.c_proj.{p}", f"{_LAYER}.output.dense2.{{p}}"),
         Rule("transformer.ln_f.{p}", "transformer.seq_layers.{last}.output.layernorm.{p}")]


def lm_head_kwargs(config: Any) -> dict[str, Any]:
    """``DistributedTransformerLMHead`` arguments for a ``GPTNeoConfig`` (SMP's init hook)."""
    kinds = [kind for group, repeat in config.attention_types for _ in range(repeat) for kind in group]
    if len(kinds) != config.num_layers:
        raise ValueError(f"GPT-Neo: attention_types give {len(kinds)} layers, num_layers is {config.num_layers}")
    if config.hidden_size % config.num_heads:
        raise ValueError(f"GPT-Neo with hidden_size={config.hidden_size} and num_heads={config.num_heads}: the hidden "
                         "size must divide by the number of heads")
    return {"num_layers": config.num_layers, "num_attention_heads": config.num_heads,
            "attention_head_size": config.hidden_size // config.num_heads, "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size, "activation": hf_activation(config.activation_function, "GPT-Neo"),
            "intermediate_size": config.intermediate_size or 4 * config.hidden_size,
            "attention_dropout_prob": config.attention_dropout, "hidden_dropout_prob": config.resid_dropout,
            "embedding_dropout_prob": config.embed_dropout, "layernorm_epsilon": config.layer_norm_epsilon,
            "initializer_range": config.initializer_range, "attention_layers_type": kinds,
            "use_normal_initialization": True, "pre_layernorm": True, "post_layernorm": True,
            "causal_mask_size": config.max_position_embeddings, "num_positions": config.max_position_embeddings,
            "window_size": config.window_size, "scale_attention_scores": False, "attention_in_fp32": True,
            "use_qkv_bias": False, "mask_value": -1e9,
            "tie_input_output_embedding": getattr(config, "tie_word_embeddings", True)}


forward_hook = lm_forward_hook("GPTNeoForCausalLM")


def translate_hf_state_dict_to_smdistributed_gptneo(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A ``GPTNeoForCausalLM`` state dict with ``DistributedTransformerLMHead``'s keys."""
    return to_smp(state_dict, RULES)


def translate_state_dict_to_hf_gptneo(state_dict: dict[str, Any], max_seq_len: int | None = None) -> dict[str, Any]:
    """A ``DistributedTransformerLMHead`` state dict with ``GPTNeoForCausalLM``'s keys."""
    return to_hf(state_dict, RULES)
