"""``smp.nn.DistributedLinear``: SMP v1's tensor-parallel ``nn.Linear``.

SMP v1 splits its input features over the tensor-parallel ranks (each rank multiplies its slice of the
features, for the whole tp group's batch, and a reduce-scatter sums the partial products). Here the module is
an ``nn.Linear`` of the global sizes, and the engine's tensor parallelism splits it on the traced graph
(:mod:`partitioner.tp.sharding`: column- or row-parallel, whichever its neighbours make cheaper); the function is
the same.
"""
from __future__ import annotations

import torch

from smp.nn.dist_module import DistributedModule

__all__ = ["DistributedLinear"]


class DistributedLinear(torch.nn.Linear, DistributedModule):
    """``nn.Linear(in_features, out_features, bias)`` with SMP's constructor: the sizes are global (the whole
    layer across the tp ranks); after ``smp.DistributedModel`` the weight is this rank's slice."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias=bias)
