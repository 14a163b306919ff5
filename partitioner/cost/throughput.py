"""Throughput and model FLOPs utilisation (MFU) of a step: the one definition every figure of a run uses.

The figures are the **job's**, as ``smp plan`` prices a layout (:mod:`partitioner.layout.score`): a step ran
``samples`` samples (and ``tokens`` tokens, when its input is token ids) in ``seconds`` of wall time on ``devices``
devices. Every pipeline of the job runs its step at once, so the samples are one pipeline's times the data-parallel
replicas and the devices every pipeline's ranks (pp x tp x dp). Its **model FLOPs** are the plan's forward FLOPs per
microbatch (:attr:`partitioner.cut.plan.StageSummary.flops`, summed over stages) × microbatches × 3 for a training
step (forward, and a backward of twice the forward) or × 1 for a forward-only step, times the pipelines. They are the
model's FLOPs, not the hardware's: activation recomputation is not counted. Then

* ``flops_per_s_per_device = model_flops / (seconds × devices)``;
* ``mfu = flops_per_s_per_device / peak``, where ``peak`` is the device profile's matmul rate in the plan's
  training dtype (:meth:`partitioner.cost.devices.DeviceRates.matmul_flops_per_s`, the datasheet's dense peak for a
  GPU profile, or the rate of hand-made rates); None when the plan records no rates, and on a profile
  :func:`partitioner.calibrate` measured on this machine (``cpu``): its rate is a 512 x 512 matmul timed here, not a
  peak, so a share of it (30% at 0.03 TFLOP/s) would read as a GPU's MFU and mean something else (:func:`peak_of`).

Under tensor parallelism a pipeline's plan is that of one tp rank's shard (the tp ranks of a replica are pipelines of
their own, on the same samples), so an op every tp rank repeats (a norm, a residual) counts once per tp rank.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from partitioner.cost.devices import DeviceRates

__all__ = ["Throughput", "batch_counts", "measure", "from_counts", "model_flops", "peak_flops_per_s", "peak_of",
           "MEASURED_PROFILES"]

# The names partitioner.calibrate gives the profiles it measures on this machine (torch's device type): no peak.
MEASURED_PROFILES = frozenset({"cpu", "cuda", "mps", "xpu"})


@dataclass(frozen=True)
class Throughput:
    """The figures of one step; see the module docstring for their definitions."""

    seconds: float                 # the step's wall time (the slowest rank of the pipeline)
    samples: int                   # the job's samples in the step (over all microbatches and replicas)
    tokens: int | None             # the job's token ids in the step, None when the input is not token ids
    model_flops: float             # plan forward FLOPs per microbatch x microbatches x (3 | 1) x pipelines
    devices: int                   # devices the step ran on (every pipeline's ranks)
    flops_per_s_per_device: float  # model_flops / (seconds x devices)
    peak_flops_per_s: float | None  # the device profile's peak, None when unknown
    mfu: float | None              # flops_per_s_per_device / peak_flops_per_s

    @property
    def samples_per_s(self) -> float:
        """Samples per second."""
        return self.samples / self.seconds if self.seconds > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per second (None when the input is not token ids)."""
        if self.tokens is None:
            return None
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    def counts(self) -> dict[str, float]:
        """What was counted (seconds, samples, tokens when known, model FLOPs, devices), as :func:`from_counts`
        takes it back: the record of a step in a profile (:mod:`pipeline.profiler`'s ``throughput`` counter)."""
        out = {"seconds": self.seconds, "samples": float(self.samples), "model_flops": self.model_flops,
               "devices": float(self.devices)}
        return out if self.tokens is None else {**out, "tokens": float(self.tokens)}

    def to_dict(self) -> dict[str, Any]:
        """The fields and the rates, for logs and JSON."""
        return {**asdict(self), "samples_per_s": self.samples_per_s, "tokens_per_s": self.tokens_per_s}

    def __str__(self) -> str:
        tokens = f", {self.tokens_per_s:.1f} tokens/s" if self.tokens_per_s is not None else ""
        mfu = f", MFU {self.mfu:.2%}" if self.mfu is not None else ""
        return (f"{self.samples_per_s:.1f} samples/s{tokens}, {self.flops_per_s_per_device / 1e9:,.2f} "
                f"GFLOP/s per device{mfu} ({self.seconds * 1e3:.1f} ms on {self.devices} device(s))")


