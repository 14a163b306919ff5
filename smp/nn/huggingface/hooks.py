"""The call hooks that let SMP v1's distributed modules stand in for Hugging Face modules.

SMP v1 substitutes a supported ``transformers`` module created under ``smp.tensor_parallelism()`` by a
distributed module built from the model's config (the *init hook*), called with the original module's
arguments turned into the distributed module's (the *forward hook*), whose outputs are turned back into the
original's output object (the *return hook*). The forward hooks refuse what the distributed modules cannot do
(a KV cache, attention outputs, head masks) with an error that names the argument; the shared parts are here,
the per-model ones in :mod:`smp.nn.huggingface.gpt2`, ``bert``, ``roberta``, ``gptj`` and ``gptneo``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["refuse_unsupported", "lm_forward_hook", "lm_return_hook", "encoder_forward_hook", "encoder_return_hook",
           "hf_activation", "additive_mask"]

_OFF = (None, False)


def refuse_unsupported(model: str, **options: Any) -> None:
    """Raise ``ValueError`` naming each option of ``model``'s forward that is set and not supported here."""
    bad = sorted(k for k, v in options.items()
                 if not (v in _OFF if not isinstance(v, (tuple, list)) else all(x is None for x in v)))
    if bad:
        raise ValueError(f"{model} under smp.tensor_parallelism() does not support {', '.join(bad)} (SMP v1's "
                         "distributed transformer has no KV cache, attention outputs or head masks): leave them "
                         "unset, or create the model outside smp.tensor_parallelism()")


def lm_forward_hook(model: str) -> Callable[..., tuple[tuple, dict]]:
    """A causal-LM forward hook: ``model(input_ids, attention_mask=..., labels=...)`` as
    ``DistributedTransformerLMHead((input_ids, attention_mask, token_type_ids, position_ids, labels))``."""

    def hook(input_ids: Any = None, past_key_values: Any = None, attention_mask: Any = None,
             token_type_ids: Any = None, position_ids: Any = None, labels: Any = None, return_dict: Any = None,
             **rest: Any) -> tuple[tuple, dict]:
        refuse_unsupported(model, past_key_values=past_key_values, **rest)
        if return_dict is False:
            raise ValueError(f"{model} under smp.tensor_parallelism() returns an output object: leave return_dict "
                             "unset or True")
        return ((input_ids, attention_mask, token_type_ids, position_ids, labels),), {}
    return hook


def lm_return_hook(output_class: Callable[..., Any]) -> Callable[[Any], Any]:
    """A causal-LM return hook: ``logits`` or ``(loss, logits)`` as the model's ``output_class``."""

    def hook(outputs: Any) -> Any:
        if isinstance(outputs, torch.Tensor):
            return output_class(logits=outputs)
        return output_class(loss=outputs[0], logits=outputs[-1])
    return hook


def additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """An encoder's attention mask in the additive form the distributed layers add to the scores: a boolean
    mask (True: attend) becomes 0 / -10000, a float one is already additive."""
    if mask is None or mask.is_floating_point():
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask.bool(), -10000.0)


def encoder_forward_hook(model: str) -> Callable[..., tuple[tuple, dict]]:
    """An encoder forward hook: ``encoder(hidden_states, attention_mask, ...)`` as
    ``DistributedTransformer((hidden_states, attention_mask))``."""

    def hook(hidden_states: torch.Tensor, attention_mask: Any = None, head_mask: Any = None,
             encoder_hidden_states: Any = None, encoder_attention_mask: Any = None, past_key_values: Any = None,
             return_dict: Any = None, **rest: Any) -> tuple[tuple, dict]:
        refuse_unsupported(model, head_mask=head_mask, encoder_hidden_states=encoder_hidden_states,
                           encoder_attention_mask=encoder_attention_mask, past_key_values=past_key_values,
                           **{k: v for k, v in rest.items() if k not in ("cache_position", "position_ids")})
        return ((hidden_states, additive_mask(attention_mask, hidden_states.dtype)),), {}
    return hook


def encoder_return_hook(outputs: tuple) -> Any:
    """``(hidden_states, mask)`` as ``transformers``' encoder output object."""
    from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

    return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=outputs[0])


def hf_activation(name: str, model: str) -> str:
    """SMP's activation for a Hugging Face ``activation_function``/``hidden_act``; others are refused."""
    known = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
    if name not in known:
        raise ValueError(f"{model} with activation {name!r} cannot be distributed by smp.tensor_parallelism(): "
                         f"SMP's distributed transformer supports {sorted(known)}; create the model outside the "
                         "context (tensor parallelism then shards it in place)")
    return known[name]
