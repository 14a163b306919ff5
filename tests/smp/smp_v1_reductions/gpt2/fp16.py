"""A reduction of the ``fp16`` package beside SageMaker's public SMP v1 GPT-2 script of 2022-01 and 2022-05 (Megatron's
fp16 optimizer adapted to SMP: ``fp16/fp16.py``, ``fp16util.py``, ``loss_scaler.py``), in one module. Written anew:
what it keeps is what the package asks of SMP.

- ``FP16_Module``: the model in half precision under a wrapper whose submodule is named ``module`` (so the script
  reaches the model as ``model.module.module.module``); its ``state_dict`` is its module's, without the prefix.
- ``FP16_Optimizer(model, optimizer, ..., use_smp=True)``: fp32 master copies of the half parameters, made by
  ``init_master_params`` (which the script runs in a ``model.register_post_step_hook``, once the model is
  partitioned), each noted with ``model.is_distributed_parameter(param)`` and
  ``smdistributed.modelparallel.torch.utils.get_distribution_axis(param)``; the loss scaled and handed to
  ``model.backward``; overflow and gradient norm agreed with ``torch.distributed.all_reduce`` over
  ``smp.get_mp_process_group()`` (``smp.get_world_process_group()`` with ``shard_optimizer_state``); the norm counting
  a tensor-parallel duplicate on ``smp.tp_rank() == 0`` only. The script wraps it in ``smp.DistributedOptimizer``.
- ``register_optimizer_hooks(model)``: a ``model.register_post_partition_hook`` that gives the optimizer SMP's
  ``param_name_to_index`` and ``_param_index_to_param_local``.
- ``save_fp16_optimizer`` / ``load_fp16_optimizer``: ``optimizer.local_state_dict()``, the loss scaler, the fp32
  masters (gathered on ``smp.rdp_rank() == 0`` with ``smp.send``/``smp.recv_from(..., smp.RankType.RDP_RANK)``
  under ``shard_optimizer_state``), and a post-partition hook that loads them.

What differs: apex's fused kernels (``amp_C``, ``multi_tensor_applier``) are torch ops, and the CUDA tensor types
(``torch.cuda.HalfTensor`` checks, ``torch.cuda.IntTensor`` buffers) are dtypes on the parameters' device. The full
(non-partial) save and load, which merge tensor-parallel masters through SMP's internal
``state_mod.state.param_index_to_name_tp_group``, are not reduced: the notebooks save partial checkpoints.
"""
from __future__ import annotations

import copy
from functools import partial
from typing import Any

import smdistributed.modelparallel.torch as smp
import torch
from smdistributed.modelparallel.torch.state_mod import state as smp_state  # noqa: F401  (imported as published)
from smdistributed.modelparallel.torch.utils import get_distribution_axis
from torch import nn

__all__ = ["FP16_Module", "FP16_Optimizer", "save_fp16_optimizer", "load_fp16_optimizer", "register_optimizer_hooks"]


def _convert(val: Any, dtype: torch.dtype, source: torch.dtype) -> Any:
    if isinstance(val, (tuple, list)):
        return type(val)(_convert(v, dtype, source) for v in val)
    return val.to(dtype) if isinstance(val, torch.Tensor) and val.dtype == source else val


