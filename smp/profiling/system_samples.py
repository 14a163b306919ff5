"""The system monitor's samples of a profile, read back per rank (what :mod:`pipeline.system_monitor` recorded).

A profile's counters are a flat list of ``(rank, name, time, values)``; this module turns each rank's monitor
counters into time series: per counter name, the sample times and one array per value. The per-core CPU
counter becomes a matrix (samples x cores), the heatmap of ``smp report`` and the input of the CPU rules.
The step-end ``"memory"`` counter (the rank's RSS and CUDA memory after every step) is kept per step, which
is what "memory rising step over step" is measured on.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.timeline import Counter

__all__ = ["Series", "SystemSamples", "system_samples", "step_memory"]


@dataclass
class Series:
    """One counter of one rank: the sample ``times`` (seconds, on rank 0's axis) and each value's samples."""

    times: np.ndarray
    values: dict[str, np.ndarray]

    def __getitem__(self, key: str) -> np.ndarray:
        """The samples of value ``key`` (zeros where a sample lacks it)."""
        return self.values.get(key, np.zeros_like(self.times))


@dataclass
class SystemSamples:
    """One rank's system monitor: the host it ran on, its cores, the sampling interval, the GPU it sampled
    (None: none) and, per counter name ("cpu", "process", "system", "io", "gpu"), its :class:`Series`."""

    host: str = ""
    cores: int = 0
    interval_s: float = 0.0
    gpu: str | None = None
    series: dict[str, Series] = field(default_factory=dict)

    def __contains__(self, name: str) -> bool:
        """Whether the monitor recorded counter ``name`` on this rank."""
        return name in self.series and len(self.series[name].times) > 0

    @property
    def core_busy(self) -> np.ndarray:
        """Busy percentage per sample and core: a (samples x cores) matrix, cores in their OS order."""
        if "cpu" not in self:
            return np.zeros((0, self.cores))
        cpu = self.series["cpu"]
        names = sorted((k for k in cpu.values if k.startswith("core ")), key=lambda k: int(k.split()[1]))
        return np.stack([cpu.values[k] for k in names], axis=1) if names else np.zeros((len(cpu.times), 0))


def _series(samples: list[Counter]) -> Series:
    samples = sorted(samples, key=lambda c: c.time)
    keys = sorted({k for c in samples for k in c.values})
    return Series(np.array([c.time for c in samples]),
                  {k: np.array([float(c.values.get(k, 0.0)) for c in samples]) for k in keys})


def system_samples(counters: list[Counter], info: dict[str, Any]) -> dict[int, SystemSamples]:
    """Per rank, its monitor's samples (ranks without any are left out), with the monitor's description from
    ``info`` (profile.json's ``ranks.R.system``)."""
    by_rank: dict[int, dict[str, list[Counter]]] = defaultdict(lambda: defaultdict(list))
    for c in counters:
        if c.name != "memory":
            by_rank[c.rank][c.name].append(c)
    out = {}
    for rank, named in sorted(by_rank.items()):
        described = (info.get("ranks", {}).get(str(rank), {}) or {}).get("system") or {}
        series = {name: _series(samples) for name, samples in named.items()}
        cores = int(described.get("cores") or sum(k.startswith("core ") for k in series.get(
            "cpu", Series(np.zeros(0), {})).values))
        out[rank] = SystemSamples(host=str(described.get("host", "")), cores=cores,
                                  interval_s=float(described.get("interval_s", 0.0)), gpu=described.get("gpu"),
                                  series=series)
    return out


def step_memory(counters: list[Counter]) -> dict[int, dict[str, list[float]]]:
    """Per rank and value of the step-end ``"memory"`` counter (``rss_bytes``, ``cuda_allocated_bytes``...),
    its samples in step order."""
    out: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for c in sorted((c for c in counters if c.name == "memory"), key=lambda c: c.time):
        for k, v in c.values.items():
            out[c.rank][k].append(float(v))
    return {r: dict(v) for r, v in out.items()}
