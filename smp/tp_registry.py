"""Which module classes SMP v1's tensor parallelism replaces by a distributed module, and how.

SMP v1 keeps a registry: ``nn.Linear`` and ``nn.Embedding`` map to ``smp.nn.DistributedLinear`` and
``DistributedEmbedding``; Hugging Face's GPT-2, BERT, RoBERTa, GPT-J and GPT-Neo modules map to SMP's
distributed transformer modules, with an *init hook* (the distributed module's arguments from the original's),
a *forward hook* and a *return hook* (the calls translated both ways) and a pair of state-dict translators;
``smp.tp_register`` (a class decorator) and ``smp.tp_register_with_module`` add a user's own mappings.

A user's registration is kept on the registered class itself (``smp_tp_registration``), so that a decorator
at import time, before ``smp.init``, works as in SMP; registering wraps the class's ``__init__`` to remember
each instance's constructor arguments for the init hook. The predefined mappings
(:mod:`smp.nn.huggingface`) are built on first use.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from smp.nn.dist_module import CallHooks, DistributedModule

__all__ = ["Substitution", "tp_register", "tp_register_with_module", "substitution_for", "ATTRIBUTE"]

ATTRIBUTE = "smp_tp_registration"


@dataclass
class Substitution:
    """How to replace a module of one class by ``dist_class``: ``build(module, overrides)`` makes the
    distributed module (``overrides``: ``smp.tensor_parallelism`` keywords the class takes); ``hooks`` translate
    its calls; ``translate``: ``(smp_to_hf, hf_to_smp)`` state-dict functions, or None."""

    name: str
    dist_class: type
    init: Callable[[torch.nn.Module], tuple[tuple, dict]]
    hooks: CallHooks = field(default_factory=CallHooks)
    translate: tuple[Callable, Callable] | None = None

    def build(self, module: torch.nn.Module, overrides: dict[str, Any]) -> torch.nn.Module:
        """The distributed module standing in for ``module``."""
        args, kwargs = self.init(module)
        dist = self.dist_class(*args, **{**kwargs, **overrides})
        if isinstance(dist, DistributedModule):
            dist.set_call_hooks(self.hooks)
        return dist


def _check_dist(dist_module: Any) -> None:
    if not (isinstance(dist_module, type) and issubclass(dist_module, DistributedModule)):
        raise TypeError(f"tp_register needs a subclass of smp.nn.DistributedModule, got {dist_module!r}")


def tp_register_with_module(module_cls: type, dist_module: type, init_hook: Callable | None = None,
                            forward_hook: Callable | None = None, return_hook: Callable | None = None,
                            translate_functions: tuple[Callable, Callable] | None = None) -> None:
    """Modules of ``module_cls`` created under ``smp.tensor_parallelism()`` become ``dist_module``, built from
    their constructor arguments (through ``init_hook(*args, **kwargs) -> (args, kwargs)`` when given) and called
    through ``forward_hook``/``return_hook`` (SMP v1's ``smp.tp_register_with_module``)."""
    _check_dist(dist_module)
    if not (isinstance(module_cls, type) and issubclass(module_cls, torch.nn.Module)):
        raise TypeError(f"tp_register_with_module needs a torch.nn.Module class, got {module_cls!r}")
    seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    original = module_cls.__init__

    @functools.wraps(original)
    def recording_init(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        if type(self) is module_cls:
            seen[self] = (args, kwargs)
        original(self, *args, **kwargs)

    def init(module: torch.nn.Module) -> tuple[tuple, dict]:
        if module not in seen:
            raise RuntimeError(f"{type(module).__name__} was created before smp.tp_register: register the class "
                               "before creating the model")
        args, kwargs = seen[module]
        out = init_hook(*args, **kwargs) if init_hook is not None else (args, kwargs)
        if out is None:
            raise ValueError(f"the init_hook of {module_cls.__name__} returned None: it must return (args, kwargs) "
                             f"for {dist_module.__name__}")
        return tuple(out[0]), dict(out[1])

    module_cls.__init__ = recording_init  # type: ignore[method-assign]
    setattr(module_cls, ATTRIBUTE, Substitution(f"{module_cls.__name__}->{dist_module.__name__}", dist_module, init,
                                                CallHooks(forward_hook, return_hook), translate_functions))


def tp_register(dist_module: type, init_hook: Callable | None = None, forward_hook: Callable | None = None,
                return_hook: Callable | None = None) -> Callable[[type], type]:
    """Class decorator: the decorated module class maps to ``dist_module`` (SMP v1's ``smp.tp_register``)."""
    _check_dist(dist_module)

    def register(module_cls: type) -> type:
        tp_register_with_module(module_cls, dist_module, init_hook, forward_hook, return_hook)
        return module_cls
    return register


def _from_config(kwargs_of: Callable[[Any], dict], config_of: Callable[[Any], Any] = lambda m: m.config) \
        -> Callable[[torch.nn.Module], tuple[tuple, dict]]:
    return lambda module: ((), kwargs_of(config_of(module)))


@functools.lru_cache(maxsize=1)
def _predefined() -> dict[type, Substitution]:
    """SMP v1's mappings for ``transformers`` models (empty when ``transformers`` is not installed)."""
    try:
        from transformers.models.bert.modeling_bert import BertEncoder
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block, GPT2LMHeadModel
        from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoForCausalLM
        from transformers.models.gptj.modeling_gptj import GPTJForCausalLM
        from transformers.models.roberta.modeling_roberta import RobertaEncoder
    except ImportError:
        return {}
    from smp.nn import DistributedTransformer, DistributedTransformerLayer, DistributedTransformerLMHead
    from smp.nn.huggingface import bert, gpt2, gptj, gptneo, roberta
    from smp.nn.huggingface.hooks import encoder_return_hook

    return {
        GPT2LMHeadModel: Substitution("huggingface-gpt-2", DistributedTransformerLMHead, _from_config(
            gpt2.lm_head_kwargs), CallHooks(gpt2.lm_head_forward_hook, gpt2.lm_head_return_hook),
            (gpt2.translate_state_dict_to_hf_gpt2, gpt2.translate_hf_state_dict_to_smdistributed_gpt2)),
        GPT2Block: Substitution("huggingface-gpt-2-layer", DistributedTransformerLayer, _from_config(
            gpt2.layer_kwargs, lambda m: m.attn.config), CallHooks(gpt2.layer_forward_hook, gpt2.layer_return_hook),
            (gpt2.translate_state_dict_to_hf_gpt2_layer, gpt2.translate_hf_state_dict_to_smdistributed_gpt2_layer)),
        BertEncoder: Substitution("huggingface-bert", DistributedTransformer, _from_config(bert.encoder_kwargs),
                                  CallHooks(bert.forward_hook, encoder_return_hook),
                                  (bert.translate_state_dict_to_hf_bert,
                                   bert.translate_hf_state_dict_to_smdistributed_bert)),
        RobertaEncoder: Substitution("huggingface-roberta", DistributedTransformer, _from_config(
            lambda c: roberta.encoder_kwargs(c, "RoBERTa")), CallHooks(roberta.forward_hook, encoder_return_hook),
            (roberta.translate_state_dict_to_hf_roberta, roberta.translate_hf_state_dict_to_smdistributed_roberta)),
        GPTJForCausalLM: Substitution("huggingface-gpt-j", DistributedTransformerLMHead, _from_config(
            gptj.lm_head_kwargs), CallHooks(gptj.forward_hook, gptj.return_hook),
            (gptj.translate_state_dict_to_hf_gptj, gptj.translate_hf_state_dict_to_smdistributed_gptj)),
        GPTNeoForCausalLM: Substitution("huggingface-gpt-neo", DistributedTransformerLMHead, _from_config(
            gptneo.lm_head_kwargs), CallHooks(gptneo.forward_hook, gptneo.return_hook),
            (gptneo.translate_state_dict_to_hf_gptneo, gptneo.translate_hf_state_dict_to_smdistributed_gptneo)),
    }


def substitution_for(module: torch.nn.Module) -> Substitution | None:
    """The registered substitution of ``module``'s exact class (a user's registration first), or None."""
    own = vars(type(module)).get(ATTRIBUTE)
    return own if isinstance(own, Substitution) else _predefined().get(type(module))
