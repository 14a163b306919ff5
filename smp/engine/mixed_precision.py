"""Mixed precision from the smp config: ``"fp16": True`` or ``"bf16": True``, as in SMP v1.

Mixed-precision training (Micikevicius et al. 2018, "Mixed Precision Training", arXiv:1710.03740) keeps
fp32 weights and runs the model's math in 16 bits; with float16, whose range is narrow, the loss is
multiplied by a scale before backward so that small gradients do not flush to zero, and the gradients are
divided by it before the update. SMP v1 scripts turn it on in the config and change nothing else: the
``DistributedOptimizer`` holds the loss scaler, ``model.backward(loss)`` scales, ``optimizer.step()``
unscales, skips the update when a gradient overflowed and adjusts the scale. Here:

* :func:`configured_autocast` -- every ``@smp.step`` runs under ``torch.autocast`` in the configured dtype on
  the rank's device (``smp.step`` takes it where it would take the caller's autocast, so the stages, the
  partitioning trace and the loss code all run under it). Weights are fp32: :func:`fp32_weights` turns the 16-bit
  ones of a model built in 16 bits (``smp.model_creation(dtype=torch.float16)``, as SMP's GPT-2 recipe does) into
  fp32 when ``smp.DistributedModel`` wraps it, where SMP kept fp32 master copies of them in its optimizer.
* :class:`LossScaler` -- a :class:`~smp.engine.grad_scaler.PipelineGradScaler` (overflow agreed by every rank)
  that follows SMP's
  (Megatron-LM's) loss scaler: a static scale, or a dynamic one with ``init_scale``, ``scale_factor``,
  ``scale_window``, ``min_scale`` and the hysteresis ``delayed_shift`` / ``consecutive_hysteresis``.
  :func:`loss_scaler` builds it from the ``DistributedOptimizer`` arguments when fp16 is on;
  :func:`scaled_for_backward` is what ``DistributedModel.backward`` applies to the loss.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch.amp.grad_scaler import OptState

from smp.engine.grad_scaler import PipelineGradScaler
from smp.runtime.compat import warn_no_effect
from smp.runtime.config import Config

__all__ = ["autocast_dtype", "active_autocast", "configured_autocast", "LossScaler", "loss_scaler",
           "scaled_for_backward", "fp32_weights"]

# SMP's defaults for dynamic_loss_args.
_DYNAMIC_DEFAULTS = {"init_scale": 2.0 ** 32, "scale_factor": 2.0, "scale_window": 1000, "min_scale": 1.0,
                     "delayed_shift": 1, "consecutive_hysteresis": False}


def autocast_dtype(config: Config) -> torch.dtype | None:
    """The dtype a config's steps compute in (None: the model's own)."""
    return torch.float16 if config.fp16 else torch.bfloat16 if config.bf16 else None


def active_autocast() -> tuple[str, torch.dtype] | None:
    """The ``torch.autocast`` (device type, dtype) this thread runs under; None outside autocast."""
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            return device, torch.get_autocast_dtype(device)
    return None


def configured_autocast(config: Config, device: torch.device) -> tuple[str, torch.dtype] | None:
    """The ``torch.autocast`` (device type, dtype) a step on ``device`` runs under by the config; None without
    fp16/bf16. ``smp.step`` uses it when its caller set no autocast of its own (a script's own autocast wins)."""
    dtype = autocast_dtype(config)
    return None if dtype is None else (device.type, dtype)


class LossScaler(PipelineGradScaler):
    """SMP's fp16 loss scaler on top of :class:`~smp.engine.grad_scaler.PipelineGradScaler`.

    Dynamic: after a step whose gradients overflowed, the scale is divided by ``scale_factor`` (not below
    ``min_scale``) -- with ``delayed_shift`` > 1, only once that many overflows came without the hysteresis
    being reset; after ``scale_window`` steps without overflow since the last one, it is multiplied by
    ``scale_factor``. ``consecutive_hysteresis`` resets the hysteresis after every good step instead of at
    each growth. Static: the scale never changes (overflowing steps are still skipped)."""

    def __init__(self, static_loss_scale: float = 1.0, dynamic: bool = False,
                 world_group: Callable[[], Any] | None = None, **dynamic_loss_args: Any):
        unknown = set(dynamic_loss_args) - set(_DYNAMIC_DEFAULTS)
        if unknown:
            raise TypeError(f"unknown dynamic_loss_args {sorted(unknown)}; valid: {sorted(_DYNAMIC_DEFAULTS)}")
        args = {**_DYNAMIC_DEFAULTS, **dynamic_loss_args}
        if dynamic:
            if not args["scale_factor"] > 1:
                raise ValueError(f"dynamic_loss_args scale_factor={args['scale_factor']} must be > 1")
            if not (isinstance(args["scale_window"], int) and args["scale_window"] >= 1):
                raise ValueError(f"dynamic_loss_args scale_window={args['scale_window']!r} must be an integer >= 1")
            if not (isinstance(args["delayed_shift"], int) and args["delayed_shift"] >= 1):
                raise ValueError(f"dynamic_loss_args delayed_shift={args['delayed_shift']!r} must be an integer >= 1")
            init = float(args["init_scale"])
        else:
            init = float(static_loss_scale)
        if not (math.isfinite(init) and init > 0):
            raise ValueError(f"the loss scale must be a positive number, got {init}")
        super().__init__(world_group, init_scale=init)
        self.dynamic = dynamic
        self.scale_factor = float(args["scale_factor"])
        self.scale_window = args["scale_window"]
        self.min_scale = float(args["min_scale"])
        self.delayed_shift = args["delayed_shift"]
        self.consecutive_hysteresis = bool(args["consecutive_hysteresis"])
        self.cur_iter, self.last_overflow_iter, self.cur_hysteresis = 0, -1, self.delayed_shift
        self._ensure_scale()  # now, not lazily in the first scale(): microbatch threads call scale() concurrently

    def _next_scale(self, scale: float, overflow: bool) -> float:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                scale = max(scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                scale *= self.scale_factor
        self.cur_iter += 1
        return scale

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """After each step: the next scale by the schedule above (or ``new_scale`` when given)."""
        if new_scale is None:
            found = [f for s in self._per_optimizer_states.values() for f in s["found_inf_per_device"].values()]
            if not found:
                raise RuntimeError("LossScaler.update() before any step: call optimizer.step() first")
            scale = self.get_scale()
            new_scale = self._next_scale(scale, any(bool(f.item()) for f in found)) if self.dynamic else scale
        super().update(float(new_scale) if not isinstance(new_scale, torch.Tensor) else new_scale)

    def unscale_once(self, optimizer: Any) -> dict[str, Any]:
        """Unscale ``optimizer``'s gradients unless that was done since the last update; its scaler state."""
        opt_state = self._per_optimizer_states[id(optimizer)]
        if opt_state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        return opt_state

    def scaled_step(self, optimizer: Any, step: Callable[[Any], Any], closure: Any = None) -> Any:
        """``optimizer.step()`` under loss scaling: unscale its gradients (unless ``clip_master_grads`` did),
        run ``step(closure)`` unless some rank's gradients overflowed, update the scale. Sets
        ``optimizer.overflow`` as SMP's fp16 optimizer does."""
        opt_state = self.unscale_once(optimizer)
        overflow = any(bool(f.item()) for f in opt_state["found_inf_per_device"].values())
        result = None if overflow else step(closure)
        self.update()
        optimizer.overflow = overflow
        return result

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's state and the schedule's counters, for checkpoints."""
        return {**super().state_dict(), "dynamic": self.dynamic, "cur_iter": self.cur_iter,
                "last_overflow_iter": self.last_overflow_iter, "cur_hysteresis": self.cur_hysteresis}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        sd = dict(state_dict)
        self.cur_iter = sd.pop("cur_iter", self.cur_iter)
        self.last_overflow_iter = sd.pop("last_overflow_iter", self.last_overflow_iter)
        self.cur_hysteresis = sd.pop("cur_hysteresis", self.cur_hysteresis)
        sd.pop("dynamic", None)
        super().load_state_dict(sd)


def loss_scaler(config: Config, static_loss_scale: float | None = 1.0, dynamic_loss_scale: bool = False,
                dynamic_loss_args: dict[str, Any] | None = None,
                world_group: Callable[[], Any] | None = None) -> LossScaler | None:
    """The ``DistributedOptimizer``'s loss scaler: with ``fp16`` on, a :class:`LossScaler` (dynamic when
    ``dynamic_loss_scale``, else static at ``static_loss_scale``; its overflow vote on ``world_group()``);
    otherwise None, with a warning when
    scaling arguments were given, since SMP applies them to fp16 training only."""
    args = dict(dynamic_loss_args or {})
    if not config.fp16:
        if dynamic_loss_scale or args or static_loss_scale not in (None, 1.0):
            warn_no_effect("DistributedOptimizer's loss scaling arguments",
                           "loss scaling applies to fp16 training; set 'fp16': True in the smp config", stacklevel=3)
        return None
    if not dynamic_loss_scale and static_loss_scale is None:
        raise ValueError("DistributedOptimizer(static_loss_scale=None) needs dynamic_loss_scale=True")
    return LossScaler(1.0 if static_loss_scale is None else static_loss_scale, dynamic_loss_scale, world_group, **args)


def scaled_for_backward(scaler: Any, tensors: Any, grad_tensors: Any) -> tuple[Any, Any]:
    """``model.backward``'s arguments with the loss scale of ``scaler`` applied: to the loss (or tensors), or to
    the given output gradients; unchanged without a scaler of smp's (a script's own fp16 optimizer, such as the
    ``FP16_Optimizer`` of SageMaker's 2022 GPT-2 script, scales the loss before ``model.backward`` itself)."""
    if not isinstance(scaler, LossScaler):
        return tensors, grad_tensors
    if grad_tensors is None:
        return scaler.scale(tensors), None
    return tensors, scaler.scale(grad_tensors)


def fp32_weights(module: torch.nn.Module, config: Config) -> torch.nn.Module:
    """``module``, its float16 and bfloat16 parameters and buffers made fp32 in place (the same objects, so an
    optimizer already built over them keeps them) when the config trains in 16 bits; unchanged otherwise."""
    if autocast_dtype(config) is None:
        return module
    half = (torch.float16, torch.bfloat16)
    for p in module.parameters():
        if p.dtype in half:
            p.data = p.data.float()
    for m in module.modules():
        for name, b in list(m.named_buffers(recurse=False)):
            if b is not None and b.dtype in half:
                setattr(m, name, b.float())
    return module
