"""The hyperparameters of SMP v1's distributed transformer modules: one dataclass, SMP's names and defaults.

SMP v1's ``DistributedTransformerLMHead``, ``DistributedTransformer``, ``DistributedTransformerLayer``,
``DistributedAttentionLayer`` and ``DistributedTransformerOutputLayer`` take ``*args, **kwargs``: positional
arguments in the order of each class's keys, keywords by name, anything unset at SMP's default. They share
most keys, so one :class:`TransformerConfig` holds them all and :func:`parse_config` fills it for one class's
keys, refusing a name the class does not take (with the closest one it does).

Which keys change the numbers here, and which only tuned SMP's CUDA kernels, is said in :data:`NO_EFFECT`:
those are accepted with a :class:`smp.NoEffectWarning`.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, fields, replace
from typing import Any

from smp.runtime.compat import warn_no_effect

__all__ = ["TransformerConfig", "parse_config", "ACTIVATIONS", "NO_EFFECT", "LM_HEAD_KEYS", "TRANSFORMER_KEYS",
           "LAYER_KEYS", "ATTENTION_KEYS", "OUTPUT_KEYS"]

ACTIVATIONS = ("gelu", "relu", "gelu_new")  # gelu_new (tanh approximation) is ours: GPT-2/J/Neo's exact function

# Options that selected SMP's fused CUDA kernels or apex's mixed-precision layer norm: the arithmetic here is
# the same without them (masks are always applied; residuals add in the parameters' dtype).
NO_EFFECT = {
    "fused_softmax": "it chose SMP's fused CUDA softmax; torch's softmax computes the same, and masks always apply",
    "fp32_residual_addition": "it needed apex's MixedFusedLayerNorm; residuals add in the parameters' dtype",
}


@dataclass
class TransformerConfig:
    """Every key of SMP v1's distributed transformer modules, with SMP's defaults."""

    num_layers: int = 12
    num_attention_heads: int = 32
    attention_head_size: int = 32
    hidden_size: int = 1024
    intermediate_size: int = 4096
    vocab_size: int = 30522
    num_positions: int = 1024
    attention_dropout_prob: float = 0.1
    hidden_dropout_prob: float = 0.1
    embedding_dropout_prob: float = 0.1
    activation: str = "gelu"
    layernorm_epsilon: float = 1e-5
    mask_value: float = -1e4
    num_token_types: int = 0
    causal_mask_size: int | None = None
    add_cross_attention: bool = False
    cross_attention: bool = False
    add_lm_head: bool = True
    initializer_range: float = 0.02
    use_normal_initialization: bool = False
    pre_layernorm: bool = False
    post_layernorm: bool = True
    attention_in_fp32: bool = False
    query_key_layer_scaling: bool = False
    fp32_residual_addition: bool = False
    fused_softmax: bool = True
    fused_bias_gelu: bool = False
    distribute_embedding: bool = False
    rotary_dim: int | None = None
    rotary_emb_base: int | None = None
    gpt_neox_type_rotary: bool = False
    use_positional_embedding: bool = True
    parallel_attn_output: bool = False
    use_lm_head_bias: bool = False
    attention_layers_type: Any = None
    use_qkv_bias: bool = True
    use_attn_dense_bias: bool = True
    window_size: int | None = None
    final_layernorm: bool = False
    tie_input_output_embedding: bool = True
    single_pre_layernorm: bool = False
    scale_attention_scores: bool = True
    scale_attn_by_layer_idx: bool = False
    input_layer: bool = True
    output_layer: bool = True
    full_attention_mask_and_cross_states: bool = False
    layer_idx: int = 0
    # SMP's internal keys: accepted, no meaning here (they steered its own sharding and tests).
    _scale_qkv_fan_out: bool = False
    _precision_test: bool = False
    _output_full_batch: bool = False

    def validate(self, owner: str) -> None:
        """Raise ``ValueError`` naming ``owner`` for values SMP refuses (or this engine cannot honour)."""
        if not (self.pre_layernorm or self.post_layernorm or self.single_pre_layernorm):
            raise ValueError(f"{owner}: at least one of pre_layernorm, single_pre_layernorm and post_layernorm "
                             "must be True")
        if self.pre_layernorm and self.single_pre_layernorm:
            raise ValueError(f"{owner}: single_pre_layernorm=True needs pre_layernorm=False")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"{owner}: activation={self.activation!r}; use one of {list(ACTIVATIONS)}")
        if self.add_cross_attention or self.cross_attention:
            raise ValueError(f"{owner}: cross attention (add_cross_attention/cross_attention=True) is not "
                             "supported by this engine's smp.nn modules; build the decoder with torch modules, "
                             "which tensor parallelism shards in place")
        if self.num_attention_heads * self.attention_head_size <= 0:
            raise ValueError(f"{owner}: num_attention_heads={self.num_attention_heads} and attention_head_size="
                             f"{self.attention_head_size} must be positive")

    @property
    def attention_size(self) -> int:
        """Heads times head size: the width of the query, key and value projections."""
        return self.num_attention_heads * self.attention_head_size


_COMMON = ("attention_dropout_prob", "hidden_dropout_prob")
LM_HEAD_KEYS = ("num_layers", "num_attention_heads", "attention_head_size", "hidden_size", "intermediate_size",
                "vocab_size", "num_positions", *_COMMON, "embedding_dropout_prob", "activation", "layernorm_epsilon",
                "mask_value", "num_token_types", "causal_mask_size", "add_cross_attention", "add_lm_head",
                "initializer_range", "use_normal_initialization", "pre_layernorm", "post_layernorm",
                "attention_in_fp32", "query_key_layer_scaling", "fp32_residual_addition", "fused_softmax",
                "fused_bias_gelu", "distribute_embedding", "_scale_qkv_fan_out", "_precision_test", "rotary_dim",
                "rotary_emb_base", "gpt_neox_type_rotary", "use_positional_embedding", "parallel_attn_output",
                "use_lm_head_bias", "attention_layers_type", "use_qkv_bias", "use_attn_dense_bias", "window_size",
                "final_layernorm", "tie_input_output_embedding", "single_pre_layernorm", "scale_attention_scores",
                "scale_attn_by_layer_idx")
TRANSFORMER_KEYS = ("num_layers", "num_attention_heads", "attention_head_size", "hidden_size", "intermediate_size",
                    *_COMMON, "activation", "layernorm_epsilon", "mask_value", "initializer_range",
                    "use_normal_initialization", "causal_mask_size", "add_cross_attention", "pre_layernorm",
                    "post_layernorm", "attention_in_fp32", "query_key_layer_scaling", "fp32_residual_addition",
                    "fused_softmax", "fused_bias_gelu", "_scale_qkv_fan_out", "_output_full_batch", "rotary_dim",
                    "rotary_emb_base", "gpt_neox_type_rotary", "parallel_attn_output", "attention_layers_type",
                    "use_qkv_bias", "use_attn_dense_bias", "window_size", "single_pre_layernorm",
                    "scale_attention_scores", "scale_attn_by_layer_idx", "num_positions")
LAYER_KEYS = ("num_attention_heads", "attention_head_size", "hidden_size", "intermediate_size", *_COMMON,
              "activation", "layernorm_epsilon", "mask_value", "initializer_range", "use_normal_initialization",
              "causal_mask_size", "add_cross_attention", "pre_layernorm", "post_layernorm", "attention_in_fp32",
              "query_key_layer_scaling", "fp32_residual_addition", "fused_softmax", "fused_bias_gelu", "input_layer",
              "output_layer", "_output_full_batch", "full_attention_mask_and_cross_states", "_scale_qkv_fan_out",
              "_precision_test", "layer_idx", "rotary_dim", "rotary_emb_base", "gpt_neox_type_rotary",
              "parallel_attn_output", "window_size", "single_pre_layernorm", "scale_attention_scores",
              "scale_attn_by_layer_idx", "num_positions", "use_qkv_bias", "use_attn_dense_bias")
ATTENTION_KEYS = ("num_attention_heads", "attention_head_size", "hidden_size", *_COMMON, "layernorm_epsilon",
                  "mask_value", "initializer_range", "use_normal_initialization", "cross_attention",
                  "causal_mask_size", "pre_layernorm", "post_layernorm", "attention_in_fp32",
                  "query_key_layer_scaling", "fp32_residual_addition", "fused_softmax", "input_layer",
                  "output_layer", "full_attention_mask_and_cross_states", "_scale_qkv_fan_out", "layer_idx",
                  "rotary_dim", "rotary_emb_base", "gpt_neox_type_rotary", "parallel_attn_output", "window_size",
                  "use_qkv_bias", "use_attn_dense_bias", "scale_attention_scores", "scale_attn_by_layer_idx",
                  "num_positions", "single_pre_layernorm")
OUTPUT_KEYS = ("hidden_size", "intermediate_size", "hidden_dropout_prob", "activation", "layernorm_epsilon",
               "fused_bias_gelu", "initializer_range", "use_normal_initialization", "pre_layernorm",
               "post_layernorm", "input_layer", "output_layer", "fp32_residual_addition", "_output_full_batch",
               "layer_idx", "parallel_attn_output", "single_pre_layernorm")

_NAMES = {f.name for f in fields(TransformerConfig)}


def parse_config(owner: str, keys: tuple[str, ...], args: tuple, kwargs: dict[str, Any],
                 base: TransformerConfig | None = None) -> TransformerConfig:
    """``owner``'s configuration from SMP-style ``args`` (in ``keys`` order) and ``kwargs``, over ``base`` (a
    parent module's configuration) or SMP's defaults; warns once for the options that change nothing here."""
    if len(args) > len(keys):
        raise TypeError(f"{owner} takes at most {len(keys)} positional arguments ({', '.join(keys[:4])}, ...), "
                        f"got {len(args)}")
    given = dict(zip(keys, args))
    for name, value in kwargs.items():
        if name not in keys and name not in _NAMES:
            close = difflib.get_close_matches(name, keys, n=1)
            raise TypeError(f"{owner} got an unknown argument {name!r}"
                            + (f": did you mean {close[0]!r}?" if close else f"; it takes {', '.join(keys)}"))
        if name in given:
            raise TypeError(f"{owner} got {name!r} both by position and by keyword")
        given[name] = value
    for name, why in NO_EFFECT.items():
        if given.get(name):
            warn_no_effect(f"{owner}({name}=True)", why, stacklevel=4)
    return replace(base or TransformerConfig(), **given)
