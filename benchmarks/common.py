"""Helpers shared by the multi-process benchmarks."""
from __future__ import annotations

import os

__all__ = ["pin"]


def pin(rank: int, cfg: dict) -> None:
    """Every thread of this process (main, gloo's) onto core ``rank % cores`` when ``cfg["pin"]``: otherwise,
    on a busy host, Linux's affine wake-ups tend to stack two communicating ranks on one core."""
    if not cfg.get("pin") or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    core = {cores[rank % len(cores)]}
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), core)
        except OSError:
            pass
