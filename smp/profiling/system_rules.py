"""Rules on the system monitor's samples (:mod:`pipeline.system_monitor`), each with its numbers and a
recommendation, as SageMaker Debugger's profiler rules of the same names do for a training job.

* **CPUBottleneck**: the step waits on data (the DataBound measure, :meth:`Measurements.data_ratios`, above
  ``Thresholds.data``) while the host's cores are saturated (mean busy >= 90% during the waits) by processes
  other than the ranks themselves (>= 25% of the cores: data-loader workers, another job). Saturation alone
  proves nothing: a healthy job whose ranks fill the cores is saturated too, and its step does not wait.
* **IOBottleneck**: the step waits on data while the cores spend >= 10% of their time waiting on I/O (iowait).
* **LowGPUUtilization** (CUDA, with NVML samples): the 95th percentile of a device's utilisation is below 70%
  (SageMaker's default), the device idles most of the time.
* **MemoryGrowth**: a rank's resident memory or CUDA allocated memory, sampled after every step, rises in >= 75%
  of the step-over-step differences by >= 1 MiB per step (least-squares slope): something keeps a reference
  per step.

The samples "during the waits" are the CPU samples taken inside a rank's time between steps (each averages
the interval before it); with fewer than two of them, every sample of the window counts.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from smp.profiling.findings import Finding, Thresholds
from smp.profiling.measurements import Measurements
from smp.profiling.system_samples import SystemSamples

__all__ = ["SYSTEM_RULES", "cpu_during_waits"]

_NO_MONITOR = "no system monitor samples (profile with the system monitor on: \"profile\": {\"monitor_s\": 0.2})"


def _waits(m: Measurements, rank: int, times: np.ndarray, interval_s: float) -> np.ndarray:
    """Which of ``times`` fall in ``rank``'s time between steps (a sample covers the interval before it:
    the mask reaches half an interval past each wait's end)."""
    mask = np.zeros(len(times), dtype=bool)
    for e in m.events:
        if e.rank == rank and e.cat == "between":
            mask |= (times > e.start) & (times <= e.end + interval_s / 2)
    return mask if mask.sum() >= 2 else np.ones(len(times), dtype=bool)


def _mean_in(s: SystemSamples, name: str, key: str, start: float, end: float) -> float:
    """The mean of ``key`` of counter ``name`` over the samples in [start, end] (all samples if none)."""
    series = s.series[name]
    inside = (series.times >= start) & (series.times <= end)
    values = series[key][inside] if inside.any() else series[key]
    return float(values.mean()) if len(values) else 0.0


def cpu_during_waits(m: Measurements, rank: int) -> dict[str, float] | None:
    """What the host's cores did while ``rank`` waited between steps: ``busy`` (mean share of the cores busy),
    ``cores``, ``ranks_cores`` (cores used by the ranks' own processes on that host), ``others_cores`` (by any
    other process), ``children`` and ``children_cores`` (the ranks' child processes: data-loader workers), and
    ``iowait`` (share of CPU time waiting on I/O). None without CPU samples on ``rank``."""
    s = m.system.get(rank)
    if s is None or "cpu" not in s:
        return None
    cpu = s.series["cpu"]
    mask = _waits(m, rank, cpu.times, s.interval_s)
    busy_matrix = s.core_busy[mask]
    cores = busy_matrix.shape[1] or s.cores or 1
    busy = float(busy_matrix.mean()) / 100.0 if busy_matrix.size else 0.0
    start, end = float(cpu.times[mask].min()), float(cpu.times[mask].max())
    peers = [q for q, p in m.system.items() if p.host == s.host and "process" in p]
    ranks_cores = sum(_mean_in(m.system[q], "process", "cpu_cores", start, end) for q in peers)
    children = sum(_mean_in(m.system[q], "process", "children", start, end) for q in peers)
    children_cores = sum(_mean_in(m.system[q], "process", "children_cpu_cores", start, end) for q in peers)
    return {"busy": busy, "cores": float(cores), "ranks_cores": ranks_cores,
            "others_cores": max(busy * cores - ranks_cores, 0.0), "children": children,
            "children_cores": children_cores, "iowait": float(cpu["iowait"][mask].mean()) / 100.0}


