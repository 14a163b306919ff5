"""A reduction of ``schedulers.py`` beside SageMaker's public SMP v1 BERT script: the ``PolyWarmUpScheduler`` it
uses, a torch ``_LRScheduler`` over the ``smp.DistributedOptimizer``, which reads the step count apex's
``FusedLAMB`` keeps in ``param_groups[0]["step"]``."""
from __future__ import annotations

import warnings

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler as TorchLRScheduler

__all__ = ["PolyWarmUpScheduler"]


class LRScheduler(TorchLRScheduler):
    """Refuses anything but a torch ``Optimizer``, as the published base class does."""

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            super().__init__(optimizer, last_epoch)


class PolyWarmUpScheduler(LRScheduler):
    """Linear warm-up over ``warmup`` of ``total_steps``, then ``(1 - progress) ** degree``."""

    def __init__(self, optimizer: Optimizer, warmup: float, total_steps: int, degree: float = 0.5,
                 last_epoch: int = -1) -> None:
        self.warmup, self.total_steps, self.degree = warmup, total_steps, degree
        super().__init__(optimizer, last_epoch)

    def step(self, epoch: int | None = None) -> None:  # type: ignore[override]
        group = self.optimizer.param_groups[0]
        self.last_epoch = group["step"] + 1 if "step" in group else 1
        for g, lr in zip(self.optimizer.param_groups, self.get_lr()):
            g["lr"] = lr

    def get_lr(self) -> list[float]:  # type: ignore[override]
        progress = self.last_epoch / self.total_steps
        if progress < self.warmup:
            return [base * progress / self.warmup for base in self.base_lrs]
        return [base * (1.0 - progress) ** self.degree for base in self.base_lrs]
