"""The system monitor of a profile: a sampler thread per rank that records what the host and its device did
while the profiled steps ran.

What SageMaker Debugger's system monitor records for a training job, here for one rank: every ``interval_s``
(100-500 ms is the useful range) a daemon thread appends counter samples to the rank's
:class:`pipeline.timeline.Recorder`, so they travel with the spans into ``trace.json`` (Chrome counter tracks)
and are read back by :mod:`smp.profiling.measurements`:

* ``"cpu"``: the busy percentage of every core (``"core 0"``, ...) and the share of CPU time waiting on I/O
  (``"iowait"``), since the previous sample;
* ``"process"``: this rank's process (its CPU in cores -- 1.0 is one core busy -- and resident memory) and its
  child processes, the data-loader workers (their count, CPU in cores and resident memory);
* ``"system"``: the host's used and available memory;
* ``"io"``: disk read/write and network receive/send bytes per second since the previous sample;
* ``"gpu"`` (CUDA with ``nvidia-ml-py`` installed, the ``gpu`` extra): the device's utilisation and memory
  used, through NVML. Without it there are no GPU samples, and no error.

Every reading comes from ``psutil`` (``nvidia-ml-py`` for the device); a sample is a handful of small file
reads and one small dict, well under a millisecond. The list of child processes is refreshed once a second
rather than every sample: walking the process table is the dearest read, and workers live for the epoch.
The thread times its own samples on its CPU clock, which is what profiling reports as the monitor's cost.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import psutil

from pipeline.timeline import Recorder

__all__ = ["SystemMonitor", "MONITOR_COUNTERS"]

MONITOR_COUNTERS = ("cpu", "process", "system", "io", "gpu")  # the counter names the monitor records
_CHILDREN_EVERY_S = 1.0  # how often the list of child processes is refreshed


class SystemMonitor:
    """Samples this host (and its CUDA ``device``, if any) into ``recorder`` every ``interval_s`` seconds
    between :meth:`start` and :meth:`stop` (see the module docstring)."""

    def __init__(self, recorder: Recorder, interval_s: float, device: Any = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"the system monitor's interval must be > 0 seconds, got {interval_s!r}")
        self.recorder = recorder
        self.interval_s = float(interval_s)
        self.device = device
        self.samples = 0
        self.cost_s = 0.0            # CPU seconds the samples took, on the monitor thread's clock
        self.process = psutil.Process()
        self.children: dict[int, psutil.Process] = {}
        self.gpu: Any = None         # the NVML device handle, when NVML answers
        self.gpu_name: str | None = None
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        self.last: tuple[float, float, float, float, float] | None = None  # time, disk r/w, net recv/sent bytes
        self.children_at = 0.0

    def start(self) -> None:
        """Prime the readings (psutil's percentages count from the previous call) and start sampling."""
        if self.thread is not None:
            return
        self.gpu, self.gpu_name = _nvml_handle(self.device)
        psutil.cpu_times_percent(percpu=True)
        self.process.cpu_percent()
        self._refresh_children(time.perf_counter())
        self.last = _io_totals()
        self.thread = threading.Thread(target=self._run, name="smp-system-monitor", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop sampling (what was sampled stays in the recorder)."""
        self.stopped.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()

    def summary(self) -> dict[str, Any]:
        """What ``profile.json`` says about this rank's monitor: the host, its cores, the interval, the samples
        taken and what one cost, and the GPU sampled (None: none)."""
        return {"host": socket.gethostname(), "pid": os.getpid(), "cores": psutil.cpu_count() or 1,
                "interval_s": self.interval_s, "samples": self.samples,
                "per_sample_s": self.cost_s / self.samples if self.samples else 0.0, "gpu": self.gpu_name}

    def _run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            t0 = time.thread_time()
            self.sample()
            self.cost_s += time.thread_time() - t0
            self.samples += 1

    def sample(self) -> None:
        """Record one sample of every counter (see the module docstring)."""
        rec = self.recorder
        cores = psutil.cpu_times_percent(percpu=True)
        cpu = {f"core {i}": max(100.0 - c.idle - getattr(c, "iowait", 0.0), 0.0) for i, c in enumerate(cores)}
        cpu["iowait"] = sum(getattr(c, "iowait", 0.0) for c in cores) / max(len(cores), 1)
        rec.counter("cpu", cpu)
        now = time.perf_counter()
        if now - self.children_at >= _CHILDREN_EVERY_S:
            self._refresh_children(now)
        with self.process.oneshot():
            own_cpu, own_rss = self.process.cpu_percent(), self.process.memory_info().rss
        kids_cpu = kids_rss = 0.0
        for pid, child in list(self.children.items()):
            try:
                with child.oneshot():
                    kids_cpu += child.cpu_percent()
                    kids_rss += child.memory_info().rss
            except psutil.Error:  # the worker ended since the last refresh
                del self.children[pid]
        rec.counter("process", {"cpu_cores": own_cpu / 100.0, "rss_bytes": float(own_rss),
                                "children": float(len(self.children)), "children_cpu_cores": kids_cpu / 100.0,
                                "children_rss_bytes": kids_rss})
        mem = psutil.virtual_memory()
        rec.counter("system", {"used_bytes": float(mem.total - mem.available), "available_bytes": float(mem.available)})
        totals = _io_totals()
        if self.last is not None and totals[0] > self.last[0]:
            dt = totals[0] - self.last[0]
            rec.counter("io", {name: (a - b) / dt for name, a, b in
                               zip(("disk_read_bytes_s", "disk_write_bytes_s", "net_recv_bytes_s", "net_sent_bytes_s"),
                                   totals[1:], self.last[1:])})
        self.last = totals
        if self.gpu is not None:
            self._sample_gpu()

    def _refresh_children(self, now: float) -> None:
        """Keep the Process objects of children already known (their CPU percentage counts from the previous
        call on the same object); a new child's first reading primes it."""
        self.children_at = now
        try:
            current = {c.pid: c for c in self.process.children(recursive=True)}
        except psutil.Error:
            return
        for pid, child in current.items():
            if pid not in self.children:
                try:
                    child.cpu_percent()
                    self.children[pid] = child
                except psutil.Error:
                    pass
        for pid in set(self.children) - set(current):
            del self.children[pid]

    def _sample_gpu(self) -> None:
        import pynvml

        try:
            util = pynvml.nvmlDeviceGetUtilizationRates(self.gpu)
            mem = pynvml.nvmlDeviceGetMemoryInfo(self.gpu)
        except pynvml.NVMLError:  # a device that stops answering: stop asking, keep the other counters
            self.gpu = None
            return
        self.recorder.counter("gpu", {"util_percent": float(util.gpu), "memory_util_percent": float(util.memory),
                                      "memory_used_bytes": float(mem.used), "memory_total_bytes": float(mem.total)})


def _io_totals() -> tuple[float, float, float, float, float]:
    """(now, disk bytes read, written, network bytes received, sent) since boot; 0 where the OS reports none."""
    disk, net = psutil.disk_io_counters(), psutil.net_io_counters()
    return (time.perf_counter(), float(disk.read_bytes if disk else 0), float(disk.write_bytes if disk else 0),
            float(net.bytes_recv if net else 0), float(net.bytes_sent if net else 0))


def _nvml_handle(device: Any) -> tuple[Any, str | None]:
    """The NVML handle and name of a CUDA ``device``; (None, None) on CPU, or when ``pynvml`` (the ``gpu``
    extra, ``nvidia-ml-py``) is not installed or NVML does not answer: the GPU counters are optional."""
    if device is None or getattr(device, "type", None) != "cuda":
        return None, None
    try:
        import pynvml
    except ImportError:
        return None, None
    import torch

    try:
        pynvml.nvmlInit()
        props = torch.cuda.get_device_properties(device)
        try:  # the device's UUID names the same GPU to CUDA and NVML whatever CUDA_VISIBLE_DEVICES reorders
            handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{props.uuid}")
        except pynvml.NVMLError:
            handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        return handle, str(props.name)
    except (pynvml.NVMLError, RuntimeError, AttributeError):  # no driver, no permission, an old torch
        return None, None
