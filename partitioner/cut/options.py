"""The options of a partition, in one dataclass that every entry point shares.

:func:`partitioner.partition`, :class:`partitioner.cut.objective.Problem`, the baselines, ``smp inspect`` and
``smp.DistributedModel`` all read the same :class:`PartitionOptions`, checked once when it is made, so an
option added here reaches every one of them and a bad value fails the same way everywhere.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from numbers import Integral
from typing import Any

from ..cost.calibration import calibrate
from ..cost.devices import DEVICES, LINKS, PRECISIONS, DeviceRates, UnknownDeviceError, profile
from ..cost.pipelines import pipeline_of
from ..cost.precision import OPTIMIZER_STATE_FACTOR
from ..units import UNLIMITED, parse_size

__all__ = ["PartitionOptions", "METHODS", "UNLIMITED"]

METHODS = ("auto", "dp", "metis")


@dataclass(frozen=True)
class PartitionOptions:
    """How to partition: the method, the objective's memory blend and budget, the devices and precision
    the plan is for, and how it will be trained.

    ``method``: ``"auto"`` (the DP and METIS side by side, with the baselines as candidates: keep the
    best), ``"dp"`` or ``"metis"``. ``memory_weight``: SMP's knob, 0 balances time only, 1 memory only.
    ``device``: the device the stages will run on, a profile of :data:`partitioner.cost.devices.DEVICES`
    (``"cpu"``: this machine, measured; ``"a100-40gb"``, ``"a100-80gb"``, ``"h100-80gb"``,
    ``"h200-141gb"``: the vendor's datasheet figures). ``dtype``: the training precision, ``"fp32"``,
    ``"tf32"`` (fp32, matmuls on TF32 tensor cores), ``"bf16"`` or ``"fp16"`` (mixed precision: 16-bit
    activations, weights and gradients, fp32 master weights and optimizer state). ``link`` and
    ``inter_node_link``: link profiles of :data:`partitioner.cost.devices.LINKS` between stages within a node
    and between nodes (None: the device's own, e.g. NVLink and InfiniBand for an H100). ``device_memory``:
    bytes (or a size such as ``"16GiB"``) every stage must fit; None: the device's memory (no limit on
    ``cpu``); ``"unlimited"``: no limit. ``microbatches`` and ``pipeline`` (``"1f1b"``/``"gpipe"``) set the
    activations held in flight; ``optimizer`` (``adam``, ``adamw``, ``sgd``, ``none``) the optimizer state
    per trainable byte. ``rates``: a hand-made :class:`DeviceRates` to price ops with instead of
    ``device``'s. ``measure``: time every op on this machine instead of estimating it (``device="cpu"``,
    ``dtype="fp32"`` only). ``time_prices``: cut the stages as the other options say, then price the chosen cut by
    timing its ops on this machine (as ``measure`` does, cached on disk: :mod:`partitioner.cost.op_times`), so the
    plan's predicted step counts what this CPU pays while the cut stays the cost model's (deterministic; SMP's
    ``trace_execution_times=False``); where the ops cannot run here one by one (no weights, functorch transforms,
    tensor-parallel shards, autocast, another device's profile) the cost model's prices stay.
    ``split_heavy_linears``: compute a linear layer that outweighs half a stage's share (a large vocabulary's LM
    head) in column chunks that the stages share (:mod:`partitioner.capture.chunk`); the chunks' outputs cross the
    link to the stage that computes the loss, so the plan is kept only when it is better with that priced in
    (``benchmarks/end_to_end.py`` against ``--no-split-heavy-linears``).
    ``seed``: METIS's seed (plans are deterministic for a seed).
    """

    method: str = "auto"
    memory_weight: float = 0.2
    device_memory: float | str | None = None
    microbatches: int = 1
    pipeline: str = "1f1b"
    optimizer: str = "adam"
    device: str = "cpu"
    dtype: str = "fp32"
    link: str | None = None
    inter_node_link: str | None = None
    rates: DeviceRates | None = None
    measure: bool = False
    time_prices: bool = False
    split_heavy_linears: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is not known; use one of {METHODS}")
        w = self.memory_weight
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or not 0.0 <= w <= 1.0:
            raise ValueError(f"memory_weight must be in [0, 1], got {w!r}")
        if self.device_memory != UNLIMITED:
            object.__setattr__(self, "device_memory", parse_size(self.device_memory))
        if not isinstance(self.microbatches, Integral) or isinstance(self.microbatches, bool) or self.microbatches < 1:
            raise ValueError(f"microbatches must be a positive integer, got {self.microbatches!r}")
        object.__setattr__(self, "pipeline", pipeline_of(self.pipeline))  # SMP's names too
        if self.optimizer not in OPTIMIZER_STATE_FACTOR:
            raise ValueError(f"optimizer={self.optimizer!r} is not known; use one of {sorted(OPTIMIZER_STATE_FACTOR)}")
        if self.device not in DEVICES:
            raise UnknownDeviceError(f"device={self.device!r} is not known; use one of {list(DEVICES)} "
                             "(or rates=DeviceRates(...) for another device)")
        if self.dtype not in PRECISIONS:
            raise ValueError(f"dtype={self.dtype!r} is not known; use one of {list(PRECISIONS)}")
        for name in ("link", "inter_node_link"):
            if getattr(self, name) is not None and getattr(self, name) not in LINKS:
                raise UnknownDeviceError(f"{name}={getattr(self, name)!r} is not a known link; use one of "
                                         f"{sorted(LINKS)}")
        if self.rates is not None and not isinstance(self.rates, DeviceRates):
            raise TypeError(f"rates must be a partitioner.DeviceRates, got {type(self.rates).__name__}")
        if self.measure and (self.device != "cpu" or self.dtype != "fp32"):
            raise ValueError(f"measure=True times every op on this machine's CPU in fp32, so it cannot price "
                             f"device={self.device!r}, dtype={self.dtype!r}; leave measure off to plan for that "
                             "device from its profile")
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

    def resolve_rates(self) -> DeviceRates:
        """The rates the plan prices ops with: ``rates``, or ``device``'s profile (this machine's cached
        calibration for ``"cpu"``), with the ``link`` and ``inter_node_link`` profiles if named."""
        base = self.rates or (calibrate() if self.device == "cpu" else profile(self.device))
        return base.with_links(self.link, self.inter_node_link)

    def budget(self, rates: DeviceRates) -> float | None:
        """Bytes every stage must fit under ``rates``: ``device_memory``, else the device's memory size."""
        if self.device_memory == UNLIMITED:
            return None
        return rates.memory_bytes if self.device_memory is None else float(self.device_memory)

    def to_dict(self, rates: DeviceRates) -> dict[str, Any]:
        """The options as a plan records them in its JSON, resolved against ``rates`` (the device, links
        and memory budget that applied; the rates themselves are recorded on their own)."""
        return {"memory_weight": self.memory_weight, "device_memory": self.budget(rates),
                "microbatches": self.microbatches, "pipeline": self.pipeline, "optimizer": self.optimizer,
                "device": rates.name, "dtype": self.dtype, "link": rates.link,
                "inter_node_link": rates.inter_node_link, "seed": self.seed,
                "split_heavy_linears": self.split_heavy_linears}

    @classmethod
    def from_dict(cls, data: dict[str, Any], rates: DeviceRates | None = None) -> "PartitionOptions":
        """Options that make the same plan again from a plan's ``options`` (and, to price ops exactly as it
        did, its ``rates``: ``DeviceRates.from_dict(plan.rates)``; without them a device profile or this
        machine's cached calibration is used)."""
        if rates is None and data.get("device") not in DEVICES:
            raise ValueError(f"the plan was priced with hand-made rates (device={data.get('device')!r}); pass "
                             "rates=DeviceRates.from_dict(plan.rates)")
        budget = data.get("device_memory")
        link, inter_node_link = (None, None) if rates else (data.get("link"), data.get("inter_node_link"))
        return cls(memory_weight=data["memory_weight"], device_memory=UNLIMITED if budget is None else budget,
                   microbatches=data["microbatches"], pipeline=data["pipeline"], optimizer=data["optimizer"],
                   device=data["device"] if data.get("device") in DEVICES else "cpu", dtype=data.get("dtype", "fp32"),
                   rates=rates, seed=data.get("seed", 0), link=link, inter_node_link=inter_node_link,
                   split_heavy_linears=data.get("split_heavy_linears", False))
