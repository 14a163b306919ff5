"""GPT-2 (Radford et al. 2019) as SMP v1's ``DistributedTransformerLMHead``: hooks and state-dict translators.

``GPT2LMHeadModel`` created under ``smp.tensor_parallelism()`` becomes a ``DistributedTransformerLMHead`` (pre-
and post-layer-norm: the final ``ln_f`` is the last layer's ``output.layernorm``), a lone ``GPT2Block`` a
``DistributedTransformerLayer``. The translators use SMP v1's published names: early 2022
``translate_hf_state_dict_to_smdistributed(state_dict, max_seq_len)``, late 2022
``translate_hf_state_dict_to_smdistributed_gpt2(state_dict)``, and ``translate_state_dict_to_hf_gpt2(state_dict,
max_seq_len=None)``; the ``_layer`` pair for a single block. ``max_seq_len`` was the size of the causal-mask
buffers SMP wrote back; ``transformers`` no longer keeps them in state dicts, so none are written.
"""
from __future__ import annotations

from typing import Any

from smp.nn.huggingface.hooks import additive_mask, hf_activation, lm_forward_hook, lm_return_hook, refuse_unsupported
from smp.nn.huggingface.mapping import Rule, to_hf, to_smp

__all__ = ["RULES", "LAYER_RULES", "lm_head_kwargs", "layer_kwargs", "lm_head_forward_hook", "lm_head_return_hook",
           "layer_forward_hook", "layer_return_hook", "translate_hf_state_dict_to_smdistributed_gpt2",
           "translate_hf_state_dict_to_smdistributed", "translate_state_dict_to_hf_gpt2",
           "translate_hf_state_dict_to_smdistributed_gpt2_layer", "translate_state_dict_to_hf_gpt2_layer"]


def _block_rules(hf_layer: str, smp_layer: str) -> list[Rule]:
    return [Rule(f"{hf_layer}.ln_1.{{p}}", f"{smp_layer}.attention.pre_layernorm.{{p}}"),
            Rule(f"{hf_layer}.attn.c_attn.{{p}}", f"{smp_layer}.attention.{{qkv}}.{{p}}", "fused"),
            Rule(f"{hf_layer}.attn.c_proj.{{p}}", f"{smp_layer}.attention.dense.{{p}}", "conv1d"),
            Rule(f"{hf_layer}.ln_2.{{p}}", f"{smp_layer}.output.pre_layernorm.{{p}}"),
            Rule(f"{hf_layer}.mlp.c_fc.{{p}}", f"{smp_layer}.output.dense1.{{p}}", "conv1d"),
            Rule(f"{hf_layer}.mlp.c_proj.{{p}}", f"{smp_layer}.output.dense2.{{p}}", "conv1d")]


RULES = [Rule("transformer.wte.{p}", "word_embedding.{p}"), Rule("transformer.wpe.{p}", "position_embedding.{p}"),
         *_block_rules("transformer.h.{i}", "transformer.seq_layers.{i}"),
         Rule("transformer.ln_f.{p}", "transformer.seq_layers.{last}.output.layernorm.{p}")]
LAYER_RULES = _block_rules("h.{i}", "h.{i}")  # a block keeps its place (and prefix) in the model


def _attention_kwargs(config: Any) -> dict[str, Any]:
    if config.n_embd % config.n_head:
        raise ValueError(f"GPT-2 with n_embd={config.n_embd} and n_head={config.n_head}: the embedding size must "
                         "divide by the number of heads")
    return {"num_attention_heads": config.n_head, "attention_head_size": config.n_embd // config.n_head,
            "hidden_size": config.n_embd,
            "intermediate_size": config.n_inner if config.n_inner is not None else 4 * config.n_embd,
            "activation": hf_activation(config.activation_function, "GPT-2"),
            "attention_dropout_prob": config.attn_pdrop, "hidden_dropout_prob": config.resid_pdrop,
            "layernorm_epsilon": config.layer_norm_epsilon, "initializer_range": config.initializer_range,
            "use_normal_initialization": True, "pre_layernorm": True, "causal_mask_size": config.n_positions,
            "num_positions": config.n_positions, "scale_attention_scores": config.scale_attn_weights,
            "scale_attn_by_layer_idx": config.scale_attn_by_inverse_layer_idx,
            "query_key_layer_scaling": config.reorder_and_upcast_attn,
            "attention_in_fp32": config.reorder_and_upcast_attn}


