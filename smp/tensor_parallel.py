"""``smp.tensor_parallelism``: SMP v1's context manager for creating tensor-parallel modules.

In SMP v1 supported modules created inside ``with smp.tensor_parallelism():`` are replaced by distributed
versions when ``tensor_parallel_degree`` > 1. This engine shards a model's layers in place instead, on its
traced graph (:mod:`partitioner.sharding`: Megatron's column/row pattern, vocabulary-parallel embedding, head
and loss), whatever context created them, keeping the model's own parameter names; so the modules created
inside are left as they are. Its keyword arguments configure SMP's distributed modules (``fused_softmax``,
``fused_bias_gelu``, ...), which are not substituted here, so they warn that they have no effect.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from smp.runtime import state
from smp.runtime.compat import warn_no_effect

__all__ = ["tensor_parallelism"]


@contextmanager
def tensor_parallelism(enabled: bool = True, **kwargs: Any) -> Iterator[None]:
    """Modules created inside would be SMP v1's distributed modules at a tensor_parallel_degree above 1; here
    they stay as created, and the traced graph is sharded at partitioning (see the module docstring)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"smp.tensor_parallelism(enabled={enabled!r}): enabled must be True or False")
    state.get()  # as in SMP: smp.init comes first
    if kwargs:
        warn_no_effect(f"smp.tensor_parallelism({', '.join(f'{k}=...' for k in sorted(kwargs))})",
                       "they configure SMP's distributed modules, and this engine shards the traced graph instead",
                       stacklevel=3)
    yield
