"""``DistributedModule``: the base of SMP v1's distributed modules, and the call hooks of a substituted module.

In SMP v1 a distributed module holds only its tensor-parallel rank's slice of each weight and calls the
collectives itself. Here a distributed module computes the single-device function with full-size weights and
SMP's parameter names; ``smp.DistributedModel`` splits it with the engine's tensor parallelism (Megatron's
pattern found on the traced graph, :mod:`partitioner.tp.sharding`), after which the module's parameters are this
rank's slices, as in SMP. When a module of another library was substituted by a distributed one
(:mod:`smp.tensor_parallel`), SMP's forward hook turns the original module's call arguments into the
distributed module's and its return hook turns the outputs back (a ``transformers`` output object, say):
:class:`CallHooks`, kept on the instance.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from smp.nn.layer_norm import FusedLayerNorm

__all__ = ["DistributedModule", "CallHooks"]


@dataclass
class CallHooks:
    """SMP's ``forward_hook(*args, **kwargs) -> (args, kwargs)`` and ``return_hook(outputs) -> outputs``."""

    forward: Callable[..., tuple[tuple, dict]] | None = None
    result: Callable[[Any], Any] | None = None


def _hooked_forward(module: "DistributedModule", *args: Any, **kwargs: Any) -> Any:
    hooks = module.call_hooks
    if hooks.forward is not None:
        args, kwargs = hooks.forward(*args, **kwargs)
    out = type(module).forward(module, *args, **kwargs)
    return hooks.result(out) if hooks.result is not None else out


class DistributedModule(torch.nn.Module):
    """A module that tensor parallelism splits as a whole (SMP v1's ``smp.nn.DistributedModule``)."""

    def __init__(self) -> None:
        super().__init__()
        self.call_hooks = CallHooks()

    def set_call_hooks(self, hooks: CallHooks) -> None:
        """Call this module as the module it replaced is called: ``hooks`` wrap this instance's ``forward`` (an
        instance attribute, so that ``torch.export`` traces through the hooks too, and copies of the module
        keep them)."""
        self.call_hooks = hooks
        if hooks.forward is not None or hooks.result is not None:
            self.forward = types.MethodType(_hooked_forward, self)

    @staticmethod
    def can_distribute(*args: Any, **kwargs: Any) -> bool:
        """Whether the given constructor arguments can be distributed (SMP's hook; always here)."""
        return True

    def add_layer_norms(self, pre: bool, post: bool, size: int, eps: float) -> None:
        """SMP's optional norms of a block: ``pre_layernorm`` on its input, ``layernorm`` after its residual."""
        if pre:
            self.pre_layernorm = FusedLayerNorm(size, eps=eps)
        if post:
            self.layernorm = FusedLayerNorm(size, eps=eps)

    def init_children(self) -> None:
        """SMP's normal initialisation (``use_normal_initialization``) of the torch modules this module owns
        directly (distributed submodules do their own)."""
        cfg = getattr(self, "config", None)
        if cfg is not None and cfg.use_normal_initialization:
            with torch.no_grad():
                for child in self.children():
                    if not isinstance(child, DistributedModule):
                        self._init_weights(child)

    def _init_weights(self, module: torch.nn.Module) -> None:
        """SMP's initialisation of one submodule (used for delayed initialisation): normal with
        ``initializer_range`` when ``use_normal_initialization``, torch's default otherwise; biases zero,
        layer norms one and zero."""
        cfg = getattr(self, "config", None)
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and cfg is not None \
                and cfg.use_normal_initialization:
            torch.nn.init.normal_(module.weight, 0.0, cfg.initializer_range)
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                torch.nn.init.zeros_(module.bias)
            return
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