def lm_head_kwargs(config: Any) -> dict[str, Any]:
    """``DistributedTransformerLMHead`` arguments for a ``GPT2Config`` (SMP's init hook)."""
    return {**_attention_kwargs(config), "num_layers": config.n_layer, "vocab_size": config.vocab_size,
            "embedding_dropout_prob": config.embd_pdrop, "post_layernorm": True,
            "tie_input_output_embedding": getattr(config, "tie_word_embeddings", True)}


def layer_kwargs(config: Any) -> dict[str, Any]:
    """``DistributedTransformerLayer`` arguments for one ``GPT2Block`` (pre-layer-norm, no final norm)."""
    return {**_attention_kwargs(config), "post_layernorm": False}


lm_head_forward_hook = lm_forward_hook("GPT2LMHeadModel")


def lm_head_return_hook(outputs: Any) -> Any:
    """The LM head's outputs as ``CausalLMOutputWithCrossAttentions``."""
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    return lm_return_hook(CausalLMOutputWithCrossAttentions)(outputs)


def layer_forward_hook(hidden_states: Any, past_key_values: Any = None, attention_mask: Any = None,
                       encoder_hidden_states: Any = None, encoder_attention_mask: Any = None, use_cache: Any = None,
                       **rest: Any) -> tuple[tuple, dict]:
    """``GPT2Block(hidden_states, past_key_values, attention_mask, ...)`` as ``DistributedTransformerLayer((hidden,
    mask))``. The distributed layer keeps no KV cache: a cache passed in is left empty (training never reads it;
    generate with the model built outside ``smp.tensor_parallelism()``)."""
    refuse_unsupported("GPT2Block", encoder_hidden_states=encoder_hidden_states,
                       encoder_attention_mask=encoder_attention_mask,
                       **{k: v for k, v in rest.items() if k not in ("cache_position", "position_ids", "layer_past")})
    return ((hidden_states, additive_mask(attention_mask, hidden_states.dtype)),), {}


def layer_return_hook(outputs: Any) -> Any:
    """The layer's output as ``GPT2Block`` returns it: the hidden states (``transformers`` 5), or a tuple."""
    import transformers

    return outputs[0] if int(transformers.__version__.split(".")[0]) >= 5 else (outputs[0], None)


def translate_hf_state_dict_to_smdistributed_gpt2(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A ``GPT2LMHeadModel`` state dict with ``DistributedTransformerLMHead``'s keys (SMP v1, late 2022)."""
    return to_smp(state_dict, RULES)


def translate_hf_state_dict_to_smdistributed(state_dict: dict[str, Any], max_seq_len: int | None = None) -> dict:
    """SMP v1's early-2022 name of :func:`translate_hf_state_dict_to_smdistributed_gpt2`."""
    return to_smp(state_dict, RULES)


def translate_state_dict_to_hf_gpt2(state_dict: dict[str, Any], max_seq_len: int | None = None) -> dict[str, Any]:
    """A ``DistributedTransformerLMHead`` state dict with ``GPT2LMHeadModel``'s keys and layouts."""
    return to_hf(state_dict, RULES)


def translate_hf_state_dict_to_smdistributed_gpt2_layer(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``GPT2Block`` keys (``h.N.*``, under any prefix) as ``DistributedTransformerLayer``'s, under the same prefix."""
    return to_smp(state_dict, LAYER_RULES)


def translate_state_dict_to_hf_gpt2_layer(state_dict: dict[str, Any], max_seq_len: int | None = None) -> dict:
    """The inverse of :func:`translate_hf_state_dict_to_smdistributed_gpt2_layer`."""
    return to_hf(state_dict, LAYER_RULES)
