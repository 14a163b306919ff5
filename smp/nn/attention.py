"""``smp.nn.DistributedAttentionLayer``: SMP v1's multi-head self-attention block, with its submodule names.

Scaled dot-product attention (Vaswani et al. 2017, "Attention Is All You Need", arXiv:1706.03762) over
separate ``query``/``key``/``value`` projections and an output projection ``dense``, with optional layer norms
before (``pre_layernorm``) or after (``layernorm``) the residual, as SMP v1 builds it. Its options reproduce
the attention of the models SMP substitutes: GPT-2's causal mask (``causal_mask_size``) and per-layer scaling
(``scale_attn_by_layer_idx``), GPT-Neo's unscaled scores and local windows (``scale_attention_scores``,
``window_size``), GPT-J's rotary embedding of the first ``rotary_dim`` features of each head (Su et al. 2021,
"RoFormer", arXiv:2104.09864; ``gpt_neox_type_rotary`` for GPT-NeoX's rotate-half variant).
``attention_in_fp32`` and ``query_key_layer_scaling`` compute the scores or the softmax in float32 under
mixed precision, as in SMP. Every tensor-parallel split is the engine's (:mod:`smp.nn.dist_module`).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from smp.nn.config import ATTENTION_KEYS, TransformerConfig, parse_config
from smp.nn.dist_module import DistributedModule

__all__ = ["DistributedAttentionLayer", "causal_mask", "apply_rotary"]


def causal_mask(query_len: int, key_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """``[query_len, key_len]`` booleans: key j is visible from query i (the last ``query_len`` positions of
    ``key_len``) when j <= i, and i - j < ``window`` for a local layer."""
    q = torch.arange(key_len - query_len, key_len, device=device)[:, None]
    k = torch.arange(key_len, device=device)[None, :]
    visible = k <= q
    return visible & (q - k < window) if window is not None else visible


def _rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, dim: int, base: float, neox: bool) -> torch.Tensor:
    """Rotary position embedding of the first ``dim`` features of each head of ``x`` ``[batch, seq, heads,
    head_size]``: GPT-J's interleaved pairs, or GPT-NeoX's halves with ``neox``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=x.device).float() / dim))
    angles = torch.arange(x.shape[1], dtype=torch.int64, device=x.device).float()[:, None] * inv_freq[None, :]
    if neox:
        angles = torch.cat((angles, angles), dim=-1)
    else:
        angles = torch.repeat_interleave(angles, 2, dim=-1)
    sin, cos = torch.sin(angles)[None, :, None, :], torch.cos(angles)[None, :, None, :]
    rot, rest = x[..., :dim], x[..., dim:]
    rot = rot * cos + (_rotate_half(rot) if neox else _rotate_every_two(rot)) * sin
    return torch.cat([rot, rest], dim=-1)


class DistributedAttentionLayer(DistributedModule):
    """SMP v1's ``DistributedAttentionLayer(num_attention_heads, attention_head_size, hidden_size, ...)``;
    ``forward((hidden_states, attention_mask))`` returns the block's output (``attention_mask``: additive,
    broadcastable to ``[batch, heads, seq, seq]``, or None)."""

    def __init__(self, *args: Any, config: TransformerConfig | None = None, **kwargs: Any):
        super().__init__()
        self.config = cfg = parse_config("DistributedAttentionLayer", ATTENTION_KEYS, args, kwargs, config)
        cfg.validate("DistributedAttentionLayer")
        size = cfg.attention_size
        self.query = torch.nn.Linear(cfg.hidden_size, size, bias=cfg.use_qkv_bias)
        self.key = torch.nn.Linear(cfg.hidden_size, size, bias=cfg.use_qkv_bias)
        self.value = torch.nn.Linear(cfg.hidden_size, size, bias=cfg.use_qkv_bias)
        self.dropout1 = torch.nn.Dropout(cfg.attention_dropout_prob)
        self.dense = torch.nn.Linear(size, cfg.hidden_size, bias=cfg.use_attn_dense_bias)
        self.add_layer_norms(cfg.pre_layernorm, cfg.post_layernorm, cfg.hidden_size, cfg.layernorm_epsilon)
        self.dropout2 = torch.nn.Dropout(cfg.hidden_dropout_prob)
        self.init_children()

    def forward(self, inp: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        """The attention block on ``(hidden_states, attention_mask)``: ``[batch, seq, hidden]`` out."""
        hidden, mask = inp
        cfg = self.config
        residual = hidden
        if cfg.pre_layernorm:
            hidden = self.pre_layernorm(hidden)
        q, k, v = (self._heads(proj(hidden)) for proj in (self.query, self.key, self.value))
        if cfg.rotary_dim is not None:
            base = float(cfg.rotary_emb_base or 10000)
            q = apply_rotary(q, cfg.rotary_dim, base, cfg.gpt_neox_type_rotary)
            k = apply_rotary(k, cfg.rotary_dim, base, cfg.gpt_neox_type_rotary)
        context = self._attend(q.permute(0, 2, 1, 3), k.permute(0, 2, 3, 1), v.permute(0, 2, 1, 3), mask)
        context = context.permute(0, 2, 1, 3).reshape(*hidden.shape[:-1], cfg.attention_size)
        out = self.dropout2(self.dense(context))
        if not cfg.parallel_attn_output:
            out = out + residual
        return self.layernorm(out) if cfg.post_layernorm else out

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], self.config.num_attention_heads, self.config.attention_head_size)

    def _attend(self, q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        cfg = self.config
        dtype = q.dtype
        if cfg.attention_in_fp32:
            q, k_t = q.float(), k_t.float()
        scores = torch.matmul(q, k_t)
        if cfg.scale_attention_scores:
            scores = scores / math.sqrt(cfg.attention_head_size)
        if cfg.scale_attn_by_layer_idx:
            scores = scores / float(cfg.layer_idx + 1)
        scores = scores.to(dtype)
        if cfg.causal_mask_size is not None:
            visible = causal_mask(scores.shape[-2], scores.shape[-1], cfg.window_size, scores.device)
            scores = torch.where(visible, scores, torch.tensor(cfg.mask_value, dtype=dtype, device=scores.device))
        if cfg.query_key_layer_scaling:  # as SMP: the softmax in float32, the per-layer scale undone there
            scores = scores.float()
            if cfg.scale_attn_by_layer_idx:
                scores = scores * float(cfg.layer_idx + 1)
        if mask is not None:
            scores = scores + mask.to(scores.dtype)
        probs = self.dropout1(F.softmax(scores, dim=-1).to(dtype))
        return torch.matmul(probs, v)
