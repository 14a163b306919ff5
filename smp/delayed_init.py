"""Building a model too large for one device: SMP v1's ``smp.delay_param_initialization`` (its later name,
``smp.model_creation``, also marks modules for tensor parallelism: :mod:`smp.tensor_parallel`).

Modules built inside get their parameters on the meta device (no memory, no initialisation cost); after
partitioning each rank materialises and initialises only its own stages' tensors
(:mod:`smp.engine.materialize`). Buffers stay real: they are small and often computed, like rotary
frequencies. Each such module remembers the torch seed in effect when it was built
(:data:`smp.engine.materialize.INIT_SEED`): its initial values are drawn from that seed, as a module built with
weights draws them then, so ranks that seed their streams apart after building the model (SMP's published
``set_seed(seed + smp.tp_rank())``, for their own dropout) still start from one model.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from smp.engine.materialize import INIT_SEED

__all__ = ["delay_param_initialization"]


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
            setattr(module, INIT_SEED, torch.initial_seed())

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