class FP16_Module(nn.Module):
    """The model in half precision; fp32 inputs in, fp32 outputs out."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.add_module("module", module.half())

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        out = self.module(*_convert(inputs, torch.half, torch.float), **kwargs)
        return {k: _convert(v, torch.float, torch.half) for k, v in out.items()} if isinstance(out, dict) else \
            _convert(out, torch.float, torch.half)

    def state_dict(self, destination=None, prefix="", keep_vars=False):  # type: ignore[override]
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict=True):  # type: ignore[override]
        return self.module.load_state_dict(state_dict, strict=strict)


def _group(shard_optimizer_state: bool) -> Any:
    return smp.get_world_process_group() if shard_optimizer_state else smp.get_mp_process_group()


class LossScaler:
    """A static loss scale."""

    def __init__(self, model: Any, shard_optimizer_state: bool, scale: float = 1, use_smp: bool = False) -> None:
        self.model, self.shard_optimizer_state, self.use_smp = model, shard_optimizer_state, use_smp
        self.cur_scale = scale

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def has_overflow(self, params: list[torch.Tensor]) -> bool:
        return False

    def update_scale(self, overflow: bool) -> None:
        pass

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        scaled = loss * self.loss_scale
        if self.use_smp:
            self.model.backward(scaled)
        else:
            scaled.backward()


class DynamicLossScaler(LossScaler):
    """Megatron's dynamic loss scale: down on an overflow (after ``delayed_shift`` of them), up every
    ``scale_window`` good steps; overflows agreed over the model-parallel group."""

    def __init__(self, model: Any, shard_optimizer_state: bool, init_scale: float = 2**32, scale_factor: float = 2.0,
                 scale_window: int = 1000, min_scale: float = 1, delayed_shift: int = 1,
                 consecutive_hysteresis: bool = False, use_smp: bool = False) -> None:
        super().__init__(model, shard_optimizer_state, init_scale, use_smp)
        self.cur_iter, self.last_overflow_iter = 0, -1
        self.scale_factor, self.scale_window, self.min_scale = scale_factor, scale_window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis

    def has_overflow(self, params: list[torch.Tensor]) -> bool:
        mine = any(p.grad is not None and not torch.isfinite(p.grad.float().sum()) for p in params)
        flag = torch.tensor([float(mine)])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=_group(self.shard_optimizer_state))
        return bool(flag.item())

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def clip_grad_norm_fp32(parameters: list[torch.Tensor], param_is_distributed: dict, shard_optimizer_state: bool,
                        max_norm: float, norm_type: float = 2) -> float:
    """Clip fp32 gradients to a global norm over the model-parallel group; a tensor-parallel duplicate counts once."""
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    for_norm = [p.grad.detach() for p in parameters if p.grad is not None and not getattr(p, "shared", False)
                and (smp.tp_rank() == 0 or param_is_distributed.get(p, False))]
    total = torch.zeros(())
    for g in for_norm:
        total = total + torch.norm(g, norm_type) ** norm_type
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=_group(shard_optimizer_state))
    norm = total.item() ** (1.0 / norm_type)
    coeff = max_norm / (norm + 1.0e-6)
    if grads and coeff < 1.0:
        for g in grads:
            g.mul_(coeff)
    return norm


def register_optimizer_hooks(model: Any) -> None:
    """After partitioning, the optimizer gets SMP's name -> index and index -> local parameter maps."""
    def param_name_to_index(self: Any) -> dict[str, int]:
        index = self._param_id_to_index()
        return {n: index[self.fp32paramid_from_fp16paramid.get(id(p), id(p))] for n, p in model.named_parameters()
                if self.fp32paramid_from_fp16paramid.get(id(p), id(p)) in index}

    def param_index_to_param_local(self: Any) -> dict[int, Any]:
        index = self._param_id_to_index()
        return {index[self.fp32paramid_from_fp16paramid.get(id(p), id(p))]: p for p in model.local_parameters()
                if self.fp32paramid_from_fp16paramid.get(id(p), id(p)) in index}

    def hook_fn(model: Any, optimizer: Any) -> None:
        optimizer.param_name_to_index = partial(param_name_to_index, optimizer)
        optimizer._param_index_to_param_local = partial(param_index_to_param_local, optimizer)

    model.register_post_partition_hook(hook_fn)


