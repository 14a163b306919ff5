"""Measuring the activations autograd saves: the ground truth for the memory model's activation count.

Method: run one forward (one microbatch) under ``torch.autograd.graph.saved_tensors_hooks``; every tensor autograd
packs for backward passes through the pack hook, which records its storage -- the memory it keeps alive -- once,
with the module paths (innermost module running, by forward pre- and post-hooks) whose ops saved it. Storages of
the model's parameters and buffers (and so of their views and transposes) are left out: they are held anyway.
This is what :mod:`partitioner.capture.autograd_saves` predicts from the traced graph (``OpGraph.act_bytes``): the
predicted activations of a plan's stage against :meth:`SavedActivations.bytes_under` of the stage module
(``plan.as_module()`` runs its stages as ``stages.0``, ``stages.1``, ...).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SavedActivations", "measure_saved_activations"]


@dataclass(frozen=True)
class SavedActivations:
    """The distinct storages autograd saved in one forward: per storage, its bytes and the module paths whose
    ops saved it (``""``: the root module)."""

    storages: tuple[tuple[int, tuple[str, ...]], ...]

    @property
    def total_bytes(self) -> int:
        """Bytes of every distinct saved storage, each counted once."""
        return sum(nbytes for nbytes, _ in self.storages)

    def bytes_under(self, prefix: str) -> int:
        """Bytes of the distinct storages saved by the module ``prefix`` or its submodules (a storage saved under
        two prefixes counts in both, as two pipeline stages would each hold it)."""
        def under(path: str) -> bool:
            return not prefix or path == prefix or path.startswith(prefix + ".")
        return sum(nbytes for nbytes, paths in self.storages if any(under(p) for p in paths))


def measure_saved_activations(model: torch.nn.Module, args: tuple = (), kwargs: dict[str, Any] | None = None
                              ) -> SavedActivations:
    """Run ``model(*args, **kwargs)`` once with gradients on and return what autograd saved for its backward
    (parameters and buffers excluded); the forward's output is dropped, no backward runs."""
    held = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    stack: list[str] = [""]
    saved: dict[int, tuple[int, set[str]]] = {}
    handles = []

    def leave(_module: torch.nn.Module, _args: Any, _out: Any) -> None:
        stack.pop()  # a forward hook that returned the name would replace the module's output

    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(lambda _m, _a, name=name: stack.append(name)))
            handles.append(module.register_forward_hook(leave))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() and ptr not in held:
            saved.setdefault(ptr, (storage.nbytes(), set()))[1].add(stack[-1])
        return t

    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*args, **(kwargs or {}))
    finally:
        for h in handles:
            h.remove()
    del out  # the saved tensors stayed alive (and their addresses distinct) until here
    return SavedActivations(tuple((nbytes, tuple(sorted(paths))) for nbytes, paths in saved.values()))
