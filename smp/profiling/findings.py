"""The vocabulary of the rules (:mod:`smp.profiling.rules`, :mod:`smp.profiling.system_rules`): a rule's
:class:`Finding` on a profile, and the :class:`Thresholds` every rule fires at."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Finding", "Thresholds"]


@dataclass(frozen=True)
class Thresholds:
    """When each rule fires (see the docstrings of :mod:`smp.profiling.rules` and
    :mod:`smp.profiling.system_rules`)."""

    imbalance: float = 1.10
    drift: float = 0.25
    step_drift: float = 0.25      # StepDrift: the median step this far from the plan's predicted step
    straggler: float = 1.2
    outlier: float = 1.5
    data: float = 0.10
    comm: float = 0.20
    bubble: float = 0.10
    cpu_busy: float = 0.90        # CPUBottleneck: the host's cores this busy while the step waits on data ...
    cpu_others: float = 0.25      # ... and this share of the cores used by other processes than the ranks
    iowait: float = 0.10          # IOBottleneck: CPU time waiting on I/O while the step waits on data
    gpu_util: float = 0.70        # LowGPUUtilization: the 95th percentile of device utilisation below this
    growth_steps: float = 0.75    # MemoryGrowth: memory rose in this share of the steps ...
    growth_bytes: float = 2**20   # ... by this many bytes per step or more (least-squares slope)


@dataclass
class Finding:
    """One rule's verdict on one profile."""

    rule: str
    fired: bool
    summary: str
    recommendation: str = ""
    numbers: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        head = f"{self.rule}: {'FIRED' if self.fired else 'ok'}: {self.summary}"
        return f"{head}\n  -> {self.recommendation}" if self.fired and self.recommendation else head
