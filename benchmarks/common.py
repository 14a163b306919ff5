"""Helpers shared by the multi-process benchmarks."""
from __future__ import annotations

import os

__all__ = ["load_average", "pin"]


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


def load_average() -> str:
    """The host's load, printed before and after a run: a busy machine explains noisy timings."""
    try:
        return "load average " + " ".join(f"{v:.2f}" for v in os.getloadavg()) + f" on {os.cpu_count()} cores"
    except OSError:
        return "load average unavailable"
