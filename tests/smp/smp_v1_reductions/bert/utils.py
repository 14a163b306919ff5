"""A reduction of ``utils.py`` beside SageMaker's public SMP v1 BERT script: the rank helpers it imports, which ask
smp once it is initialised and torch.distributed otherwise."""
from __future__ import annotations

import smdistributed.modelparallel.torch as smp
import torch.distributed as dist

__all__ = ["get_rank", "get_world_size", "is_main_process"]


def get_rank() -> int:
    """smp's global rank (torch.distributed's before ``smp.init``; 0 without either)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return smp.rank() if smp.is_initialized() else dist.get_rank()


def get_world_size() -> int:
    """smp's world size (torch.distributed's before ``smp.init``; 1 without either)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return smp.size() if smp.is_initialized() else dist.get_world_size()


def is_main_process() -> bool:
    """Global rank 0."""
    return get_rank() == 0
