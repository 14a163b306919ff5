"""The options of a partition, in one dataclass that every entry point shares.

:func:`partitioner.partition`, :class:`partitioner.objective.Problem`, the baselines, ``smp inspect`` and
``smp.DistributedModel`` all read the same :class:`PartitionOptions`, checked once when it is made, so an
option added here reaches every one of them and a bad value fails the same way everywhere.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from numbers import Integral
from typing import Any

from .cost import OPTIMIZER_STATE_FACTOR, PIPELINES
from .devices import DeviceRates
from .units import parse_size

__all__ = ["PartitionOptions", "METHODS"]

METHODS = ("auto", "dp", "metis")


@dataclass(frozen=True)
class PartitionOptions:
    """How to partition: the method, the objective's memory blend and budget, and what the plan is for.

    ``method``: ``"auto"`` (the DP and METIS side by side, keep the better), ``"dp"`` or ``"metis"``.
    ``memory_weight``: SMP's knob, 0 balances time only, 1 memory only. ``device_memory``: bytes (or a
    size such as ``"16GiB"``) every stage must fit, or None. ``microbatches`` and ``pipeline``
    (``"1f1b"``/``"gpipe"``) set the activations held in flight; ``optimizer`` (``adam``, ``adamw``,
    ``sgd``, ``none``) the optimizer state per trainable byte. ``rates``: the device to price ops on (None:
    this machine's calibrated CPU). ``measure``: time every op for real instead of estimating it. ``seed``:
    METIS's seed (plans are deterministic for a seed).
    """

    method: str = "auto"
    memory_weight: float = 0.2
    device_memory: float | str | None = None
    microbatches: int = 1
    pipeline: str = "1f1b"
    optimizer: str = "adam"
    rates: DeviceRates | None = None
    measure: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is not known; use one of {METHODS}")
        w = self.memory_weight
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or not 0.0 <= w <= 1.0:
            raise ValueError(f"memory_weight must be in [0, 1], got {w!r}")
        object.__setattr__(self, "device_memory", parse_size(self.device_memory))
        if not isinstance(self.microbatches, Integral) or isinstance(self.microbatches, bool) or self.microbatches < 1:
            raise ValueError(f"microbatches must be a positive integer, got {self.microbatches!r}")
        if self.pipeline not in PIPELINES:
            raise ValueError(f"pipeline={self.pipeline!r} is not known; use one of {PIPELINES} "
                             "(SMP's 'interleaved' is 1f1b, 'simple' is gpipe)")
        if self.optimizer not in OPTIMIZER_STATE_FACTOR:
            raise ValueError(f"optimizer={self.optimizer!r} is not known; use one of {sorted(OPTIMIZER_STATE_FACTOR)}")
        if self.rates is not None and not isinstance(self.rates, DeviceRates):
            raise TypeError(f"rates must be a partitioner.DeviceRates, got {type(self.rates).__name__}")
        if not isinstance(self.seed, Integral) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @classmethod
    def of(cls, options: "PartitionOptions | None" = None, **changes: Any) -> "PartitionOptions":
        """``options`` (or the defaults) with ``changes`` applied; unknown names are an error that lists
        the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise TypeError(f"unknown partition option(s) {unknown}; the options are {sorted(known)}")
        base = {f.name: getattr(options, f.name) for f in fields(cls)} if options is not None else {}
        return cls(**{**base, **changes})

    def to_dict(self) -> dict[str, Any]:
        """The options a plan records in its JSON (``rates`` are recorded on their own)."""
        return {"memory_weight": self.memory_weight, "device_memory": self.device_memory,
                "microbatches": self.microbatches, "pipeline": self.pipeline, "optimizer": self.optimizer,
                "seed": self.seed}
