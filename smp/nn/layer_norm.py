"""``smp.nn.FusedLayerNorm``: apex's layer-norm module.

``FusedLayerNorm`` stands in for apex's ``FusedLayerNorm`` (SMP's replacement for it takes the same
arguments). apex fuses layer normalisation (Ba et al. 2016, "Layer Normalization", arXiv:1607.06450) into
one CUDA kernel; ``torch.nn.LayerNorm`` computes the same function and has fused kernels of its own, so it
is that, with apex's constructor: parameters ``weight`` and ``bias``, state-dict keys unchanged.
"""
from __future__ import annotations

from typing import Any

import torch

from smp.runtime.compat import warn_no_effect

__all__ = ["FusedLayerNorm"]


class FusedLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` with apex's signature ``(normalized_shape, eps=1e-5, elementwise_affine=True)``.

    apex's ``memory_efficient=True`` (keep the output instead of the input for backward) is accepted and
    changes nothing; ``device``/``dtype`` are torch's factory arguments."""

    def __init__(self, normalized_shape: int | list[int] | torch.Size, eps: float = 1e-5,
                 elementwise_affine: bool = True, memory_efficient: bool = False, *, device: Any = None,
                 dtype: Any = None):
        if memory_efficient:
            warn_no_effect("FusedLayerNorm(memory_efficient=True)",
                           "it is torch.nn.LayerNorm, which keeps what its own backward needs")
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, device=device,
                         dtype=dtype)
