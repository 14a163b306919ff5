"""Building a model too large for one device: SMP v1's ``smp.delay_param_initialization`` and
``smp.model_creation``.

Modules built inside get their parameters on the meta device (no memory, no initialisation cost); after
partitioning each rank materialises and initialises only its own stages' tensors
(:mod:`smp.engine.materialize`). Buffers stay real: they are small and often computed, like rotary
frequencies.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from smp.runtime import state
from smp.runtime.compat import warn_no_effect

__all__ = ["delay_param_initialization", "model_creation"]


@contextmanager
def delay_param_initialization(enabled: bool = True) -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no initialisation cost);
    ``smp.DistributedModel`` materialises each rank's own after partitioning. Buffers stay real."""
    if not enabled:
        yield
        return
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), param.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


@contextmanager
def model_creation(tensor_parallelism: bool = False, dtype: torch.dtype | None = None,
                   **tensor_parallel_config: object) -> Iterator[None]:
    """SMP v1's later context for building the model: parameters are created without memory when the
    config's ``delayed_parameter_initialization`` is on, in ``dtype`` when given (the default dtype inside)."""
    if tensor_parallelism or tensor_parallel_config:
        warn_no_effect("smp.model_creation(tensor_parallelism=...)", "this engine has no tensor parallelism", 3)
    delayed = state.is_initialized() and state.get().config.delayed_parameter_initialization
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        with delay_param_initialization(delayed):
            yield
    finally:
        torch.set_default_dtype(previous)
