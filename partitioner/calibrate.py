"""Measuring this machine's device rates (:class:`partitioner.devices.DeviceRates`) for the cost model.

Four microbenchmarks: a 512x512 matmul (FLOP/s), a streaming add over buffers larger than the last-level
cache (memory bandwidth), an 8-element add (per-op dispatch overhead), and a write to freshly mapped memory
(what a step's new weight gradients cost). Each takes the fastest of several runs on the thread's CPU time
(see :func:`cost_clock`), because other load only ever slows a run down.
"""
from __future__ import annotations

import time
from functools import cache
from typing import Callable

import torch

from .devices import DeviceRates

__all__ = ["calibrate", "best_time", "cost_clock"]


def best_time(fn: Callable[[], object], repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Fastest of ``repeats`` runs: other load only ever slows a run down, so the minimum is the device's
    own speed (what makes plans stable on a shared machine; medians moved with the load)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def cost_clock(device: torch.device) -> Callable[[], float]:
    """With one intra-op thread on CPU all of an op's work runs on the calling thread, so that thread's CPU
    time is the op's cost; unlike wall time it does not grow while other processes hold the cores (which a
    minimum over runs cannot undo for a run of 100 ms under steady load), and it does include the
    kernel's page-fault time. Elsewhere (more threads, CUDA), wall time."""
    return time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter


@cache
def calibrate(device: str = "cpu") -> DeviceRates:
    """Measure this device's matmul rate, memory bandwidth and per-op overhead (about 0.2 s, cached).

    Rates are rounded to two significant digits so that plans stay byte-identical across runs on one
    machine unless the machine really changed speed.
    """
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator(device=dev).manual_seed(0)  # never the user's global random stream
    a = torch.randn(512, 512, device=dev, generator=gen)
    # Streaming bandwidth: two inputs and a preallocated output, each larger than a last-level cache.
    # (A 16 MiB ``big + big`` sat at the size of this class of CPU's L3 and allocated its output every
    # call, so it read as 7 GB/s in one process and 60 GB/s in the next.)
    n_big = 16 * 1024 * 1024
    src1, src2, dst = (torch.randn(n_big, device=dev, generator=gen) for _ in range(3))
    tiny = torch.randn(8, device=dev, generator=gen)
    # Fresh memory: 64 MiB is above glibc's largest mmap threshold (32 MiB), so on CPU every call maps new
    # pages, as a step's new weight gradients do once malloc has trimmed them; CUDA's caching allocator
    # reuses its blocks, so there this is plain write bandwidth.
    n_fresh = 16 * 1024 * 1024

    def run(f):
        return lambda: (f(), sync())

    clock = cost_clock(dev)
    mm = best_time(run(lambda: a @ a), 10, clock)
    add = best_time(run(lambda: torch.add(src1, src2, out=dst)), 10, clock)
    small = best_time(run(lambda: tiny + tiny), 200)  # ~1 us: reading a CPU-time clock costs about as much
    fresh = best_time(run(lambda: torch.empty(n_fresh, device=dev).fill_(1.0)), 5, clock)

    def r2(value: float) -> float:
        return float(f"{value:.2g}")

    return DeviceRates(
        flops_per_s=r2(2 * 512 ** 3 / mm),
        bytes_per_s=r2(3 * n_big * 4 / add),
        op_overhead_s=r2(small),
        grad_bytes_per_s=r2(n_fresh * 4 / fresh),
    )