def _cpu_bottleneck(m: Measurements, t: Thresholds) -> Finding:
    if not any("cpu" in s for s in m.system.values()):
        return Finding("CPUBottleneck", False, _NO_MONITOR)
    ratios = m.data_ratios()
    waiting = {r: v for r, v in ratios.items() if v > t.data}
    if not waiting:
        return Finding("CPUBottleneck", False, "the step does not wait on data (DataBound quiet): busy cores alone "
                       "are a job using its host")
    cpu = {r: c for r in waiting if (c := cpu_during_waits(m, r)) is not None}
    if not cpu:
        return Finding("CPUBottleneck", False, _NO_MONITOR)
    slow = sorted(r for r, c in cpu.items()
                  if c["busy"] >= t.cpu_busy and c["others_cores"] >= t.cpu_others * c["cores"])
    r = max(cpu, key=lambda q: (q in slow, cpu[q]["others_cores"]))
    c = cpu[r]
    summary = (f"rank {r} waits {waiting[r]:.0%} of its step time for data; meanwhile the host's {c['cores']:.0f} "
               f"cores are {c['busy']:.0%} busy, {c['others_cores']:.2f} cores of it by other processes than the "
               f"ranks, the ranks' {c['children']:.0f} child process(es) (data-loader workers) using "
               f"{c['children_cores']:.2f} cores (thresholds: busy {t.cpu_busy:.0%}, others {t.cpu_others:.0%} of "
               "the cores)")
    return Finding("CPUBottleneck", bool(slow), summary,
                   f"rank(s) {slow} wait for batches the CPU cannot make fast enough: use no more busy data-loader "
                   "workers than free cores (num_workers <= cores - ranks), make each lighter (pre-process the data "
                   "set once, decode/augment on the GPU, torch.set_num_threads(1) in worker_init_fn), keep batches "
                   "ready ahead (pin_memory=True, prefetch_factor, persistent_workers=True), pin ranks and workers "
                   "to disjoint cores (os.sched_setaffinity), and look for other jobs on the host",
                   {"ranks": slow, "data_ratio": waiting, "cpu": cpu})


def _io_bottleneck(m: Measurements, t: Thresholds) -> Finding:
    if not any("cpu" in s for s in m.system.values()):
        return Finding("IOBottleneck", False, _NO_MONITOR)
    waiting = {r: v for r, v in m.data_ratios().items() if v > t.data}
    cpu = {r: c for r in waiting if (c := cpu_during_waits(m, r)) is not None}
    if not cpu:
        return Finding("IOBottleneck", False, "the step does not wait on data (DataBound quiet)")
    slow = sorted(r for r, c in cpu.items() if c["iowait"] >= t.iowait)
    r = max(cpu, key=lambda q: cpu[q]["iowait"])
    io = m.system[r].series.get("io")
    read = float(io["disk_read_bytes_s"].mean()) if io is not None and len(io.times) else 0.0
    recv = float(io["net_recv_bytes_s"].mean()) if io is not None and len(io.times) else 0.0
    summary = (f"rank {r} waits {waiting[r]:.0%} of its step time for data; meanwhile the cores wait on I/O "
               f"{cpu[r]['iowait']:.0%} of their time, reading {read / 2**20:.1f} MiB/s from disk and receiving "
               f"{recv / 2**20:.1f} MiB/s from the network (threshold {t.iowait:.0%} iowait)")
    return Finding("IOBottleneck", bool(slow), summary,
                   f"rank(s) {slow} wait on storage: copy or cache the data set on a local disk (or in memory), read "
                   "fewer, larger files (sharded formats such as WebDataset), and overlap reading with training "
                   "(DataLoader num_workers > 0, prefetch_factor)",
                   {"ranks": slow, "iowait": {q: c["iowait"] for q, c in cpu.items()}, "disk_read_bytes_s": read,
                    "net_recv_bytes_s": recv})


