"""``smp.amp.GradScaler``: fp16 loss scaling that agrees across pipeline stages (SMP v1's name for
:class:`smp.engine.grad_scaler.PipelineGradScaler` over the world group ``smp.init`` made).
"""
from __future__ import annotations

from typing import Any

from smp.engine.grad_scaler import PipelineGradScaler
from smp.runtime import state

__all__ = ["GradScaler"]


class GradScaler(PipelineGradScaler):
    """SMP v1's ``smp.amp.GradScaler(device=None, **kwargs)``: torch's ``GradScaler`` arguments; an overflow on
    any rank skips the step on every rank."""

    def __init__(self, device: str | None = None, **kwargs: Any):
        super().__init__(lambda: state.get().group("world"), device, **kwargs)
