"""``smp.utils``: helpers SMP v1 scripts import from ``smdistributed.modelparallel.torch.utils``.

``rmsg`` tags a log line with the rank that wrote it, as SMP's does (``[<rank>] message``), so the
interleaved output of many processes can be told apart. ``get_distribution_axis`` says along which dimension
tensor parallelism split a parameter (the fp16 package beside SageMaker's 2022 GPT-2 script notes it for each
parameter).
"""
from __future__ import annotations

from typing import Any

import torch

from smp.runtime import state

__all__ = ["rmsg", "get_distribution_axis"]


def rmsg(msg: Any) -> str:
    """``msg`` prefixed with this process's global rank: ``rmsg("loss 0.5")`` -> ``"[3] loss 0.5"``."""
    return f"[{state.get().rank}] {msg}"


def get_distribution_axis(param: torch.Tensor) -> int | None:
    """The dimension along which tensor parallelism split ``param`` over the tp ranks (each holds a slice of it),
    or None for a parameter that every tp rank holds whole (or before the model is partitioned)."""
    model = state.get().model
    if model is None or not model.partitioned:
        return None
    shards = model.tensor_parallel_layout().shards
    return next((shards[name].dim for name, p in model.module.named_parameters(remove_duplicate=False)
                 if p is param and name in shards), None)
