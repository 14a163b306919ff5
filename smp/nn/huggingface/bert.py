"""BERT (Devlin et al. 2019, arXiv:1810.04805) as SMP v1's ``DistributedTransformer``: hooks and translators.

``BertEncoder`` created under ``smp.tensor_parallelism()`` becomes a ``DistributedTransformer`` (post-layer-norm,
no causal mask) at the same place in the model, so only the encoder's keys change: ``encoder.layer.N`` becomes
``encoder.seq_layers.N`` with SMP's block names; embeddings, pooler and heads keep theirs. SMP v1's names:
``translate_hf_state_dict_to_smdistributed_bert`` (also ``translate_hf_state_dict_to_smdistributed``) and
``translate_state_dict_to_hf_bert``. RoBERTa's encoder is the same (:mod:`smp.nn.huggingface.roberta`).
"""
from __future__ import annotations

from typing import Any

from smp.nn.huggingface.hooks import encoder_forward_hook, hf_activation
from smp.nn.huggingface.mapping import Rule, to_hf, to_smp

__all__ = ["RULES", "encoder_kwargs", "forward_hook", "translate_hf_state_dict_to_smdistributed_bert",
           "translate_hf_state_dict_to_smdistributed", "translate_state_dict_to_hf_bert"]

RULES = [Rule("encoder.layer.{i}.attention.self.{qkv}.{p}", "encoder.seq_layers.{i}.attention.{qkv}.{p}"),
         Rule("encoder.layer.{i}.attention.output.dense.{p}", "encoder.seq_layers.{i}.attention.dense.{p}"),
         Rule("encoder.layer.{i}.attention.output.LayerNorm.{p}", "encoder.seq_layers.{i}.attention.layernorm.{p}"),
         Rule("encoder.layer.{i}.intermediate.dense.{p}", "encoder.seq_layers.{i}.output.dense1.{p}"),
         Rule("encoder.layer.{i}.output.dense.{p}", "encoder.seq_layers.{i}.output.dense2.{p}"),
         Rule("encoder.layer.{i}.output.LayerNorm.{p}", "encoder.seq_layers.{i}.output.layernorm.{p}")]


def encoder_kwargs(config: Any, model: str = "BERT") -> dict[str, Any]:
    """``DistributedTransformer`` arguments for a BERT-style encoder config (SMP's init hook)."""
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(f"{model} with hidden_size={config.hidden_size} and num_attention_heads="
                         f"{config.num_attention_heads}: the hidden size must divide by the number of heads")
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{model} with position_embedding_type={config.position_embedding_type!r}: SMP's "
                         "distributed transformer supports 'absolute' only")
    return {"num_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
            "attention_head_size": config.hidden_size // config.num_attention_heads,
            "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "activation": hf_activation(config.hidden_act, model),
            "attention_dropout_prob": config.attention_probs_dropout_prob,
            "hidden_dropout_prob": config.hidden_dropout_prob, "layernorm_epsilon": config.layer_norm_eps,
            "initializer_range": config.initializer_range, "use_normal_initialization": True,
            "num_positions": config.max_position_embeddings}


forward_hook = encoder_forward_hook("BertEncoder")


def translate_hf_state_dict_to_smdistributed_bert(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A BERT model's state dict with ``DistributedTransformer``'s keys for its encoder."""
    return to_smp(state_dict, RULES)


translate_hf_state_dict_to_smdistributed = translate_hf_state_dict_to_smdistributed_bert


def translate_state_dict_to_hf_bert(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`translate_hf_state_dict_to_smdistributed_bert`."""
    return to_hf(state_dict, RULES)
