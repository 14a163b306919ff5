"""The vocabulary of the rules (:mod:`smp.profiling.rules`, :mod:`smp.profiling.system_rules`): a rule's
:class:`Finding` on a profile, the :class:`Thresholds` every rule fires at, and what each rule means in plain terms
(:data:`PLAIN_TERMS`, which ``smp demo`` prints under a rule that fired)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Finding", "Thresholds", "PLAIN_TERMS"]

# What a fired rule means, for someone who has not met pipelines before: no thresholds, no jargon.
PLAIN_TERMS = {
    "StageImbalance": "one stage has more work than the others, so every microbatch the others wait for it",
    "PlanDrift": "the stages' real costs are shared out differently from what the plan assumed when it placed the "
                 "cuts, so the cuts are no longer where the work is even",
    "StepDrift": "a training step took much longer (or shorter) than the plan predicted before the run",
    "Straggler": "one copy of a stage (a data-parallel replica) is slower than its twins, and all of them wait for it "
                 "when they add up their gradients",
    "StepOutlier": "a few steps took much longer than the typical one: something else happened during them (a "
                   "checkpoint, an evaluation, another program)",
    "DataBound": "a noticeable share of each step goes between steps: waiting for the next batch or for the training "
                 "loop's own code",
    "CommBound": "the processes spend much of each step sending activations and gradients to each other or waiting for "
                 "them to arrive",
    "Bubble": "the processes sat idle, waiting on each other, for more of the step than the schedule predicted",
    "CPUBottleneck": "batches come late because the machine's CPU cores are all busy (data loading, other programs)",
    "IOBottleneck": "batches come late because reading the data (disk or network) is slow",
    "LowGPUUtilization": "the GPUs sit idle much of the time, waiting for the CPU, the data or each other",
    "MemoryGrowth": "a process's memory grows step after step, which ends in running out of memory",
}


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
