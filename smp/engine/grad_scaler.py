"""Loss scaling that agrees across pipeline stages: torch's ``GradScaler`` with one overflow vote per step.

Each stage sees only its own gradients, so an overflow on one stage must skip the step on all of them:
after unscaling, the per-device ``found_inf`` flags are max-reduced over the world before the step
decides, and every rank then steps or skips and updates its scale identically. ``smp.amp.GradScaler``
(SMP v1's name) and the ``DistributedOptimizer``'s fp16 loss scaler (:mod:`smp.engine.mixed_precision`) are
this class, given the world group of ``smp.init``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["PipelineGradScaler"]


class PipelineGradScaler(torch.amp.GradScaler):
    """torch's loss scaler made pipeline-aware. The loss exists on the last stage's rank only, so every rank
    creates its scale itself and the ranks agree on overflow (one all-reduce of the found-inf flags over
    ``world_group()``, read at each vote so that a group closed after a failure is refused; torch's default group
    without it) before any of them steps or changes the scale."""

    def __init__(self, world_group: Callable[[], Any] | None = None, device: str | None = None, **kwargs: Any):
        super().__init__(device or ("cuda" if torch.cuda.is_available() else "cpu"), **kwargs)
        self.world_group = world_group

    def _ensure_scale(self) -> None:
        """Only the last stage's rank calls ``scale(loss)``, which creates the scale tensor lazily; the other
        ranks create theirs here, at the same initial value, so every rank can unscale and update."""
        if self._enabled and self._scale is None:
            device = torch.device(self._device)
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            self._lazy_init_scale_growth_tracker(device)

    def unscale_(self, optimizer: Any) -> None:
        """Unscale this rank's gradients and vote with every rank on whether any of them overflowed."""
        if not self._enabled:
            return
        self._ensure_scale()
        # The DistributedOptimizer itself (it shows the wrapped optimizer's param_groups), so that torch's
        # step() calls its step: sharded state and lr schedulers' step counting go through there.
        super().unscale_(optimizer)
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        total = torch.zeros(1, device=self._scale.device if self._scale is not None else "cpu")
        for flag in found.values():
            total += flag.to(total.device)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.world_group() if self.world_group else None)
        for device in list(found):
            found[device] = total.to(found[device].device)
        if not found:  # this rank holds no gradients: still vote, under the scale's device
            found[total.device] = total

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` unless some rank found inf/NaN gradients (then every rank skips it)."""
        self._ensure_scale()  # torch's step checks for a scale, which a rank without the loss has not made yet
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        """Grow or back off the scale, the same on every rank (they voted on the same overflow flag)."""
        self._ensure_scale()
        super().update(new_scale)
