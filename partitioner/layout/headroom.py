"""The memory a layout may use: the device's memory budget less a headroom kept free for what the estimate omits.

The planner's memory (:func:`partitioner.stage_memory`, :func:`partitioner.sdp.shards.sharded_dp`) counts tensors:
weights, gradients, optimizer state, master weights, activations. A GPU also holds what no tensor accounts for:

* the CUDA context of the process, outside PyTorch's allocator: about 300 MB since CUDA 11.7 loads kernels lazily,
  over 1 GB before (pytorch/pytorch#107667);
* NCCL's buffers, per communicator: 544 to 688 MB per process group on 4 A100s (NVIDIA/nccl#964), and a layout's
  rank is in a pipeline, a data-parallel and a tensor-parallel group;
* blocks PyTorch's CUDA caching allocator has reserved but not allocated: it keeps freed blocks for reuse and splits
  them, so a request that fits no free block asks CUDA for more while the free ones stay reserved (fragmentation;
  the out-of-memory message says "if reserved memory is >> allocated memory" and points at
  ``PYTORCH_CUDA_ALLOC_CONF``). A Llama-3-8B fine-tune on an A100 80GB reserved 16.39 GiB at its peak, and 10.83 GiB
  with ``expandable_segments:True`` (meta-pytorch/torchtune#1185): a third of what it reserved was fragmentation.
  Expandable segments (pytorch/pytorch#96995) grow one segment instead of allocating new ones, which removes most of
  it.

So a plan that uses the whole budget is an out-of-memory error waiting for its first step. :data:`DEFAULT` keeps 10%
free, :data:`partitioner.cut.objective.HEADROOM`, the share the partitioner already leaves free when it can: 7.45 GiB
of an 80 GB H100 (74.5 GiB): about 2.5 GB for the context and three communicators, and 5.5 GB (7% of the device)
for the allocator's reserved blocks, room where every step allocates the same sizes (freed blocks then fit the next
step's requests). Inputs whose shapes change from step to step fragment more (the torchtune run's third): keep more
free (``--memory-headroom 25%``) or set ``expandable_segments:True``. On a 40 GB device 10% leaves about 1.5 GB
beyond the fixed part; a size (``6GiB``) says what to keep directly.

A :class:`Headroom` is a fraction of the budget or a number of bytes; :meth:`Headroom.usable` is what a layout may
use, :meth:`Headroom.cut_budget` the budget its stages are cut under (so that the partitioner's preference for
:data:`~partitioner.cut.objective.HEADROOM` free falls on that line), :func:`parse_headroom` reads ``10%``, ``0.1``
or ``8GiB``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..cut.objective import HEADROOM
from ..units import format_bytes, parse_size

__all__ = ["Headroom", "DEFAULT", "parse_headroom"]


@dataclass(frozen=True)
class Headroom:
    """Memory kept free on every device: ``fraction`` of its budget, or ``nbytes`` (one of them; both 0: none)."""

    fraction: float = 0.0
    nbytes: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.fraction, (int, float)) and 0.0 <= self.fraction < 1.0):
            raise ValueError(f"Headroom.fraction must be in [0, 1), got {self.fraction!r}")
        if not (isinstance(self.nbytes, (int, float)) and math.isfinite(self.nbytes) and self.nbytes >= 0):
            raise ValueError(f"Headroom.nbytes must be a non-negative number of bytes, got {self.nbytes!r}")
        if self.fraction and self.nbytes:
            raise ValueError(f"Headroom: give a fraction or a size, not both (got {self.fraction!r} and "
                             f"{self.nbytes!r} bytes)")

    def kept(self, budget: float) -> float:
        """Bytes kept free of ``budget``."""
        return self.fraction * budget if self.fraction else min(float(self.nbytes), budget)

    def usable(self, budget: float | None) -> float | None:
        """What a layout may use of ``budget`` (None: no budget, no limit)."""
        return None if budget is None else budget - self.kept(budget)

    def cut_budget(self, budget: float | None) -> float | None:
        """The budget to cut a layout's stages under: the one whose :data:`~partitioner.cut.objective.HEADROOM` line
        is :meth:`usable`, at most ``budget`` (``budget`` itself for the default headroom)."""
        if budget is None:
            return None
        if self.fraction:
            return budget * min(1.0, (1.0 - self.fraction) / (1.0 - HEADROOM))
        return min(budget, (budget - self.kept(budget)) / (1.0 - HEADROOM))

    def describe(self) -> str:
        """``10%`` or ``8.0 GiB``."""
        return f"{100 * self.fraction:g}%" if self.fraction or not self.nbytes else format_bytes(self.nbytes)


DEFAULT = Headroom(fraction=HEADROOM)


def parse_headroom(text: str) -> Headroom:
    """``"10%"`` or ``"0.1"`` (a fraction of the budget), ``"8GiB"`` (a size), ``"0"`` (none) -> :class:`Headroom`;
    anything else is an error naming the value and the forms."""
    t = str(text).strip()
    forms = "give a fraction of the budget (0.1 or 10%) or a size (8GiB); 0 keeps nothing free"
    try:
        if t.endswith("%"):
            share = float(t[:-1]) / 100
        elif t.rstrip("0123456789.eE+-") == "":
            share = float(t)
        else:
            return Headroom(nbytes=parse_size(t) or 0.0)
    except ValueError:
        raise ValueError(f"memory headroom {text!r}: {forms}") from None
    if not (math.isfinite(share) and 0.0 <= share < 1.0):
        raise ValueError(f"memory headroom {text!r}: a fraction must be at least 0 and below 1 (100%); {forms}")
    return Headroom(fraction=share)