def _low_gpu_utilization(m: Measurements, t: Thresholds) -> Finding:
    util = {r: s.series["gpu"]["util_percent"] for r, s in m.system.items() if "gpu" in s}
    if not util:
        return Finding("LowGPUUtilization", False, "no GPU samples: a CPU run, or nvidia-ml-py is not installed "
                       "(pip install 'smp-engine[gpu]')")
    p95 = {r: float(np.percentile(v, 95)) / 100.0 for r, v in util.items()}
    median = {r: float(np.median(v)) / 100.0 for r, v in util.items()}
    slow = sorted(r for r, v in p95.items() if v < t.gpu_util)
    r = min(p95, key=p95.__getitem__)
    summary = (f"rank {r}'s GPU ({m.system[r].gpu}) is {median[r]:.0%} busy at the median, {p95[r]:.0%} at the "
               f"95th percentile (threshold: 95th percentile below {t.gpu_util:.0%})")
    return Finding("LowGPUUtilization", bool(slow), summary,
                   f"the device(s) of rank(s) {slow} idle: give each pass more work (larger microbatches or batch), "
                   "shrink the bubble (more microbatches, fewer stages), and see DataBound, CPUBottleneck and "
                   "CommBound for what the device waits on", {"ranks": slow, "p95": p95, "median": median})


_MEMORY = {"rss_bytes": "host RSS", "cuda_allocated_bytes": "CUDA allocated memory"}


def _memory_growth(m: Measurements, t: Thresholds) -> Finding:
    growth: dict[tuple[int, str], tuple[float, float, list[float]]] = {}  # (rank, value) -> slope, rising, samples
    for r, values in m.step_memory.items():
        for key in _MEMORY:
            series = values.get(key, [])
            if len(series) >= 4:
                slope = float(np.polyfit(np.arange(len(series)), series, 1)[0])
                growth[r, key] = slope, float((np.diff(series) > 0).mean()), series
    if not growth:
        return Finding("MemoryGrowth", False, "fewer than 4 steps with memory samples: too few to see a trend")
    grew = sorted(k for k, (slope, rising, _) in growth.items() if rising >= t.growth_steps and slope >= t.growth_bytes)
    r, key = max(growth, key=lambda k: (k in grew, growth[k][0]))
    slope, rising, series = growth[r, key]
    summary = (f"rank {r}'s {_MEMORY[key]} changes by {slope / 2**20:+.2f} MiB per step, rising in {rising:.0%} of "
               f"{len(series) - 1} step(s), {series[0] / 2**20:.1f} -> {series[-1] / 2**20:.1f} MiB (thresholds: "
               f"{t.growth_bytes / 2**20:g} MiB per step, rising in {t.growth_steps:.0%})")
    return Finding("MemoryGrowth", bool(grew), summary,
                   f"{', '.join(f'rank {q} ({_MEMORY[k]})' for q, k in grew)} keep something every step: a list of "
                   "losses or outputs appended without .item() or .detach() (which keeps each step's graph), a cache "
                   "keyed by step, tensors kept for logging; find it with tracemalloc (host) or "
                   "torch.cuda.memory._record_memory_history (device); the run will run out of memory",
                   {"ranks": sorted({q for q, _ in grew}), "per_step_bytes": {f"{q} {k}": v[0] for (q, k), v in
                                                                              growth.items()}})


SYSTEM_RULES: tuple[Callable[[Measurements, Thresholds], Finding], ...] = (
    _cpu_bottleneck, _io_bottleneck, _low_gpu_utilization, _memory_growth)
