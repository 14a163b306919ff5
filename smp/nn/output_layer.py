"""``smp.nn.DistributedTransformerOutputLayer``: SMP v1's feed-forward block of a transformer layer.

``dense1`` (hidden to intermediate), the activation, ``dense2`` (back to hidden), dropout and the residual,
with optional layer norms before (``pre_layernorm``) and after (``layernorm``), as SMP v1 builds it (Vaswani et
al. 2017, arXiv:1706.03762, section 3.3). ``activation`` is SMP's ``"gelu"`` (the exact, erf form) or
``"relu"``; ``fused_bias_gelu=True`` is SMP's fused kernel, which computes GELU's tanh approximation (Hendrycks
and Gimpel 2016, arXiv:1606.08415), and so does it here; ``"gelu_new"`` (ours) names that approximation
directly, as GPT-2, GPT-J and GPT-Neo use it.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from smp.nn.config import OUTPUT_KEYS, TransformerConfig, parse_config
from smp.nn.dist_module import DistributedModule

__all__ = ["DistributedTransformerOutputLayer", "activate"]


def activate(x: torch.Tensor, cfg: TransformerConfig) -> torch.Tensor:
    """SMP's activation of ``cfg`` on ``x`` (see the module docstring)."""
    if cfg.activation == "relu":
        return F.relu(x)
    tanh = cfg.activation == "gelu_new" or cfg.fused_bias_gelu
    return F.gelu(x, approximate="tanh" if tanh else "none")


class DistributedTransformerOutputLayer(DistributedModule):
    """SMP v1's ``DistributedTransformerOutputLayer(hidden_size, intermediate_size, ...)``; ``forward(x)``
    maps ``[batch, seq, hidden]`` to the same shape."""

    def __init__(self, *args: Any, config: TransformerConfig | None = None, **kwargs: Any):
        super().__init__()
        self.config = cfg = parse_config("DistributedTransformerOutputLayer", OUTPUT_KEYS, args, kwargs, config)
        cfg.validate("DistributedTransformerOutputLayer")
        self.dense1 = torch.nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.dense2 = torch.nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.add_layer_norms(cfg.pre_layernorm, cfg.post_layernorm, cfg.hidden_size, cfg.layernorm_epsilon)
        self.dropout = torch.nn.Dropout(cfg.hidden_dropout_prob)
        self.init_children()

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """The feed-forward block with its residual (none with ``parallel_attn_output``: the layer adds it)."""
        cfg = self.config
        x = self.pre_layernorm(inp) if cfg.pre_layernorm else inp
        out = self.dropout(self.dense2(activate(self.dense1(x), cfg)))
        if not cfg.parallel_attn_output:
            out = out + inp
        return self.layernorm(out) if cfg.post_layernorm else out
