"""SMP v1's methods of ``smp.DistributedModel`` beyond a torch module's: its hooks (post-partition, post-step), the
wrapped module (``get_module``) and which parameters tensor parallelism split (``is_distributed_parameter``), as
:class:`ModelHooks`, a base class of :class:`smp.distributed_model.DistributedModel`.

A hook registered once the model is partitioned runs at once, as in SMP: SageMaker's 2022 GPT-2 script, resuming,
registers the post-partition hook that loads its fp16 optimizer's state from inside a post-step hook.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch
from torch.utils.hooks import RemovableHandle

from smp.checkpoint.tp_state import TPLayout
from smp.module_view import wrapped_module
from smp.runtime import state

__all__ = ["ModelHooks"]


class ModelHooks:
    """Hooks, ``get_module`` and ``is_distributed_parameter`` (see the module docstring)."""

    module: torch.nn.Module
    partitioned: bool
    _post_partition_hooks: list[Callable[[Any, Any], None]]
    _post_step_hooks: OrderedDict[int, Callable[[Any, Any], None]]

    def tensor_parallel_layout(self) -> TPLayout:
        """This rank's tensor-parallel layout (the model class defines it)."""
        raise NotImplementedError

    def register_post_partition_hook(self, fn: Callable[[Any, Any], None]) -> None:
        """``fn(model, optimizer)`` runs once, right after partitioning (at once when the model is partitioned
        already); ``optimizer`` is the DistributedOptimizer (None when there is none yet), as SMP passes it."""
        if self.partitioned:
            fn(self, state.get().optimizer)
        else:
            self._post_partition_hooks.append(fn)

    def get_module(self) -> torch.nn.Module:
        """The module this DistributedModel wraps (SMP: the model without its wrappers), ``model.module.module``."""
        return wrapped_module(self.module)

    def is_distributed_parameter(self, param: torch.Tensor) -> bool:
        """Is ``param`` split over the tensor-parallel ranks (each holds a shard of it)? False before partitioning."""
        if not self.partitioned:
            return False
        shards = self.tensor_parallel_layout().shards
        return any(p is param for name, p in self.module.named_parameters(remove_duplicate=False) if name in shards)

    def register_post_step_hook(self, fn: Callable[[Any, Any], None]) -> RemovableHandle | None:
        """``fn(model, optimizer)`` runs once, after the step that partitions the model (the first), as in
        SMP -- e.g. to load optimizer state, which exists only then. Registered when the model is already
        partitioned and a DistributedOptimizer exists, it runs at once and None is returned; otherwise the
        returned handle's ``remove()`` cancels it."""
        optimizer = state.get().optimizer
        if self.partitioned and optimizer is not None:
            fn(self, optimizer)
            return None
        handle = RemovableHandle(self._post_step_hooks)
        self._post_step_hooks[handle.id] = fn
        return handle

    def run_post_step_hooks(self) -> None:
        """Called by ``@smp.step`` after each step: the hooks waiting for a partitioned model run, once."""
        if self.partitioned and self._post_step_hooks:
            hooks = list(self._post_step_hooks.values())
            self._post_step_hooks.clear()
            for fn in hooks:
                fn(self, state.get().optimizer)
