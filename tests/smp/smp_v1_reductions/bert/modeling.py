"""A reduction of the BERT model beside SageMaker's public SMP v1 BERT script (``bert/bert_example/modeling.py`` of
aws/amazon-sagemaker-examples, NVIDIA's BERT as published there, 2020-11 to 2022-10): what SMP sees of it, written
anew. ``BertConfig.from_json_file``; with ``config.use_sequential`` (the notebook's setting) the encoder is an
``nn.Sequential`` of layers that pass ``(hidden_states, attention_mask)`` tuples; the masked-LM decoder shares its
weight with the word embedding (a parameter of the first and the last stage); ``BertForPreTraining(input_ids,
token_type_ids, attention_mask)`` returns ``(prediction_scores, seq_relationship_score)``; ``ACT2FN`` holds the
``bias_*`` activations the script swaps (``ACT2FN["bias_gelu"] = bias_gelu_training``); and
``checkpoint_activations(flag)`` sets the flag on the modules that have one. Like the published module it imports
``smdistributed.modelparallel.torch.utils.rmsg``.
"""
from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.nn.functional as F
from smdistributed.modelparallel.torch.utils import rmsg  # noqa: F401  (the published module imports it)
from torch import nn

__all__ = ["BertConfig", "BertForPreTraining", "ACT2FN", "bias_gelu_training"]


def bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """GELU of ``bias + y`` by its erf form."""
    x = bias + y
    return x * 0.5 * (1.0 + torch.erf(x / 1.41421))


def bias_gelu_training(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """GELU of ``bias + y`` by torch's kernel (the script installs it for training)."""
    return F.gelu(bias + y)


def bias_tanh(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """tanh of ``bias + y``."""
    return torch.tanh(bias + y)


ACT2FN: dict[str, Any] = {"gelu": lambda x: x * 0.5 * (1.0 + torch.erf(x / 1.41421)), "bias_gelu": bias_gelu,
                          "bias_tanh": bias_tanh, "relu": F.relu}


class BertConfig:
    """The model's hyperparameters, read from a JSON file as the script does."""

    def __init__(self, **values: Any) -> None:
        self.output_all_encoded_layers = False
        self.__dict__.update(values)

    @classmethod
    def from_json_file(cls, path: str) -> "BertConfig":
        """The config a JSON file holds."""
        with open(path, encoding="utf-8") as f:
            return cls(**json.load(f))


class LinearActivation(nn.Module):
    """A linear layer with its bias folded into the activation (``bias_<act>``)."""

    def __init__(self, n_in: int, n_out: int, act: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))
        self.bias = nn.Parameter(torch.empty(n_out))
        self.biased_act_fn = ACT2FN["bias_" + act]
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        nn.init.uniform_(self.bias, -1 / math.sqrt(n_in), 1 / math.sqrt(n_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.biased_act_fn(self.bias, F.linear(x, self.weight))


class BertEmbeddings(nn.Module):
    """Word, position and token-type embeddings, summed and normalised."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.size(1), device=input_ids.device).unsqueeze(0).expand_as(input_ids)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + \
            self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(x))


class BertLayer(nn.Module):
    """Self-attention and the feed-forward block, each with its residual and norm; takes and returns
    ``(hidden_states, attention_mask)`` so that a stack of them is an ``nn.Sequential``."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.heads, self.head_size = c.num_attention_heads, c.hidden_size // c.num_attention_heads
        self.query, self.key, self.value = (nn.Linear(c.hidden_size, c.hidden_size) for _ in range(3))
        self.attn_out = nn.Linear(c.hidden_size, c.hidden_size)
        self.attn_norm = nn.LayerNorm(c.hidden_size, eps=1e-12)
        self.intermediate = LinearActivation(c.hidden_size, c.intermediate_size, c.hidden_act)
        self.output = nn.Linear(c.intermediate_size, c.hidden_size)
        self.out_norm = nn.LayerNorm(c.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)
        self._checkpoint_activations = False

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(*x.shape[:-1], self.heads, self.head_size).permute(0, 2, 1, 3)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, mask = inputs
        q, k, v = self._heads(self.query(h)), self._heads(self.key(h)), self._heads(self.value(h))
        probs = F.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head_size) + mask, dim=-1)
        context = (probs @ v).permute(0, 2, 1, 3).reshape(h.shape)
        h = self.attn_norm(self.dropout(self.attn_out(context)) + h)
        h = self.out_norm(self.dropout(self.output(self.intermediate(h))) + h)
        return h, mask


class BertModel(nn.Module):
    """Embeddings, the encoder (an ``nn.Sequential`` with ``use_sequential``) and the pooler."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.config = c
        self.embeddings = BertEmbeddings(c)
        layers = [BertLayer(c) for _ in range(c.num_hidden_layers)]
        self.encoder = nn.Sequential(*layers) if c.use_sequential else nn.ModuleList(layers)
        self.pooler = LinearActivation(c.hidden_size, c.hidden_size, "tanh")

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = attention_mask.unsqueeze(1).unsqueeze(2).to(self.embeddings.word_embeddings.weight.dtype)
        state = (self.embeddings(input_ids, token_type_ids), (1.0 - mask) * -10000.0)
        if self.config.use_sequential:
            state = self.encoder(state)
        else:
            for layer in self.encoder:
                state = layer(state)
        return state[0], self.pooler(state[0][:, 0])


class BertForPreTraining(nn.Module):
    """BERT with the masked-LM head (its decoder tied to the word embedding) and the next-sentence head."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.config = c
        self.bert = BertModel(c)
        self.transform = LinearActivation(c.hidden_size, c.hidden_size, c.hidden_act)
        self.transform_norm = nn.LayerNorm(c.hidden_size, eps=1e-12)
        self.decoder = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.decoder.weight = self.bert.embeddings.word_embeddings.weight
        self.decoder_bias = nn.Parameter(torch.zeros(c.vocab_size))
        self.seq_relationship = nn.Linear(c.hidden_size, 2)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.data.normal_(mean=0.0, std=c.initializer_range)
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.data.zero_()

    def checkpoint_activations(self, val: bool) -> None:
        """Set ``_checkpoint_activations`` on the modules that have the flag."""
        for m in self.modules():
            if hasattr(m, "_checkpoint_activations"):
                m._checkpoint_activations = val

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sequence, pooled = self.bert(input_ids, token_type_ids, attention_mask)
        scores = self.decoder(self.transform_norm(self.transform(sequence))) + self.decoder_bias
        return scores, self.seq_relationship(pooled)
