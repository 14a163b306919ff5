"""``smp.nn.DistributedTransformerLMHead``: SMP v1's language model (embeddings, transformer, LM head, loss).

Word (``word_embedding``), position (``position_embedding``) and token-type (``token_type_embedding``)
embeddings, dropout, a :class:`smp.nn.DistributedTransformer` (``transformer``), an optional final layer norm
(``layernorm``) and the LM head (``lm_head``, tied to the word embedding unless
``tie_input_output_embedding=False``), as SMP v1 builds it; with labels, the next-token cross-entropy
(logits shifted by one) is computed inside, as SMP does. SMP's hooks make it stand in for GPT-2, GPT-J and
GPT-Neo (:mod:`smp.nn.huggingface`). ``distribute_embedding`` decides whether tensor parallelism splits the
vocabulary of the embedding and head (Megatron's vocabulary-parallel embedding and loss) or keeps them whole
on every tp rank (:func:`smp.tensor_parallel.shardable_parameters`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from smp.nn.config import LM_HEAD_KEYS, TransformerConfig, parse_config
from smp.nn.dist_module import DistributedModule
from smp.nn.layer_norm import FusedLayerNorm
from smp.nn.transformer import DistributedTransformer

__all__ = ["DistributedTransformerLMHead"]


class DistributedTransformerLMHead(DistributedModule):
    """SMP v1's ``DistributedTransformerLMHead(num_layers, num_attention_heads, attention_head_size, hidden_size,
    intermediate_size, vocab_size, num_positions, ...)``. ``forward((input_ids, attention_mask, token_type_ids,
    position_ids, labels))`` returns the logits, or ``(loss, logits)`` when ``labels`` is given;
    ``attention_mask`` is SMP's 0/1 padding mask (1: attend) or None."""

    def __init__(self, *args: Any, config: TransformerConfig | None = None, **kwargs: Any):
        super().__init__()
        self.config = cfg = parse_config("DistributedTransformerLMHead", LM_HEAD_KEYS, args, kwargs, config)
        cfg.validate("DistributedTransformerLMHead")
        if cfg.causal_mask_size is not None and cfg.num_positions > cfg.causal_mask_size:
            raise ValueError(f"DistributedTransformerLMHead: causal_mask_size={cfg.causal_mask_size} must be at least "
                             f"num_positions={cfg.num_positions}")
        self.word_embedding = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if cfg.use_positional_embedding:
            self.position_embedding = torch.nn.Embedding(cfg.num_positions, cfg.hidden_size)
        if cfg.num_token_types > 0:
            self.token_type_embedding = torch.nn.Embedding(cfg.num_token_types, cfg.hidden_size)
        self.dropout = torch.nn.Dropout(cfg.embedding_dropout_prob)
        self.transformer = DistributedTransformer(config=cfg)
        if cfg.final_layernorm:
            self.layernorm = FusedLayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        if cfg.add_lm_head:
            self.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=cfg.use_lm_head_bias)
            if cfg.tie_input_output_embedding:
                self.lm_head.weight = self.word_embedding.weight
        self.init_children()

    def forward(self, inputs: tuple) -> Any:
        """Embed, transform, project to the vocabulary; with labels also the mean next-token loss."""
        input_ids, attention_mask, token_type_ids, _position_ids, labels = inputs
        cfg = self.config
        seq = input_ids.shape[1]
        hidden = self.word_embedding(input_ids)
        if cfg.use_positional_embedding:  # SMP numbers positions itself (position_ids are not read)
            hidden = hidden + self.position_embedding(torch.arange(seq, device=input_ids.device))[None]
        if token_type_ids is not None:
            if cfg.num_token_types == 0:
                raise ValueError("DistributedTransformerLMHead got token_type_ids but was built with "
                                 "num_token_types=0: pass num_token_types, or leave token_type_ids out")
            hidden = hidden + self.token_type_embedding(token_type_ids)
        mask = None
        if attention_mask is not None:  # SMP's additive form of a 0/1 padding mask
            mask = (1.0 - attention_mask.reshape(input_ids.shape[0], -1)[:, None, None, :].to(hidden.dtype)) \
                * -10000.0
        hidden, _ = self.transformer((self.dropout(hidden), mask))
        if cfg.final_layernorm:
            hidden = self.layernorm(hidden)
        if not cfg.add_lm_head:
            return hidden
        logits = self.lm_head(hidden)
        if labels is None:
            return logits
        shifted = logits[..., :-1, :].contiguous()
        loss = F.cross_entropy(shifted.view(-1, shifted.shape[-1]), labels[..., 1:].contiguous().view(-1))
        return loss, logits
