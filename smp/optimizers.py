"""``smp.optimizers.FusedLAMB``: the LAMB optimizer with apex's (and SMP's) constructor and semantics.

LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
arXiv:1904.00962, Algorithm 2) is Adam with a per-layer trust ratio. For each parameter tensor ``x`` with
gradient ``g`` at step ``t``::

    g  <- g / max(1, ||G|| / max_grad_norm)       G: every gradient of the model (apex's global clipping)
    g  <- g + wd * x                                only with adam_w_mode=False (L2 regularisation)
    m  <- beta1 * m + beta3 * g                     beta3 = 1 - beta1 (grad_averaging) or 1
    v  <- beta2 * v + (1 - beta2) * g^2
    r  <- (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)      (no bias correction: t terms are 1)
    r  <- r + wd * x                                only with adam_w_mode=True (decoupled weight decay)
    x  <- x - lr * phi * r,   phi = ||x|| / ||r||   when wd != 0 or use_nvlamb, and both norms are > 0; else 1

apex's ``FusedLAMB`` runs this as two fused CUDA kernels; here it is the same arithmetic in torch ops, on
any device. As apex does, each step also counts itself in every parameter group (``param_groups[i]["step"]``), which
lr schedulers written for apex read (the ``PolyWarmUpScheduler`` of NVIDIA's and SageMaker's BERT scripts). Under
SMP each rank holds only some of the model's gradients, so ``||G||`` is the norm over the whole model
(:func:`smp.engine.gradnorm.global_grad_norm`), which makes a pipelined run step exactly as one device would.
``FusedLamb`` (the name SMP's documentation uses) is the same class.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from smp.engine.gradnorm import global_grad_norm
from smp.runtime import state

__all__ = ["FusedLAMB", "FusedLamb"]


class FusedLAMB(torch.optim.Optimizer):
    """LAMB; the arguments are apex's ``FusedLAMB`` ones (``amsgrad`` is refused, as apex does)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
                 set_grad_none: bool = True, max_grad_norm: float = 1.0, use_nvlamb: bool = False):
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant (amsgrad=True)")
        if not lr >= 0:
            raise ValueError(f"FusedLAMB lr={lr} must be >= 0")
        if not eps >= 0:
            raise ValueError(f"FusedLAMB eps={eps} must be >= 0")
        if not all(0 <= b < 1 for b in betas) or len(betas) != 2:
            raise ValueError(f"FusedLAMB betas={betas} must be two numbers in [0, 1)")
        if not weight_decay >= 0:
            raise ValueError(f"FusedLAMB weight_decay={weight_decay} must be >= 0")
        # Every argument is in ``defaults``: ZeRO (shard_optimizer_state) rebuilds the optimizer from them.
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, adam_w_mode=adam_w_mode, grad_averaging=grad_averaging,
                        set_grad_none=set_grad_none, max_grad_norm=max_grad_norm, use_nvlamb=use_nvlamb)
        super().__init__(params, defaults)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """As apex: gradients are set to None when ``set_grad_none`` (the default), else zeroed."""
        super().zero_grad(set_to_none=self.defaults["set_grad_none"] if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One LAMB update of every parameter with a gradient (collective under smp: every rank steps)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"]]
        max_norm = self.defaults["max_grad_norm"]
        clip: torch.Tensor | float = 1.0
        if max_norm is not None and max_norm > 0:  # collective: every rank steps together
            norm = global_grad_norm(params, st=state.get() if state.is_initialized() else None)
            clip = torch.clamp(norm / max_norm, min=1.0)
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1  # apex counts steps per group: schedulers read it
            beta1, beta2 = group["betas"]
            beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
            wd, eps, lr = group["weight_decay"], group["eps"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedLAMB does not support sparse gradients")
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] += 1
                t = st["step"]
                g = p.grad / (clip.to(p.device, p.dtype) if isinstance(clip, torch.Tensor) else clip)
                if not group["adam_w_mode"] and wd != 0:
                    g = g + wd * p
                m, v = st["exp_avg"], st["exp_avg_sq"]
                m.mul_(beta1).add_(g, alpha=beta3)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                c1, c2 = (1 - beta1 ** t, 1 - beta2 ** t) if group["bias_correction"] else (1.0, 1.0)
                update = (m / c1) / ((v / c2).sqrt() + eps)
                if group["adam_w_mode"] and wd != 0:
                    update = update + wd * p
                if group["use_nvlamb"] or wd != 0:
                    p_norm, u_norm = p.norm(), update.norm()
                    ratio = torch.where((p_norm > 0) & (u_norm > 0), p_norm / u_norm, torch.ones_like(p_norm))
                    p.sub_(update * (lr * ratio))
                else:
                    p.sub_(update, alpha=lr)
        return loss


FusedLamb = FusedLAMB
