"""``smp.tensor_parallelism``: SMP v1's context manager for creating tensor-parallel modules.

In SMP v1 supported modules created inside ``with smp.tensor_parallelism():`` are replaced by distributed
versions when ``tensor_parallel_degree`` > 1; with a degree of 1 nothing is distributed and the modules
stay what they are. This engine runs pipeline and data parallelism only, so the degree is 1 (``smp.init``
refuses a larger one with a clear error), and the context manager is exactly SMP's degree-1 behaviour: the
modules created inside are left alone. Its keyword arguments configure SMP's distributed modules
(``fused_softmax``, ``fused_bias_gelu``, ...); there are none here, so they warn that they have no effect.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from smp.runtime import state
from smp.runtime.compat import warn_no_effect

__all__ = ["tensor_parallelism"]


@contextmanager
def tensor_parallelism(enabled: bool = True, **kwargs: Any) -> Iterator[None]:
    """Modules created inside would be tensor-parallel in SMP v1 at a tensor_parallel_degree above 1; at
    this engine's degree of 1 they stay as created (``smp.init`` has refused any other degree)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"smp.tensor_parallelism(enabled={enabled!r}): enabled must be True or False")
    state.get()  # as in SMP: smp.init comes first
    if kwargs:
        warn_no_effect(f"smp.tensor_parallelism({', '.join(f'{k}=...' for k in sorted(kwargs))})",
                       "they configure tensor-parallel modules, and tensor_parallel_degree is 1 here",
                       stacklevel=3)
    yield
