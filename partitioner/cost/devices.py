"""Device rates: the throughputs of one device and of its links that turn FLOPs and bytes into seconds.

A :class:`DeviceRates` is what the cost model (:mod:`partitioner.cost.roofline`) prices every op with, as a
roofline (Williams et al. 2009, "Roofline: an insightful visual performance model", CACM 52(4)): an op
takes the longer of its FLOPs at the device's FLOP rate and its bytes at its memory bandwidth, each
derated by an efficiency factor, plus a fixed launch cost. Matmul-class ops run at the tensor-core rate of
the training dtype; every other op at the fp32 vector rate.

Profiles for the devices people rent (:data:`PROFILES`) carry the vendor's published peaks; the ``cpu``
profile is this machine, measured by :mod:`partitioner.cost.calibration`. NVIDIA's datasheets quote tensor-core
rates *with 2:4 sparsity*; the dense rates used here are half of those. They quote NVLink and PCIe as
bidirectional totals; a pipeline send goes one way, so links carry half. Latencies and the efficiency
factors are not datasheet figures: they are typical measured values (nccl-tests small-message latency,
cuBLAS GEMM and STREAM-like copy efficiency) and can be changed with :func:`dataclasses.replace`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ..errors import EngineError

__all__ = ["DeviceRates", "Link", "PROFILES", "LINKS", "DEVICES", "PRECISIONS", "profile", "UnknownDeviceError"]

# Training precisions (dtypes) a device is priced in; their bytes are :mod:`partitioner.cost.precision`'s.
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


class UnknownDeviceError(EngineError, ValueError):
    """A device or link profile name that is not known; the message lists the known ones."""


@dataclass(frozen=True)
class Link:
    """One way of moving bytes between two devices: bandwidth in one direction and per-message latency."""

    bytes_per_s: float
    latency_s: float


# Per direction. Sources: NVIDIA A100 Tensor Core GPU datasheet (NVLink 600 GB/s, PCIe Gen4 64 GB/s,
# bidirectional); NVIDIA H100 and H200 Tensor Core GPU datasheets (NVLink 900 GB/s, PCIe Gen5 128 GB/s,
# bidirectional); NVIDIA ConnectX-6 (HDR, 200 Gb/s) and ConnectX-7 (NDR, 400 Gb/s) adapter datasheets;
# AWS EC2 P4d (4 x 100 Gbps EFA for 8 GPUs: 100 Gb/s per GPU pair) and P5 (3,200 Gbps EFAv2 for 8 GPUs:
# 400 Gb/s per GPU) instance pages. Latencies: typical NCCL point-to-point small-message figures.
LINKS: dict[str, Link] = {
    "nvlink3": Link(300e9, 1.0e-5),         # A100 SXM4: third-generation NVLink
    "nvlink4": Link(450e9, 1.0e-5),         # H100 / H200 SXM5: fourth-generation NVLink
    "pcie4": Link(32e9, 1.5e-5),            # PCIe Gen4 x16
    "pcie5": Link(64e9, 1.5e-5),            # PCIe Gen5 x16
    "infiniband-hdr": Link(25e9, 2.0e-5),   # 200 Gb/s HDR InfiniBand, one adapter per GPU
    "infiniband-ndr": Link(50e9, 2.0e-5),   # 400 Gb/s NDR InfiniBand, one adapter per GPU
    "efa-p4d": Link(12.5e9, 3.0e-5),        # AWS Elastic Fabric Adapter on p4d (100 Gb/s per GPU pair)
    "efa-p5": Link(50e9, 3.0e-5),           # AWS EFAv2 on p5 (400 Gb/s per GPU)
    "ethernet-100g": Link(12.5e9, 5.0e-5),  # 100 GbE, NCCL or gloo over TCP
    "ethernet-10g": Link(1.25e9, 1.0e-4),   # 10 GbE, gloo over TCP (the `smp simulate` default)
    "loopback": Link(2.0e9, 5.0e-5),        # gloo over TCP between processes of this machine
}


@dataclass(frozen=True)
class DeviceRates:
    """Throughputs of one device and its links (measured by :func:`partitioner.calibrate`, taken from a
    datasheet profile, or set by hand).

    ``flops_per_s`` is the fp32 rate of the vector units (every op that is not a matmul, and fp32
    matmuls); ``tf32_flops_per_s`` / ``bf16_flops_per_s`` / ``fp16_flops_per_s`` are the dense
    tensor-core rates that matmul-class ops reach in that dtype (None: no tensor cores, ``flops_per_s``).
    ``bytes_per_s`` is the memory bandwidth and ``memory_bytes`` the memory size (None: no limit, the
    CPU). The roofline reaches ``compute_efficiency`` of the FLOP rates and ``memory_efficiency`` of the
    bandwidth; every op also costs ``op_overhead_s`` (a kernel launch). ``grad_bytes_per_s``: writing a
    step's fresh weight gradients. ``link``: the link between the stages of a pipeline (within a node);
    ``inter_node_link``: between nodes. Every field is a plain number or string, so a plan's ``rates``
    JSON gives back the same object: ``DeviceRates(**plan.rates)``. ``pass_overhead_s`` and
    ``step_overhead_s``: what our runtime pays per pass (one stage's forward or backward of a microbatch) and per
    step beyond the ops (:mod:`pipeline.step_model`; measured for the ``cpu`` profile, 0 for the others).
    ``collective_overhead_s``: what one collective (all-reduce, all-gather) costs beyond its ring's transfers and link
    latencies: gloo's thread wake-ups and the ranks' skew on a CPU host, between a rank's ops (measured for the
    ``cpu`` profile: 2.3 to 3 ms on a 2-core VM, where the link's latency prices a point-to-point message at 50 us),
    0 for the others.
    """

    flops_per_s: float = 5.0e10
    bytes_per_s: float = 1.0e10
    op_overhead_s: float = 5.0e-6
    link_bytes_per_s: float = 2.0e9
    link_latency_s: float = 5.0e-5
    grad_bytes_per_s: float = 2.0e9   # writing freshly allocated memory (a new weight gradient)
    name: str = "custom"
    tf32_flops_per_s: float | None = None
    bf16_flops_per_s: float | None = None
    fp16_flops_per_s: float | None = None
    memory_bytes: float | None = None
    compute_efficiency: float = 1.0
    memory_efficiency: float = 1.0
    link: str = "loopback"
    inter_node_link: str = "ethernet-10g"
    inter_node_bytes_per_s: float = 1.25e9
    inter_node_latency_s: float = 1.0e-4
    pass_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    collective_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "str":
                if not isinstance(value, str):
                    raise TypeError(f"DeviceRates.{f.name} must be a string, got {value!r}")
                continue
            if value is None and "None" in f.type:
                continue
            zero_ok = f.name.endswith(("latency_s", "overhead_s"))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or (
                    value < 0 if zero_ok else value <= 0):  # an infinite rate is free: tests use it
                raise ValueError(f"DeviceRates.{f.name} must be a {'non-negative' if zero_ok else 'positive'} "
                                 f"number, got {value!r}")
        for name in ("compute_efficiency", "memory_efficiency"):
            if (fraction := getattr(self, name)) > 1:
                raise ValueError(f"DeviceRates.{name} is a fraction of the peak, in (0, 1]; got {fraction!r}")

    @property
    def collectives_on_host(self) -> bool:
        """Whether the ranks' collectives run through gloo on the cores the ops run on (the ``cpu`` profile), so that
        none hides behind compute (:mod:`partitioner.sdp.overlap` prices nothing hidden) and an all-gather or
        reduce-scatter costs an all-reduce of its output (:func:`partitioner.cost.collectives.all_gather_s`); a
        GPU's run through NCCL beside its kernels (its own SMs and copy engines, a stream of their own)."""
        return self.name == "cpu"

    def matmul_flops_per_s(self, dtype: str) -> float:
        """Peak FLOP/s of matmul-class ops (matmuls, convolutions, attention) trained in ``dtype``."""
        rates = {"fp32": None, "tf32": self.tf32_flops_per_s, "bf16": self.bf16_flops_per_s,
                 "fp16": self.fp16_flops_per_s}
        if dtype not in PRECISIONS:
            raise ValueError(f"dtype={dtype!r} is not known; use one of {list(PRECISIONS)}")
        rate = rates[dtype]
        return self.flops_per_s if rate is None else rate

    def comm_s(self, nbytes: float, messages: float = 1.0) -> float:
        """Seconds to send ``nbytes`` in ``messages`` messages over the link (0 for nothing to send)."""
        return 0.0 if nbytes <= 0 else nbytes / self.link_bytes_per_s + messages * self.link_latency_s

    def with_links(self, link: str | None = None, inter_node_link: str | None = None) -> "DeviceRates":
        """These rates with the named link profiles (:data:`LINKS`) in place of their own (None: keep)."""
        changes: dict[str, Any] = {}
        if link is not None:
            lk = _link(link, "link")
            changes.update(link=link, link_bytes_per_s=lk.bytes_per_s, link_latency_s=lk.latency_s)
        if inter_node_link is not None:
            lk = _link(inter_node_link, "inter_node_link")
            changes.update(inter_node_link=inter_node_link, inter_node_bytes_per_s=lk.bytes_per_s,
                           inter_node_latency_s=lk.latency_s)
        return replace(self, **changes) if changes else self

    def to_dict(self) -> dict[str, Any]:
        """The rates as a JSON-ready dict (the plan's ``rates``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "DeviceRates":
        """The rates of :meth:`to_dict`'s dict (a plan's ``rates``; None or empty, a plan that records none: the
        defaults); unknown keys are an error."""
        data = data or {}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown device rate(s) {unknown}; the rates are {sorted(known)}")
        return cls(**data)


def _link(name: str, what: str) -> Link:
    if name not in LINKS:
        raise UnknownDeviceError(f"{what}={name!r} is not a known link; use one of {sorted(LINKS)}")
    return LINKS[name]


def _gpu(name: str, fp32: float, tf32: float, bf16: float, memory_bytes: float, bytes_per_s: float,
         link: str, inter_node_link: str) -> DeviceRates:
    """A GPU profile: eager PyTorch launches one kernel per op (a few microseconds); a step's weight
    gradients reuse the caching allocator's blocks, so writing them runs at memory bandwidth."""
    return DeviceRates(
        name=name, flops_per_s=fp32, tf32_flops_per_s=tf32, bf16_flops_per_s=bf16, fp16_flops_per_s=bf16,
        bytes_per_s=bytes_per_s, grad_bytes_per_s=bytes_per_s, memory_bytes=memory_bytes, op_overhead_s=5e-6,
        # Checked against published runs in benchmarks/published.py (docs/benchmarks.md): the A100 calibration rows fit
        # 0.75 themselves; the H100 rows ran on power-capped parts, which carry their own efficiency there.
        compute_efficiency=0.75, memory_efficiency=0.85,
    ).with_links(link, inter_node_link)


