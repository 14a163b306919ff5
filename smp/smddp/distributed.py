"""``smdistributed.dataparallel.torch.distributed``: the process group, rank helpers and collectives of SageMaker's
data-parallel library (v1; deprecated by its v1.4.0 in favour of torch.distributed with ``backend="smddp"``), each one
torch.distributed's own call.

- :func:`init_process_group` joins the job ``smp launch`` or torchrun started (their ``RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR`` ...), with NCCL on a CUDA machine and gloo elsewhere; run without a launcher it makes a world of one
  process, as ``smp.init`` does; where a process group exists already (``smp.init``, or a second call) it joins it.
- On a CUDA machine each process gets its own GPU, as the library gave it: ``cuda:<local rank>`` becomes the current
  device (:func:`pin_local_gpu`), so that the library's scripts, which build their model on ``torch.device("cuda")``
  and wrap it before they call ``torch.cuda.set_device(local_rank)``, put every replica on its own GPU.
- ``group`` is torch's (``group.WORLD`` is the default group); a ``group`` argument may be any torch process group
  (the library took ``group.WORLD`` only).
- :class:`ReduceOp` has the library's four reductions; ``AVERAGE`` is a sum divided by the group's size (gloo has no
  average).
"""
from __future__ import annotations

import enum
import os
from typing import Any

import torch
import torch.distributed as dist

from smp.runtime.rank_env import free_port

__all__ = ["init_process_group", "is_available", "is_initialized", "get_rank", "get_world_size", "get_local_rank",
           "get_local_size", "barrier", "all_reduce", "broadcast", "all_gather", "all_to_all_single", "ReduceOp",
           "group", "engine_backend", "pin_local_gpu", "SMDDP_BACKEND", "SmddpError"]

SMDDP_BACKEND = "smddp"  # the backend name that smdistributed.dataparallel.torch.torch_smddp registers
group = dist.group  # group.WORLD: the default process group, as in the library


class SmddpError(RuntimeError):
    """A call of SageMaker's data-parallel API that this engine does not support, or made before
    :func:`init_process_group`."""


class ReduceOp(enum.Enum):
    """The library's reductions for :func:`all_reduce`: ``SUM``, ``AVERAGE``, ``MIN`` and ``MAX``."""

    SUM = "sum"
    AVERAGE = "average"
    MIN = "min"
    MAX = "max"


_TORCH_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.MAX: dist.ReduceOp.MAX}


def engine_backend(backend: str | None = None) -> str | None:
    """The torch.distributed backend a backend name of the library stands for: ``"smddp"`` (any case) and None are
    NCCL on a CUDA machine and gloo elsewhere; any other name is torch's and is returned as it is."""
    if backend is None or (isinstance(backend, str) and backend.lower() == SMDDP_BACKEND):
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def pin_local_gpu() -> None:
    """On a CUDA machine, make ``cuda:<LOCAL_RANK>`` this process's current device: one GPU per process, as the
    library ran. An error when the machine has fewer GPUs than processes; nothing without CUDA."""
    if not torch.cuda.is_available():
        return
    local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local >= count:
        raise SmddpError(f"smdistributed.dataparallel runs one process per GPU, and local rank {local} has none of "
                         f"its own (this machine has {count}): start at most {count} processes per machine")
    torch.cuda.set_device(local)


def init_process_group(backend: str | None = None, **kwargs: Any) -> None:
    """Initialise the default process group (see the module docstring); ``backend`` and ``kwargs`` go to
    ``torch.distributed.init_process_group`` (``"smddp"`` or None: :func:`engine_backend`). Returns None."""
    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ and "init_method" not in kwargs and "store" not in kwargs:
        kwargs.update(init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)  # not launched: one rank
    chosen = engine_backend(backend)
    if chosen == "nccl":
        pin_local_gpu()
    dist.init_process_group(chosen, **kwargs)


def is_available() -> bool:
    """Whether this process is part of a distributed job: a process group exists, or a launcher (``smp launch``,
    torchrun) started it. A script may skip the library when it is False, as the library's documentation says."""
    return dist.is_available() and (dist.is_initialized() or "WORLD_SIZE" in os.environ)


def is_initialized() -> bool:
    """Whether :func:`init_process_group` (or anything else) has made the default process group."""
    return dist.is_initialized()


def _initialized(call: str) -> None:
    if not dist.is_initialized():
        raise SmddpError(f"smdistributed.dataparallel is not initialised: call init_process_group() before {call}()")


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (the whole job by default)."""
    _initialized("get_rank")
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    """The number of processes in ``group`` (the whole job by default)."""
    _initialized("get_world_size")
    return dist.get_world_size(group)


def _local(call: str, variable: str) -> int:
    _initialized(call)
    value = os.environ.get(variable)
    if value is not None:
        return int(value)
    if dist.get_world_size() == 1:
        return 0 if variable == "LOCAL_RANK" else 1
    raise SmddpError(f"{call}() reads {variable}, which is not set: start the job with `smp launch -n N "
                     "--as-smdistributed script.py` or torchrun, which set it for each process")


def get_local_rank() -> int:
    """This process's rank among the processes of its machine (``LOCAL_RANK``; 0 in a world of one)."""
    return _local("get_local_rank", "LOCAL_RANK")


def get_local_size() -> int:
    """The number of processes on this machine (``LOCAL_WORLD_SIZE``; 1 in a world of one)."""
    return _local("get_local_size", "LOCAL_WORLD_SIZE")


def barrier(group: Any = None, async_op: bool = False) -> Any:
    """Wait until every process of ``group`` has called it; a work handle when ``async_op``."""
    _initialized("barrier")
    return dist.barrier(group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, op: ReduceOp | Any = ReduceOp.SUM, group: Any = None,
               async_op: bool = False) -> Any:
    """Reduce ``tensor`` in place over ``group`` with ``op`` (a :class:`ReduceOp`, or one of torch's; None is
    ``SUM``); a work handle when ``async_op``. ``AVERAGE`` needs a floating-point tensor and ``async_op=False``."""
    _initialized("all_reduce")
    op = ReduceOp.SUM if op is None else op
    if op is not ReduceOp.AVERAGE:
        torch_op = _TORCH_OPS[op] if isinstance(op, ReduceOp) else op
        return dist.all_reduce(tensor, torch_op, group=group, async_op=async_op)
    if async_op or not (tensor.is_floating_point() or tensor.is_complex()):
        what = "async_op=True" if async_op else f"a {tensor.dtype} tensor"
        raise SmddpError(f"all_reduce(op=ReduceOp.AVERAGE) with {what} is not supported here: the average is a sum "
                         "divided by the group's size once the sum is done; reduce with ReduceOp.SUM and divide")
    dist.all_reduce(tensor, dist.ReduceOp.SUM, group=group)
    tensor.div_(dist.get_world_size(group))
    return None


def broadcast(tensor: torch.Tensor, src: int = 0, group: Any = None, async_op: bool = False) -> Any:
    """Copy rank ``src``'s ``tensor`` into every other rank's ``tensor``; a work handle when ``async_op``."""
    _initialized("broadcast")
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False) -> Any:
    """Fill ``tensor_list`` (one tensor per rank, sized as ``tensor``) with every rank's ``tensor``."""
    _initialized("all_gather")
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_to_all_single(output_t: torch.Tensor, input_t: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: Any = None, async_op: bool = False) -> Any:
    """Scatter ``input_t`` (split along its first dimension) to every rank and gather what each sends into
    ``output_t``."""
    _initialized("all_to_all_single")
    return dist.all_to_all_single(output_t, input_t, output_split_sizes, input_split_sizes, group=group,
                                  async_op=async_op)
