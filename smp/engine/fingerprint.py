"""Cheap fingerprints of tensors, to tell whether ranks that must hold the same values do.

A fingerprint is a tensor's dtype and shape, its sum and the sum of its magnitudes in float64, and its elements at
:data:`SAMPLES` evenly spaced positions: one pass over the tensor, no random draw (the user's random streams are
untouched), a few dozen bytes to send. Two fingerprints agree when the dtypes, shapes and sampled elements are equal
and the sums agree to rounding (two processes may add in another order: another thread count); two different
batches or two differently seeded weights disagree in their samples and sums.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["SAMPLES", "fingerprint", "difference"]

SAMPLES = 8  # elements read at evenly spaced positions of each tensor
_ROUNDING = 1e-9  # sums agree within this fraction of the sum of magnitudes


def fingerprint(x: torch.Tensor) -> tuple:
    """``(dtype, shape, sum, sum of magnitudes, sampled elements)`` of ``x`` (Python values: it pickles small);
    a tensor that is not dense is described by its layout, dtype and shape alone."""
    x = x.detach()
    head = (str(x.dtype), tuple(x.shape))
    if x.layout != torch.strided:
        return (*head, str(x.layout))
    flat = x.reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    n = flat.numel()
    picks = torch.linspace(0, max(n - 1, 0), min(n, SAMPLES), device=flat.device).round().long()
    samples = tuple(flat[picks].cpu().tolist())
    total = float(flat.sum(dtype=torch.float64)) if n else 0.0
    # Integer sums are exact in float64 (below 2**53): compared exactly. Float sums to rounding of their magnitude.
    magnitude = float(torch.linalg.vector_norm(flat, 1, dtype=torch.float64)) if flat.is_floating_point() and n \
        else 0.0
    return (*head, total, magnitude, samples)


def _same(a: Any, b: Any) -> bool:
    return a == b or (a != a and b != b)  # NaN matches NaN: the same value was passed


def difference(mine: tuple, theirs: tuple) -> str | None:
    """What differs between two :func:`fingerprint` results, in words ("sum 12.0 against 15.5, ..."), the first
    one's values first; None when they agree."""
    if mine[:2] != theirs[:2]:
        return f"a {mine[0]} tensor of shape {list(mine[1])} against a {theirs[0]} tensor of shape {list(theirs[1])}"
    if len(mine) != len(theirs) or len(mine) == 3:
        return None if mine == theirs else f"a {mine[-1]} tensor against a {theirs[-1]} tensor"
    sum_a, mag_a, samples_a = mine[2:]
    sum_b, mag_b, samples_b = theirs[2:]
    sums_agree = _same(sum_a, sum_b) or abs(sum_a - sum_b) <= _ROUNDING * max(mag_a, mag_b)
    if sums_agree and all(_same(a, b) for a, b in zip(samples_a, samples_b)):
        return None
    return (f"sum {sum_a:.9g} against {sum_b:.9g}, elements {_short(samples_a)} against {_short(samples_b)} at "
            f"{len(samples_a)} evenly spaced positions")


def _short(values: tuple) -> str:
    return "[" + ", ".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in values) + "]"
