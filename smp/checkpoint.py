"""``smp.save`` / ``smp.load``: checkpoints written atomically, one file per rank for partial states.

A partial object (``model.local_state_dict()``, ``optimizer.local_state_dict()``) is written by every
rank to ``PATH_<pp_rank>_<dp_rank>`` — a restart on the same layout reads back exactly what each rank
held. Every file is written to a temporary name in the same directory and renamed over the target,
so a crash mid-write never leaves a torn checkpoint.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from . import comm

__all__ = ["save", "load", "partial_path"]


def partial_path(path: str | os.PathLike) -> str:
    return f"{os.fspath(path)}_{comm.pp_rank()}_{comm.dp_rank()}"


def save(obj: Any, path: str | os.PathLike, partial: bool = True, **torch_save_kwargs: Any) -> None:
    target = partial_path(path) if partial else os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".smp-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh, **torch_save_kwargs)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str | os.PathLike, partial: bool = True, **torch_load_kwargs: Any) -> Any:
    target = partial_path(path) if partial else os.fspath(path)
    if not os.path.exists(target):
        hint = (" (partial checkpoints are one file per rank: was it saved with partial=True on the same "
                "pipeline_parallel_degree and data-parallel layout?)" if partial else "")
        raise FileNotFoundError(f"no checkpoint at {target}{hint}")
    torch_load_kwargs.setdefault("weights_only", False)
    return torch.load(target, **torch_load_kwargs)
