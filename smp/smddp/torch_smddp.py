"""``smdistributed.dataparallel.torch.torch_smddp``: importing it makes ``backend="smddp"`` a valid backend of
torch.distributed, as the library's v1.4.0 and later do, so that ``import smdistributed.dataparallel.torch.torch_smddp``
then ``torch.distributed.init_process_group(backend="smddp")`` (SageMaker's examples, Hugging Face's ``Trainer``,
DeepSpeed's ``init_distributed(dist_backend="smddp")``) run on this engine.

The name stands for torch's own backend (:func:`smp.smddp.distributed.engine_backend`): NCCL on a CUDA machine, gloo
elsewhere; with NCCL, ``init_process_group`` first makes ``cuda:<local rank>`` the current device, one GPU per process
as the library ran (:func:`smp.smddp.distributed.pin_local_gpu`). ``torch.distributed.init_process_group`` and
``torch.distributed.new_group`` are wrapped, once per process, to pass that name on in place of ``"smddp"``;
everything else reaches torch unchanged, and torch builds the process group as it builds any other, so
``torch.distributed.get_backend()`` names the backend doing the work (``"nccl"`` or ``"gloo"``). A function bound
before the import (``from torch.distributed import init_process_group``) is torch's and does not know the name.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch.distributed as dist

from smp.smddp.distributed import SMDDP_BACKEND, engine_backend, pin_local_gpu

__all__ = ["register_smddp_backend", "SMDDP_BACKEND"]

_WRAPPED: dict[str, Callable[..., Any]] = {}  # torch.distributed's name -> our wrapper installed there
_BACKEND_POSITION = {"init_process_group": 0, "new_group": 2}  # where each takes ``backend`` positionally


def _is_smddp(backend: Any) -> bool:
    return isinstance(backend, str) and backend.lower() == SMDDP_BACKEND


def _translating(fn: Callable[..., Any], position: int, pin: bool) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        positional = len(args) > position
        if _is_smddp(args[position] if positional else kwargs.get("backend")):
            backend = engine_backend(SMDDP_BACKEND)
            if positional:
                args = (*args[:position], backend, *args[position + 1:])
            else:
                kwargs["backend"] = backend
            if pin and backend == "nccl":
                pin_local_gpu()
        return fn(*args, **kwargs)

    return call


def register_smddp_backend() -> None:
    """Make ``backend="smddp"`` valid in ``torch.distributed.init_process_group`` and ``new_group`` (see the module
    docstring). Importing this module calls it; calling it again changes nothing."""
    for name, position in _BACKEND_POSITION.items():
        current = getattr(dist, name)
        if _WRAPPED.get(name) is not current:
            _WRAPPED[name] = _translating(current, position, pin=name == "init_process_group")
            setattr(dist, name, _WRAPPED[name])


register_smddp_backend()
