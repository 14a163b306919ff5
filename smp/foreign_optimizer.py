"""``smp.DistributedOptimizer`` of an optimizer object that is not a ``torch.optim.Optimizer``.

SMP v1 took "an optimizer object" and returned it "with the following methods overridden: ``state_dict``,
``load_state_dict``, ``local_state_dict``" (its documentation). SageMaker's 2022 GPT-2 script relies on that: it wraps
its own ``FP16_Optimizer`` (Megatron's: fp32 master weights, a loss scaler, ``backward(loss)``,
``update_master_grads()``, ``clip_master_grads()``, ``zero_grad(set_grads_to_None=...)``, ``overflow``), calls those
on what ``smp.DistributedOptimizer`` returned, and sets its attributes (``optimizer.loss_scaler = ...``) when it
resumes. So :func:`foreign_optimizer` returns that object itself under a subclass of its class that shares its state
(every attribute and method is the object's own), with SMP's three methods:

- ``local_state_dict()``: the object's own ``state_dict()``: each rank's optimizer holds state only for the parameters
  it steps (its stages', its tensor-parallel shards), keyed by their place in the param groups, the same on every rank;
- ``state_dict()``: the local state dicts of the model-parallel group gathered and merged (a collective);
- ``load_state_dict(sd)``: the object's own.

Refused, with an error that says why: the smp config's ``fp16``/``bf16`` (smp's loss scaling needs a torch
optimizer; a wrapper that scales the loss itself goes with ``fp16_params``, as the script's notebooks set), sharded
optimizer state over more than one replica, and a full ``state_dict()`` under tensor parallelism (each tp rank holds
other shards under the same keys: save each rank's ``local_state_dict()``).
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from smp.checkpoint.state_dicts import on_cpu
from smp.runtime import state

__all__ = ["foreign_optimizer", "ForeignOptimizerError"]


class ForeignOptimizerError(ValueError):
    """An optimizer object that is not a torch optimizer cannot be wrapped this way; the message says why."""


def _base(view: Any) -> Any:
    """The wrapped object's own class."""
    return type(view).__mro__[1]


def _local_state_dict(self: Any, gather_if_shard: bool = True) -> dict[str, Any]:
    """This rank's optimizer state: the wrapped object's own ``state_dict()``."""
    return _base(self).state_dict(self)


def _state_dict(self: Any) -> dict[str, Any]:
    """Every model-parallel rank's state, merged (a collective over the model-parallel group)."""
    st = state.get()
    if st.topology.tp > 1:
        raise ForeignOptimizerError("state_dict() of a wrapped optimizer object under tensor parallelism: each tp rank "
                                    "holds other shards under the same keys; save each rank's local_state_dict()")
    local = _local_state_dict(self)
    parts: list[Any] = [None] * st.topology.mp
    dist.all_gather_object(parts, on_cpu(local["state"]), group=st.enter("model-parallel", "optimizer.state_dict()"))
    return {"state": {k: v for part in parts for k, v in part.items()}, "param_groups": local["param_groups"]}


def _load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
    """The wrapped object's own ``load_state_dict``."""
    _base(self).load_state_dict(self, state_dict)


def foreign_optimizer(optimizer: Any, static_loss_scale: float | None = 1.0, dynamic_loss_scale: bool = False,
                      dynamic_loss_args: dict[str, Any] | None = None, **more: Any) -> Any:
    """``optimizer`` with SMP's ``local_state_dict``, ``state_dict`` and ``load_state_dict`` (see the module
    docstring); it becomes the process's DistributedOptimizer."""
    kind = type(optimizer).__name__
    if not (callable(getattr(optimizer, "step", None)) and hasattr(optimizer, "param_groups")):
        raise TypeError(f"DistributedOptimizer wraps an optimizer: a torch.optim.Optimizer, or an object with step() "
                        f"and param_groups (SMP's fp16 optimizer wrappers); got {kind}")
    st = state.get()
    if st.config.fp16 or st.config.bf16:
        raise ForeignOptimizerError(f"smp.DistributedOptimizer({kind}): with 'fp16' or 'bf16' in the smp config, smp "
                                    "scales the loss itself and needs the torch optimizer; pass that, or keep your "
                                    f"{kind}, which scales the loss itself, and set 'fp16_params' instead")
    if st.config.shard_optimizer_state and st.topology.rdp > 1:
        raise ForeignOptimizerError(f"smp.DistributedOptimizer({kind}) with shard_optimizer_state over "
                                    f"{st.topology.rdp} replicas: the state is sharded for torch optimizers only; pass "
                                    "the torch optimizer, or set shard_optimizer_state False")
    namespace = {"local_state_dict": _local_state_dict, "state_dict": _state_dict, "load_state_dict": _load_state_dict,
                 "__module__": type(optimizer).__module__, "__doc__": type(optimizer).__doc__}
    view: Any = object.__new__(type(kind, (type(optimizer),), namespace))
    object.__setattr__(view, "__dict__", optimizer.__dict__)
    st.optimizer = view
    return view