def _is_token_name(name: str) -> bool:
    low = name.lower()
    return ("ids" in low or "token" in low) and not any(w in low for w in ("type", "position", "mask"))


def batch_counts(microbatch_inputs: Sequence[Mapping[str, Any]]) -> tuple[int, int | None]:
    """(samples, tokens) of a step from each microbatch's model inputs (name -> value). Samples: the leading
    dimension of the first tensor input (1 for a 0-d one). Tokens: the elements of the integer 2-d input named
    like token ids (``input_ids``, ``tokens``; not ``token_type_ids``, ``position_ids`` or masks), or of the only
    tensor input when it is an integer 2-d tensor (``model(x)`` on token ids); None otherwise."""
    samples, tokens = 0, 0
    found = False
    for inputs in microbatch_inputs:
        tensors = [(n, v) for n, v in inputs.items() if isinstance(v, torch.Tensor)]
        if not tensors:
            continue
        first = tensors[0][1]
        samples += int(first.shape[0]) if first.dim() else 1
        ids = [v for n, v in tensors if v.dim() == 2 and not v.is_floating_point() and v.dtype != torch.bool
               and (_is_token_name(n) or len(tensors) == 1)]
        if ids:
            found = True
            tokens += ids[0].numel()
    return samples, tokens if found else None


def model_flops(plan: Any, microbatches: int, train: bool) -> float:
    """The step's model FLOPs: the plan's forward FLOPs per microbatch × microbatches × (3 | 1)."""
    return float(sum(s.flops for s in plan.stages)) * microbatches * (3 if train else 1)


def peak_flops_per_s(plan: Any) -> float | None:
    """The peak of the device the plan was priced for, in its training dtype (None without rates, or with rates
    measured on this machine: :func:`peak_of`)."""
    if not getattr(plan, "rates", None):
        return None
    return peak_of(DeviceRates.from_dict(plan.rates), plan.options.get("dtype") or "fp32")


def peak_of(rates: DeviceRates, dtype: str) -> float | None:
    """The peak MFU is a share of: ``rates``' matmul rate in ``dtype``; None for a profile measured on this machine
    (:data:`MEASURED_PROFILES`, the calibrated ``cpu``), whose rate is not a peak (module docstring)."""
    return None if rates.name in MEASURED_PROFILES else rates.matmul_flops_per_s(dtype)


def measure(plan: Any, seconds: float, microbatch_inputs: Sequence[Mapping[str, Any]], train: bool,
            devices: int, pipelines: int = 1, replicas: int = 1) -> Throughput:
    """The job's :class:`Throughput` of a step of ``plan`` that took ``seconds``, one pipeline's ranks being
    ``devices`` devices and ``microbatch_inputs`` its inputs, in a job of ``pipelines`` such pipelines holding
    ``replicas`` data-parallel replicas (pipelines / tp)."""
    samples, tokens = batch_counts(microbatch_inputs)
    return from_counts(seconds, samples * replicas, None if tokens is None else tokens * replicas,
                       model_flops(plan, len(microbatch_inputs), train) * pipelines, devices * pipelines,
                       peak_flops_per_s(plan))


def from_counts(seconds: float, samples: int, tokens: int | None, flops: float, devices: int,
                peak: float | None) -> Throughput:
    """The :class:`Throughput` of a step that ran ``samples`` samples (``tokens`` tokens) and ``flops`` model FLOPs in
    ``seconds`` on ``devices`` devices of peak rate ``peak`` (see the module docstring)."""
    per_device = flops / (seconds * devices) if seconds > 0 and devices > 0 else 0.0
    return Throughput(seconds=seconds, samples=samples, tokens=tokens, model_flops=flops, devices=devices,
                      flops_per_s_per_device=per_device, peak_flops_per_s=peak,
                      mfu=per_device / peak if peak else None)
