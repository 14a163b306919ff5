"""A reduction of ``learning_rates.py`` beside SageMaker's public SMP v1 GPT-2 scripts: Megatron's ``AnnealingLR``
over the ``smp.DistributedOptimizer`` (it sets ``lr`` in ``optimizer.param_groups`` and prints on ``smp.rank() ==
0``), with the ``state_dict`` the scripts checkpoint."""
from __future__ import annotations

import math
from typing import Any

import smdistributed.modelparallel.torch as smp

__all__ = ["AnnealingLR"]


class AnnealingLR:
    """Linear warm-up over ``warmup_iter``, then the decay style (linear, plateau, cosine, exponential)."""

    def __init__(self, optimizer: Any, start_lr: float, warmup_iter: float, plateau_iter: float, total_iters: int,
                 decay_style: str, last_iter: int, min_lr: float = 0.0, use_checkpoint_lr_scheduler: bool = True,
                 override_lr_scheduler: bool = False) -> None:
        self.optimizer, self.start_lr, self.min_lr = optimizer, start_lr, min_lr
        self.warmup_iter, self.plateau_iter, self.end_iter = warmup_iter, plateau_iter, total_iters
        self.num_iters, self.decay_style = last_iter, decay_style
        self.step(self.num_iters)
        if smp.rank() == 0:
            print(f"Learning rate decay style: {self.decay_style}")

    def get_lr(self) -> float:
        n = min(self.num_iters, self.end_iter - self.warmup_iter)
        if self.warmup_iter > 0 and self.num_iters <= self.warmup_iter:
            return float(self.start_lr) * n / self.warmup_iter
        n -= self.warmup_iter
        if self.decay_style == "linear":
            lr = self.start_lr * (self.end_iter - n) / self.end_iter
        elif self.decay_style == "plateau":
            lr = self.start_lr if self.num_iters <= self.plateau_iter else \
                self.start_lr * (self.end_iter - self.num_iters) / (self.end_iter - self.plateau_iter)
        elif self.decay_style == "cosine":
            lr = self.start_lr / 2.0 * (math.cos(math.pi * n / self.end_iter) + 1)
        elif self.decay_style == "exponential":
            lr = self.start_lr * math.exp(-0.693 * n / self.end_iter)
        else:
            lr = self.start_lr
        return max(lr, self.min_lr)

    def step(self, step_num: int | None = None) -> None:
        self.num_iters = self.num_iters + 1 if step_num is None else step_num
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr()

    def state_dict(self) -> dict[str, Any]:
        return {"start_lr": self.start_lr, "warmup_iter": self.warmup_iter, "num_iters": self.num_iters,
                "decay_style": self.decay_style, "end_iter": self.end_iter, "min_lr": self.min_lr}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for key in ("start_lr", "min_lr", "warmup_iter", "end_iter", "decay_style"):
            setattr(self, key, sd[key])
        self.num_iters = sd["num_iters"]
        self.step(self.num_iters)
