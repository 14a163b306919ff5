"""A reduction of ``model_config.py`` beside SageMaker's public SMP v1 GPT-2 script of 2023 (``train.py``): the GPT-2
config it builds from the arguments, or a Hugging Face model's (the GPT-NeoX, BLOOM and T5 ones are not reduced)."""
from __future__ import annotations

import argparse
from typing import Any

from transformers import AutoConfig, GPT2Config

__all__ = ["get_model_config_from_args"]


def get_model_config_from_args(model_type: str, model_name: str | None, args: argparse.Namespace,
                               log: bool = False) -> tuple[Any, argparse.Namespace]:
    """The model's config, and the arguments: a Hugging Face model's (here a local folder), or GPT-2's from them."""
    if model_name:
        return AutoConfig.from_pretrained(model_name), args
    if model_type != "gpt2":
        raise SystemExit("this reduction builds GPT-2 configs from the arguments only")
    return GPT2Config(vocab_size=args.vocab_size, n_positions=args.max_context_width, n_embd=args.hidden_width,
                      n_layer=args.num_layers, n_head=args.num_heads, n_inner=None, activation_function="gelu_new",
                      resid_pdrop=args.resid_pdrop, embd_pdrop=args.embd_pdrop, attn_pdrop=args.attn_pdrop,
                      layer_norm_epsilon=1e-05, initializer_range=args.initializer_range,
                      summary_first_dropout=args.summary_first_pdrop, use_cache=False,
                      bos_token_id=args.vocab_size - 1, eos_token_id=args.vocab_size - 1, return_dict=True), args
