"""Measuring this machine's device rates (:class:`partitioner.cost.devices.DeviceRates`) for the cost model.

Four microbenchmarks, the only rates the cost model reads from this device: a 512x512 matmul (FLOP/s), a
streaming add over buffers larger than the last-level cache (memory bandwidth), an 8-element add (per-op
dispatch overhead), and a write to freshly mapped memory (what a step's new weight gradients cost). Each
takes the fastest of several runs on the thread's CPU time (see :func:`cost_clock`), because other load
only ever slows a run down.

Even so, a loaded machine measured 6.8e9 to 1.5e11 FLOP/s in five consecutive processes, and plans moved
with it. So the CPU profile is measured once per machine and kept on disk (:func:`cache_file`:
``$XDG_CACHE_HOME/smp-engine/``, by default ``~/.cache/smp-engine/``), keyed by CPU model, torch version and
intra-op thread count: every later process reads the same rates and makes the same plan.
``calibrate(refresh=True)``, or ``SMP_RECALIBRATE=1`` in the environment, measures again and replaces it.

Three rates of the profile are not microbenchmarks but what our runtime pays beyond the ops
(:mod:`pipeline.step_model`): per pass, per step and per collective. They depend on how the OS wakes threads and
delivers loopback messages on this host (fitted on two machines: 1.0 and 0.56 ms per pass, 2 and 10 ms per step), so
they are measured on real 2-rank steps by :mod:`smp.cli.runtime_costs` (``smp calibrate``) and kept beside the
profile, per CPU model and torch version (:func:`record_runtime_costs`, :func:`runtime_costs_file`); until they
are, :data:`CPU_PASS_OVERHEAD_S`, :data:`CPU_STEP_OVERHEAD_S` and :data:`CPU_COLLECTIVE_OVERHEAD_S` stand in.
Re-measuring the microbenchmarks keeps them.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from functools import cache
from pathlib import Path
from typing import Callable

import torch

from .devices import DeviceRates

__all__ = ["calibrate", "best_time", "cost_clock", "cache_dir", "cache_file", "machine_key", "write_atomically",
           "record_runtime_costs", "recorded_runtime_costs", "runtime_costs_file", "RECALIBRATE_ENV",
           "CPU_PASS_OVERHEAD_S", "CPU_STEP_OVERHEAD_S", "CPU_COLLECTIVE_OVERHEAD_S", "TIMING_VERSION", "RUNTIME_COSTS"]

RECALIBRATE_ENV = "SMP_RECALIBRATE"
# Until this machine's are measured: a pass of a pipeline rank on a shared CPU costs about 1 ms more than its ops
# timed alone (two thread hand-offs between the @smp.step function and the executor, posting gloo sends and
# receives, caches the other microbatches' passes left cold), fitted by benchmarks/step_model.py --fit on one host.
CPU_PASS_OVERHEAD_S = 1.0e-3
CPU_STEP_OVERHEAD_S = 2.0e-3  # the step's arguments and results shared over the pipeline, its threads started
# A gloo all-reduce of 512 KB between two local ranks, each after a few ms of compute as a rank's are, cost 2.3 to
# 3.0 ms more than the compute alone on a 2-core VM (back to back: 1 ms).
CPU_COLLECTIVE_OVERHEAD_S = 2.5e-3
# How partitioner.measure times ops (2: weight gradients added into kept ones), in the key of every cached entry
# that depends on it (op times, the runtime costs fitted beside them): entries timed another way are measured again.
TIMING_VERSION = 2
# The DeviceRates fields measured by running the runtime
RUNTIME_COSTS = ("pass_overhead_s", "step_overhead_s", "collective_overhead_s")
_PROFILE_VERSION = 4  # bumped when the profile gains rates or measures one another way: older ones measured again


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


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key() -> dict[str, object]:
    """What a measurement of this machine is kept under: CPU model, torch version, intra-op threads, profile version."""
    return {"cpu": _cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "profile": _PROFILE_VERSION}


def cache_dir() -> Path:
    """Where measurements of this machine are kept: ``$XDG_CACHE_HOME/smp-engine`` (``~/.cache/smp-engine``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "smp-engine"


def _digest(key: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def cache_file() -> Path:
    """Where this machine's CPU profile is kept: one file per (CPU model, torch version, thread count)."""
    return cache_dir() / f"cpu-rates-{_digest(machine_key())}.json"


def _runtime_key() -> dict[str, object]:
    # The runtime's costs are measured with one thread per rank, as ranks run: not kept per pricing thread count.
    # They are fitted beside op times, so they are kept per way of timing ops too.
    return {**{k: v for k, v in machine_key().items() if k != "threads"}, "timing": TIMING_VERSION}


def runtime_costs_file() -> Path:
    """Where this machine's measured runtime costs (:data:`RUNTIME_COSTS`) are kept (per CPU model, torch version)."""
    return cache_dir() / f"cpu-runtime-{_digest(_runtime_key())}.json"


def recorded_runtime_costs() -> dict[str, float] | None:
    """This machine's measured runtime costs (the fields :data:`RUNTIME_COSTS` names and how they were measured), or
    None while they are not measured (the profile then uses the ``CPU_..._OVERHEAD_S`` defaults)."""
    try:
        data = json.loads(runtime_costs_file().read_text())
        if data.get("key") == _runtime_key():
            costs = data["costs"]
            if all(float(costs[k]) >= 0 for k in RUNTIME_COSTS):
                return costs
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass  # missing or unreadable: not measured
    return None


def record_runtime_costs(pass_overhead_s: float, step_overhead_s: float,
                         collective_overhead_s: float = CPU_COLLECTIVE_OVERHEAD_S, **how: float) -> DeviceRates:
    """Keep this machine's measured runtime costs (``how``: figures of the measurement, kept with them); every later
    :func:`calibrate` of ``cpu``, in this process and others, prices passes, steps and collectives with them."""
    costs = dict(zip(RUNTIME_COSTS, (pass_overhead_s, step_overhead_s, collective_overhead_s)))
    for name, value in costs.items():
        if not value >= 0:
            raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
    costs = {**how, **{k: float(v) for k, v in costs.items()}}
    write_atomically(runtime_costs_file(), {"key": _runtime_key(), "costs": costs})
    for path, rates in _LOADED.items():
        _LOADED[path] = _with_runtime_costs(rates, costs)
    return calibrate("cpu")


def _with_runtime_costs(rates: DeviceRates, costs: dict[str, float] | None) -> DeviceRates:
    if costs is None:
        return rates
    return DeviceRates.from_dict({**rates.to_dict(), **{k: float(costs[k]) for k in RUNTIME_COSTS}})


# Per cache file, the profile this process uses (so SMP_RECALIBRATE measures once per process, not per call).
_LOADED: dict[str, DeviceRates] = {}


def calibrate(device: str = "cpu", *, refresh: bool = False) -> DeviceRates:
    """This device's rates: on CPU, the profile cached on disk for this machine (measured, in about 0.5 s,
    and stored on first use) with the runtime costs measured here (:func:`recorded_runtime_costs`);
    ``refresh=True``, or ``SMP_RECALIBRATE=1`` when a process first asks, measures the profile again and replaces
    it. Other devices are measured once per process."""
    if torch.device(device).type != "cpu":
        return _measured(device)
    path = cache_file()
    if refresh or str(path) not in _LOADED:
        from_env = os.environ.get(RECALIBRATE_ENV, "") not in ("", "0")
        _LOADED[str(path)] = _with_runtime_costs(_cpu_profile(path, refresh or from_env), recorded_runtime_costs())
    return _LOADED[str(path)]


def _cpu_profile(path: Path, refresh: bool) -> DeviceRates:
    """The cached profile at ``path`` if it is this machine's, else a new measurement written there."""
    key = machine_key()
    if not refresh:
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key:
                return DeviceRates.from_dict(data["rates"])
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            pass  # missing or unreadable: measure and write it again
    rates = _measure("cpu")
    write_atomically(path, {"key": key, "rates": rates.to_dict()})
    return rates


def write_atomically(path: Path, data: object) -> None:
    """``data`` as JSON at ``path``, replacing it at once (a concurrent reader sees the old file or the new one);
    a read-only home is no error: the measurement is just not kept."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as fh:
            json.dump(data, fh, sort_keys=True)
        os.replace(fh.name, path)
    except OSError:
        pass


@cache
def _measured(device: str) -> DeviceRates:
    return _measure(device)


def _measure(device: str) -> DeviceRates:
    """Measure this device's matmul rate, memory bandwidth, per-op overhead and fresh-write rate.

    Rates are rounded to two significant digits so that small differences between measurements do not
    show in plans.
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
        name=dev.type,
        flops_per_s=r2(2 * 512 ** 3 / mm),
        bytes_per_s=r2(3 * n_big * 4 / add),
        op_overhead_s=r2(small),
        grad_bytes_per_s=r2(n_fresh * 4 / fresh),
        pass_overhead_s=CPU_PASS_OVERHEAD_S if dev.type == "cpu" else 0.0,
        step_overhead_s=CPU_STEP_OVERHEAD_S if dev.type == "cpu" else 0.0,
        collective_overhead_s=CPU_COLLECTIVE_OVERHEAD_S if dev.type == "cpu" else 0.0,
    )


