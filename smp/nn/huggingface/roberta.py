"""RoBERTa (Liu et al. 2019, arXiv:1907.11692) as SMP v1's ``DistributedTransformer``: its encoder is BERT's.

``RobertaEncoder`` created under ``smp.tensor_parallelism()`` becomes a ``DistributedTransformer``, with the
keys of :mod:`smp.nn.huggingface.bert`. SMP v1's names: ``translate_hf_state_dict_to_smdistributed_roberta``
(also ``translate_hf_state_dict_to_smdistributed``, and ``translate_state_dict_to_smdistributed`` as SMP's
documentation spells it) and ``translate_state_dict_to_hf_roberta``.
"""
from __future__ import annotations

from typing import Any

from smp.nn.huggingface.bert import RULES, encoder_kwargs
from smp.nn.huggingface.hooks import encoder_forward_hook
from smp.nn.huggingface.mapping import to_hf, to_smp

__all__ = ["encoder_kwargs", "forward_hook", "translate_hf_state_dict_to_smdistributed_roberta",
           "translate_hf_state_dict_to_smdistributed", "translate_state_dict_to_smdistributed",
           "translate_state_dict_to_hf_roberta"]

forward_hook = encoder_forward_hook("RobertaEncoder")


def translate_hf_state_dict_to_smdistributed_roberta(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A RoBERTa model's state dict with ``DistributedTransformer``'s keys for its encoder."""
    return to_smp(state_dict, RULES)


translate_hf_state_dict_to_smdistributed = translate_hf_state_dict_to_smdistributed_roberta
translate_state_dict_to_smdistributed = translate_hf_state_dict_to_smdistributed_roberta


def translate_state_dict_to_hf_roberta(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`translate_hf_state_dict_to_smdistributed_roberta`."""
    return to_hf(state_dict, RULES)