class FP16_Optimizer:
    """Megatron's fp16 optimizer over ``init_optimizer``: fp32 masters, loss scaling, master-gradient clipping."""

    def __init__(self, model: Any, init_optimizer: torch.optim.Optimizer, static_loss_scale: float | None = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict | None = None, use_smp: bool = False,
                 verbose: bool = False, params_have_main_grad: bool = False,
                 shard_optimizer_state: bool = False) -> None:
        self.model, self.optimizer, self.use_smp = model, init_optimizer, use_smp
        self.fp16_groups: list = []
        self.fp32_from_fp16_groups: list = []
        self.fp32_from_fp32_groups: list = []
        self.fp32_from_fp16_paramid_groups: list = []
        self.dynamic_loss_scale, self.shard_optimizer_state = dynamic_loss_scale, shard_optimizer_state
        self.master_params_created = False
        self.master_is_distributed: dict = {}
        self.master_distribution_axis: dict = {}
        if dynamic_loss_scale:
            self.loss_scaler: LossScaler = DynamicLossScaler(model, shard_optimizer_state, use_smp=use_smp,
                                                             **(dynamic_loss_args or {}))
        else:
            self.loss_scaler = LossScaler(model, shard_optimizer_state, static_loss_scale or 1.0, use_smp=use_smp)
        self.overflow, self.first_closure_call_this_step = False, True
        if not use_smp:
            self.init_master_params()

    def init_master_params(self) -> None:
        if self.use_smp:
            register_optimizer_hooks(self.model)
        self.fp32paramid_from_fp16paramid: dict[int, int] = {}
        for group in self.optimizer.param_groups:
            fp16, fp32_from_fp16, fp32 = [], [], []
            for i, param in enumerate(group["params"]):
                if not param.requires_grad:
                    continue
                if param.dtype == torch.half:
                    master = nn.Parameter(param.detach().float().clone())
                    self.master_is_distributed[master] = self.model.is_distributed_parameter(param)
                    self.master_distribution_axis[id(master)] = get_distribution_axis(param)
                    group["params"][i] = master
                    if param in self.optimizer.state:
                        self.optimizer.state[master] = self.optimizer.state.pop(param)
                    self.fp32paramid_from_fp16paramid[id(param)] = id(master)
                    fp16.append(param)
                    fp32_from_fp16.append(master)
                else:
                    fp32.append(param)
            self.fp16_groups.append(fp16)
            self.fp32_from_fp16_groups.append(fp32_from_fp16)
            self.fp32_from_fp16_paramid_groups.append([id(p) for p in fp32_from_fp16])
            self.fp32_from_fp32_groups.append(fp32)
        self.optimizer.load_state_dict(self.optimizer.state_dict())
        self.overflow, self.first_closure_call_this_step, self.master_params_created = False, True, True

    def zero_grad(self, set_grads_to_None: bool = False) -> None:
        for p in [p for g in self.optimizer.param_groups for p in g["params"]] + \
                [p for g in self.fp16_groups for p in g]:
            if set_grads_to_None and not (self.shard_optimizer_state and p.dtype == torch.half):
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_().zero_()

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        self.loss_scaler.backward(loss.float(), retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        if self.dynamic_loss_scale:
            params = [p for g in self.fp16_groups + self.fp32_from_fp32_groups for p in g]
            self.overflow = self.loss_scaler.has_overflow(params)
            if self.overflow:
                return
        for fp16, fp32 in zip(self.fp16_groups, self.fp32_from_fp16_groups):
            for model_p, master in zip(fp16, fp32):
                master.grad = None if model_p.grad is None else model_p.grad.float() / self.loss_scale

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> float:
        if self.overflow:
            return -1
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return clip_grad_norm_fp32(params, self.master_is_distributed, self.shard_optimizer_state, max_norm, norm_type)

    def step(self, closure: Any = None) -> Any:
        self.loss_scaler.update_scale(self.overflow)
        if self.overflow:
            return None
        out = self.optimizer.step()
        with torch.no_grad():
            for fp16, fp32 in zip(self.fp16_groups, self.fp32_from_fp16_groups):
                for model_p, master in zip(fp16, fp32):
                    model_p.copy_(master)
        return out

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)


def save_fp16_optimizer(args: Any, model: Any, optimizer: Any, partial: bool = True) -> dict:
    """The optimizer's part of a checkpoint: its local state, the loss scaler (without the model), the masters."""
    out: dict[str, Any] = {}
    scaler = optimizer.loss_scaler
    kept, scaler.model = scaler.model, None
    out["loss_scaler"] = copy.deepcopy(scaler)
    scaler.model = kept
    out["dynamic_loss_scale"] = optimizer.dynamic_loss_scale
    out["overflow"] = optimizer.overflow
    out["first_closure_call_this_step"] = optimizer.first_closure_call_this_step
    masters = [[p.detach().cpu() for p in group] for group in optimizer.fp32_from_fp16_groups]
    if optimizer.master_params_created:
        register_optimizer_hooks(model)
    if not partial:
        raise SystemExit("this reduction leaves out the full optimizer save (see the module docstring)")
    out["optimizer_state_dict"] = optimizer.local_state_dict()
    if args.shard_optimizer_state:
        if smp.rdp_rank() == 0:
            out["fp32_from_fp16"] = [masters] + [smp.recv_from(src, smp.RankType.RDP_RANK)
                                                 for src in range(1, smp.rdp_size())]
        else:
            smp.send(masters, 0, smp.RankType.RDP_RANK)
            out["fp32_from_fp16"] = masters
    else:
        out["fp32_from_fp16"] = masters
    return out


def load_fp16_optimizer(args: Any, model: Any, optimizer: Any, state_dict: dict, partial: bool = True) -> None:
    """After partitioning: the optimizer's local state, and the saved masters copied into the current ones."""
    saved = state_dict["optimizer"]
    if optimizer.master_params_created:
        register_optimizer_hooks(model)

    def hook_fn(model: Any, optimizer: Any) -> None:
        optimizer.load_state_dict(saved["optimizer_state_dict"])
        if not partial:
            raise SystemExit("this reduction leaves out the full optimizer load (see the module docstring)")
        masters = saved["fp32_from_fp16"][smp.rdp_rank()] if args.shard_optimizer_state else saved["fp32_from_fp16"]
        optimizer.fp32_from_fp16 = masters
        for current_group, saved_group in zip(optimizer.fp32_from_fp16_groups, masters):
            for current, value in zip(current_group, saved_group):
                current.data.copy_(value.data)

    model.register_post_partition_hook(hook_fn)