# Dense peaks (the datasheets' sparsity figures halved), memory in the datasheets' decimal GB (a little
# under what the device reports, which leaves room for the CUDA context and fragmentation).
PROFILES: dict[str, DeviceRates] = {
    # NVIDIA A100 Tensor Core GPU datasheet (A100 40GB / 80GB SXM): FP32 19.5 TFLOPS, TF32 156,
    # BF16 / FP16 312 TFLOPS (dense); HBM2 1,555 GB/s (40GB), HBM2e 2,039 GB/s (80GB).
    "a100-40gb": _gpu("a100-40gb", 19.5e12, 156e12, 312e12, 40e9, 1555e9, "nvlink3", "infiniband-hdr"),
    "a100-80gb": _gpu("a100-80gb", 19.5e12, 156e12, 312e12, 80e9, 2039e9, "nvlink3", "infiniband-hdr"),
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): FP32 67 TFLOPS, TF32 989 / BF16 1,979 / FP16
    # 1,979 TFLOPS with sparsity; 80GB HBM3 at 3.35 TB/s.
    "h100-80gb": _gpu("h100-80gb", 67e12, 494.5e12, 989.5e12, 80e9, 3.35e12, "nvlink4", "infiniband-ndr"),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): the H100's compute; 141GB HBM3e at 4.8 TB/s.
    "h200-141gb": _gpu("h200-141gb", 67e12, 494.5e12, 989.5e12, 141e9, 4.8e12, "nvlink4", "infiniband-ndr"),
}
# "cpu" is this machine, measured (partitioner.calibrate), so it has no fixed profile here.
DEVICES = ("cpu", *PROFILES)


def profile(name: str) -> DeviceRates:
    """The datasheet profile of a rented device (``"h100-80gb"``, ...); ``"cpu"`` is measured instead
    (:func:`partitioner.calibrate`)."""
    if name not in PROFILES:
        hint = " ('cpu' is measured: partitioner.calibrate())" if name == "cpu" else ""
        raise UnknownDeviceError(f"device={name!r} has no datasheet profile{hint}; use one of {list(DEVICES)}")
    return PROFILES[name]
