"""``smp.nn.DistributedTransformerLayer`` and ``DistributedTransformer``: SMP v1's transformer layer and stack.

A layer is an attention block (:class:`smp.nn.DistributedAttentionLayer`, ``.attention``) followed by a
feed-forward block (:class:`smp.nn.DistributedTransformerOutputLayer`, ``.output``), or, with
``parallel_attn_output`` (GPT-J; Wang and Komatsuzaki 2021), both applied to one normalised input
(``single_pre_layernorm``) and summed with the residual. The stack keeps its layers in ``seq_layers`` (an
``nn.Sequential``), the path SMP v1 scripts reach (``model.transformer.seq_layers[i].attention``). Where the
layer norms go follows SMP: post-norm everywhere (BERT), pre-norm everywhere with one final norm in the last
layer's output block (GPT-2: ``pre_layernorm`` and ``post_layernorm``), or pre-norm only.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from smp.nn.attention import DistributedAttentionLayer
from smp.nn.config import LAYER_KEYS, TRANSFORMER_KEYS, TransformerConfig, parse_config
from smp.nn.dist_module import DistributedModule
from smp.nn.layer_norm import FusedLayerNorm
from smp.nn.output_layer import DistributedTransformerOutputLayer

__all__ = ["DistributedTransformerLayer", "DistributedTransformer"]

Inputs = tuple[torch.Tensor, "torch.Tensor | None"]


class DistributedTransformerLayer(DistributedModule):
    """SMP v1's ``DistributedTransformerLayer(num_attention_heads, attention_head_size, hidden_size,
    intermediate_size, ...)``; ``forward((hidden_states, attention_mask))`` returns ``(output, attention_mask)``."""

    def __init__(self, *args: Any, config: TransformerConfig | None = None, **kwargs: Any):
        super().__init__()
        self.config = cfg = parse_config("DistributedTransformerLayer", LAYER_KEYS, args, kwargs, config)
        cfg.validate("DistributedTransformerLayer")
        if cfg.single_pre_layernorm:
            self.pre_layernorm = FusedLayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        # With norms before and after, the attention block's post-norm is the output block's pre-norm.
        attention_post = cfg.post_layernorm and not cfg.pre_layernorm
        self.attention = DistributedAttentionLayer(config=replace(cfg, post_layernorm=attention_post))
        self.output = DistributedTransformerOutputLayer(config=cfg)
        self.init_children()

    def forward(self, inp: Inputs) -> Inputs:
        """One transformer layer on ``(hidden_states, attention_mask)``."""
        hidden, mask = inp
        residual = hidden
        if self.config.single_pre_layernorm:
            hidden = self.pre_layernorm(hidden)
        attended = self.attention((hidden, mask))
        if self.config.parallel_attn_output:
            return self.output(hidden) + attended + residual, mask
        return self.output(attended), mask


class DistributedTransformer(DistributedModule):
    """SMP v1's ``DistributedTransformer(num_layers, num_attention_heads, attention_head_size, hidden_size,
    intermediate_size, ...)``: ``num_layers`` layers in ``seq_layers``; ``forward((hidden_states,
    attention_mask))`` returns ``(output, attention_mask)``."""

    def __init__(self, *args: Any, config: TransformerConfig | None = None, **kwargs: Any):
        super().__init__()
        self.config = cfg = parse_config("DistributedTransformer", TRANSFORMER_KEYS, args, kwargs, config)
        cfg.validate("DistributedTransformer")
        kinds = cfg.attention_layers_type or ["global"] * cfg.num_layers
        if len(kinds) != cfg.num_layers:
            raise ValueError(f"DistributedTransformer: attention_layers_type has {len(kinds)} entries for "
                             f"num_layers={cfg.num_layers}")
        last = cfg.num_layers - 1
        self.seq_layers = torch.nn.Sequential(*(DistributedTransformerLayer(config=replace(
            cfg, layer_idx=i, input_layer=i == 0, output_layer=i == last,
            post_layernorm=cfg.post_layernorm and (i == last or not cfg.pre_layernorm),
            window_size=cfg.window_size if kinds[i] == "local" else None)) for i in range(cfg.num_layers)))

    def forward(self, inp: Inputs) -> Inputs:
        """The layers in turn on ``(hidden_states, attention_mask)``."""
        return self.seq_layers(inp)
