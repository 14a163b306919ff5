"""The system monitor samples this host: per-core CPU, the process and its children (data-loader workers),
memory, disk and network; no GPU counters on CPU (and no error without NVML)."""
from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest
import torch

from pipeline.system_monitor import MONITOR_COUNTERS, SystemMonitor
from pipeline.timeline import Recorder


def test_the_monitor_samples_the_cores_the_process_and_its_busy_children():
    spin = [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"]
    before = len(psutil.Process().children(recursive=True))  # e.g. multiprocessing's resource tracker
    children = [subprocess.Popen(spin) for _ in range(2)]
    recorder = Recorder(0)
    monitor = SystemMonitor(recorder, 0.1, torch.device("cpu"))
    try:
        monitor.start()
        time.sleep(1.6)  # the children list is refreshed after a second: the busy children are counted by then
    finally:
        monitor.stop()
        for child in children:
            child.kill()
            child.wait()
    names = {c.name for c in recorder.counters}
    assert names == {"cpu", "process", "system", "io"} and names < set(MONITOR_COUNTERS)  # no "gpu" on CPU
    cpu = [c.values for c in recorder.counters if c.name == "cpu"]
    assert 10 <= len(cpu) <= 17 and len(cpu) == monitor.samples
    assert {f"core {i}" for i in range(psutil.cpu_count())} | {"iowait"} == set(cpu[0])
    assert all(0.0 <= v <= 100.0 for sample in cpu for v in sample.values())
    process = [c.values for c in recorder.counters if c.name == "process"]
    late = process[len(process) // 2:]
    assert all(p["children"] == before + 2 for p in late), late
    assert max(p["children_cpu_cores"] for p in late) > 0.5  # two spinning children: busy cores
    assert all(p["rss_bytes"] > 10 * 2**20 for p in process)
    summary = monitor.summary()
    assert summary["cores"] == psutil.cpu_count() and summary["gpu"] is None and summary["samples"] == len(cpu)
    assert 0 < summary["per_sample_s"] < 0.01  # a cheap sample: a handful of small file reads
    n = len(recorder.counters)
    time.sleep(0.25)
    assert len(recorder.counters) == n  # stopped means stopped


def test_the_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval must be > 0 seconds, got 0"):
        SystemMonitor(Recorder(0), 0)
