"""A reduction of ``memory_tracker.py`` beside SageMaker's public SMP v1 GPT-2 scripts (from 2022-05): memory
reports tagged with ``smp.rank()``, ``smp.tp_rank()``, ``smp.pp_rank()`` and written on ``smp.rdp_rank() == 0``. The
scripts call them only with ``--enable_memory_profiling 1``; the GPU figures are torch.cuda's (zeros without CUDA)."""
from __future__ import annotations

import os

import psutil
import smdistributed.modelparallel.torch as smp
import torch

__all__ = ["memory_status", "memory_status_cpu"]

_process = psutil.Process(os.getpid())


def memory_status(msg: str = "", reset_max: bool = True, sync: bool = True) -> None:
    """Allocated and reserved accelerator memory of this rank."""
    cuda = torch.cuda.is_available()
    if sync and cuda:
        torch.cuda.synchronize()
    if smp.rdp_rank() != 0:
        return
    alloced = torch.cuda.memory_allocated(smp.local_rank()) / 1024**3 if cuda else 0.0
    print(f"[{msg}] rank {smp.rank()} tp_rank {smp.tp_rank()} pp_rank {smp.pp_rank()} alloc {alloced:0.4f}")


def memory_status_cpu(msg: str = "") -> None:
    """This process's memory."""
    if smp.rdp_rank() != 0:
        return
    used = _process.memory_info().rss / 1024**3
    print(f"[{msg}] rank {smp.rank()} tp_rank {smp.tp_rank()} pp_rank {smp.pp_rank()} cpu mem usage {used:0.4f}")
