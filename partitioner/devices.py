"""Device rates: the throughputs of one device and of its link that turn FLOPs and bytes into seconds.

A :class:`DeviceRates` is what the cost model (:mod:`partitioner.cost`) prices every op with, as a
roofline (Williams et al. 2009, "Roofline: an insightful visual performance model", CACM 52(4)): an op
takes the longer of its FLOPs at ``flops_per_s`` and its bytes at ``bytes_per_s``, plus a fixed dispatch
cost. On this machine's CPU the rates are measured (:mod:`partitioner.calibrate`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["DeviceRates"]


@dataclass(frozen=True)
class DeviceRates:
    """Throughputs of one device and its link, as measured by :func:`partitioner.calibrate` (or set by hand)."""

    flops_per_s: float = 5.0e10
    bytes_per_s: float = 1.0e10
    op_overhead_s: float = 5.0e-6
    link_bytes_per_s: float = 2.0e9
    link_latency_s: float = 5.0e-5
    grad_bytes_per_s: float = 2.0e9   # writing freshly allocated memory (a new weight gradient)

    def comm_s(self, nbytes: float, messages: float = 1.0) -> float:
        """Seconds to send ``nbytes`` in ``messages`` messages over the link (0 for nothing to send)."""
        return 0.0 if nbytes <= 0 else nbytes / self.link_bytes_per_s + messages * self.link_latency_s

    def to_dict(self) -> dict[str, float]:
        """The rates as a JSON-ready dict (the plan's ``rates``)."""
        return asdict(self)
