"""``smdistributed.dataparallel.torch.parallel.distributed.DistributedDataParallel``: torch's
``DistributedDataParallel`` (gradients averaged over the ranks in buckets during the backward pass, by torch's Reducer)
with the library's signature. Each replica is on its process's own GPU because
:func:`~smp.smddp.distributed.init_process_group` made that GPU the current device; a CPU module uses gloo.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from smp.smddp.distributed import SmddpError

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """The library's ``DistributedDataParallel(module, device_ids=None, output_device=None, broadcast_buffers=True,
    process_group=None, bucket_cap_mb=None)``: torch's. Further keyword arguments are torch's
    (``find_unused_parameters``, ``gradient_as_bucket_view``, ...), and so is ``no_sync()``.
    ``gradient_accumulation_steps`` (the library's before v1.4.0) is refused: accumulate under ``no_sync()``."""

    def __init__(self, module: torch.nn.Module, device_ids: Sequence[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, broadcast_buffers: bool | None = None,
                 process_group: Any = None, bucket_cap_mb: float | None = None, **kwargs: Any) -> None:
        if "gradient_accumulation_steps" in kwargs:
            raise SmddpError("DistributedDataParallel(gradient_accumulation_steps=...) is not supported (the library "
                             "dropped it in v1.4.0): run the accumulating steps' backward passes under "
                             "`with model.no_sync():`")
        given = {"broadcast_buffers": broadcast_buffers, "bucket_cap_mb": bucket_cap_mb}  # None: torch's defaults
        kwargs.update({k: v for k, v in given.items() if v is not None})
        super().__init__(module, device_ids=device_ids, output_device=output_device, process_group=process_group,
                         **kwargs)
